"""verify(): run the FP32 model and the candidate on every batch, compare the outputs,
and, on the first batch that fails, name the site where the candidate first departs."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fp16lens._core import VerifyError
from fp16lens._core.options import given, one_form
from fp16lens.verify._batches import as_batches, cast_floats, model_device
from fp16lens.verify._metrics import Accumulator
from fp16lens.verify._options import Tolerance, VerifyOptions, resolve_tolerance
from fp16lens.verify._outputs import named_leaves
from fp16lens.verify._registry import BackendSpec, pick_backend
from fp16lens.verify._result import ParityResult, output_failures
from fp16lens.verify._runner import Runner

Metric = Callable[[Any, Any], float]
ADVICE_BATCHES = 16
"""The batches a failed INT8 check's advice measures each quantizer on, where only the
batches together fail (each quantizer costs a run of every one)."""


def verify(
    model,
    candidate: nn.Module | str | Path,
    inputs,
    backend: str | None = None,
    tolerance: Tolerance | float | None = None,
    metric: Metric | None = None,
    *,
    options: VerifyOptions | None = None,
    fusions: bool | None = None,
    device: str | torch.device | None = None,
    about_mean: bool | None = None,
) -> ParityResult:
    """Parity of ``candidate`` run on ``backend`` against ``model`` in FP32.

    The options are ``options=VerifyOptions(...)`` or the same fields as arguments, not
    both.

    ``candidate``: the model itself, a patched copy, or an exported ONNX path.
    ``inputs``: a tensor, a tuple of positional tensors, or a list of those (batches).
    ``backend``: a registered backend (``fp16lens.verify.backends()``: torch-fp16,
    torch-emulated, onnx-fp16, onnx-int8, tensorrt, torch-tensorrt, and any added with
    ``register_backend``); None or "auto" picks torch-fp16 for a module, onnx-int8 for an ONNX
    file holding QuantizeLinear/DequantizeLinear nodes, onnx-fp16 for any other ONNX
    file. A failed INT8 check names the layers whose quantization loses most
    (``result.advice``). ``tolerance``: a
    Tolerance, or a number taken as the minimum cosine. ``metric(fp32_out, cand_out)``:
    a task metric, averaged over batches into ``result.metrics``. ``fusions``:
    torch-emulated keeps TensorRT-fused pre-activations unrounded. ``about_mean``: hold
    each output's cosine about FP32's mean to the tolerance too (a score's error beside
    the offset the scores share; None: the tolerance's, on for INT8). ``device``: where the
    torch backends run their copy of the candidate (default: the candidate's device; the
    FP32 reference always runs where ``model`` is).

    ``model`` may be an FP32 ONNX file (a path or an ``onnx.ModelProto``), run in ONNX
    Runtime; a batch is then a tensor, a tuple in graph-input order, or a dict by input name.
    """
    opts = one_form(
        VerifyOptions,
        options,
        given(
            backend=backend,
            tolerance=tolerance,
            metric=metric,
            fusions=fusions,
            device=device,
            about_mean=about_mean,
        ),
    )
    model = _reference(model)
    spec = pick_backend(candidate, opts.backend)
    tol = resolve_tolerance(opts.tolerance, spec.tolerance)
    if opts.about_mean is not None:
        tol = dataclasses.replace(tol, about_mean=opts.about_mean)
    runner = spec.runner(candidate, model, fusions=opts.fusions, device=opts.device)
    with _eval(model):
        return _compare(model, runner, as_batches(inputs), spec, tol, opts.metric)


def _reference(model) -> nn.Module:
    from fp16lens._core.model_dtype import half_model
    from fp16lens._core.onnx_types import is_onnx
    from fp16lens.verify._onnx_ref import OnnxReference

    if is_onnx(model):
        return OnnxReference(model)
    if not isinstance(model, nn.Module):
        raise VerifyError(
            f"verify needs the FP32 reference as a torch.nn.Module or an FP32 .onnx file, got "
            f"{type(model).__name__}; pass the original model object itself (not its state_dict)"
        )
    why = half_model(model)
    if why is not None:
        raise VerifyError(f"verify compares with the FP32 model: {why}")
    return model


def _compare(
    model: nn.Module, runner: Runner, batches, spec: BackendSpec, tol: Tolerance, metric
) -> ParityResult:
    accs: dict[str, Accumulator] = {}
    scores: list[float] = []
    first: tuple[str | None, str | None] = (None, None)
    failing: tuple[Any, Any] | None = None  # the first batch that fails
    furthest: tuple[float, Any, Any] = (-1.0, None, None)  # the batch that departs most
    device = model_device(model)
    for batch in batches:
        with torch.no_grad():
            ref_out = model(*cast_floats(batch, torch.float32, device))
        cand = runner.run(batch)
        leaves = named_leaves(ref_out)
        failed, departs = _accumulate(accs, leaves, cand, tol, runner)
        if metric is not None:
            scores.append(float(metric(ref_out, _restructure(ref_out, cand))))
        if failed and failing is None:
            failing = (batch, leaves)
            first = runner.locate(batch, tol.site_rel)
        if departs > furthest[0]:
            furthest = (departs, batch, leaves)
    outputs = {k: a.result() for k, a in accs.items()}
    together = failing is None and any(output_failures(k, m, tol) for k, m in outputs.items())
    if together:  # no batch fails alone (a score judged about its mean over the batches)
        failing = furthest[1:]  # the batch that departs most is located
        first = runner.locate(failing[0], tol.site_rel)
    metrics = {getattr(metric, "__name__", "metric"): sum(scores) / len(scores)} if scores else {}
    advice: tuple[str, ...] = ()
    if failing is not None and spec.int8:
        from fp16lens.verify._int8_advice import int8_advice

        items = [failing]
        if together:  # the quantizers are judged over the batches, as the check was
            with torch.no_grad():
                items = [
                    (b, named_leaves(model(*cast_floats(b, torch.float32, device))))
                    for b in batches[:ADVICE_BATCHES]
                ]
        advice = int8_advice(runner, items, tol.min_cosine, bool(tol.about_mean))
    return ParityResult(
        backend=spec.name,
        outputs=outputs,
        tolerance=tol,
        batches=len(batches),
        first_divergence=first[0],
        first_divergence_tensor=first[1],
        metrics=metrics,
        notes=tuple(runner.notes),
        advice=advice,
    )


def _accumulate(
    accs, ref_leaves, cand: list[torch.Tensor], tol: Tolerance, runner
) -> tuple[bool, float]:
    """Add one batch to the running metrics; whether this batch alone fails, and how far
    it departs (its float outputs' largest ``max_rel``)."""
    if len(ref_leaves) != len(cand):
        raise VerifyError(
            f"the candidate returns {len(cand)} tensor(s), the model {len(ref_leaves)}; "
            "verify a candidate exported from (or patched from) this model"
        )
    failed, departs = False, 0.0
    for i, ((name, ref), out) in enumerate(zip(ref_leaves, cand)):
        one = Accumulator()  # this batch alone, then added to the running sums
        one.update(ref, out.to(ref.device), runner.free_axes(i))
        accs.setdefault(name, Accumulator()).add(one)
        m = one.result()
        failed |= bool(output_failures(name, m, tol))  # an integer output: only its length
        rel = m.max_rel if m.max_rel is not None else 0.0
        departs = max(departs, rel if math.isfinite(rel) else math.inf)
    return failed, departs


def _restructure(ref_out, cand: list[torch.Tensor]):
    """The candidate's tensors in the reference output's structure, as FP32."""
    leaves, spec = tree_flatten(ref_out)
    it = iter(cand)
    mixed = [(_float(next(it)) if torch.is_tensor(x) else x) for x in leaves]
    return tree_unflatten(mixed, spec)


def _float(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


@contextlib.contextmanager
def _eval(model: nn.Module):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
