"""verify(): run the FP32 model and the candidate on every batch, compare the outputs,
and, on the first batch that fails, name the site where the candidate first departs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fp16lens._core import VerifyError, import_optional
from fp16lens.verify._batches import as_batches, cast_floats, model_device
from fp16lens.verify._metrics import Accumulator
from fp16lens.verify._options import INT8_BACKENDS, Tolerance, check_backend, resolve_tolerance
from fp16lens.verify._outputs import named_leaves
from fp16lens.verify._result import ParityResult, output_failures

Metric = Callable[[Any, Any], float]


def verify(
    model: nn.Module,
    candidate: nn.Module | str | Path,
    inputs,
    backend: str | None = None,
    tolerance: Tolerance | float | None = None,
    metric: Metric | None = None,
    *,
    fusions: bool = False,
    device: str | torch.device | None = None,
) -> ParityResult:
    """Parity of ``candidate`` run on ``backend`` against ``model`` in FP32.

    ``candidate``: the model itself, a patched copy, or an exported ONNX path.
    ``inputs``: a tensor, a tuple of positional tensors, or a list of those (batches).
    ``backend``: "torch-fp16", "torch-emulated", "onnx-fp16", "onnx-int8", "tensorrt",
    "torch-tensorrt"; None or "auto" picks torch-fp16 for a module, onnx-int8 for an ONNX
    file holding QuantizeLinear/DequantizeLinear nodes, onnx-fp16 for any other ONNX
    file. A failed INT8 check names the layers whose quantization loses most
    (``result.advice``). ``tolerance``: a
    Tolerance, or a number taken as the minimum cosine. ``metric(fp32_out, cand_out)``:
    a task metric, averaged over batches into ``result.metrics``. ``fusions``:
    torch-emulated keeps TensorRT-fused pre-activations unrounded. ``device``: where the
    torch backends run their copy of the candidate (default: the candidate's device; the
    FP32 reference always runs where ``model`` is).
    """
    if not isinstance(model, nn.Module):
        raise VerifyError(
            f"verify needs the FP32 reference as a torch.nn.Module, got {type(model).__name__}; "
            "pass the original model object itself (not its state_dict or a path)"
        )
    backend = check_backend(_default_backend(candidate) if backend in (None, "auto") else backend)
    tol = resolve_tolerance(tolerance, backend)
    runner = _runner(model, candidate, backend, fusions, device)
    with _eval(model):
        return _compare(model, runner, as_batches(inputs), backend, tol, metric)


def _compare(model, runner, batches, backend, tol, metric) -> ParityResult:
    accs: dict[str, Accumulator] = {}
    scores: list[float] = []
    first = (None, None)
    failing = None  # the first batch that fails
    device = model_device(model)
    for batch in batches:
        with torch.no_grad():
            ref_out = model(*cast_floats(batch, torch.float32, device))
        cand = runner.run(batch)
        failed = _accumulate(accs, named_leaves(ref_out), cand, tol)
        if metric is not None:
            scores.append(float(metric(ref_out, _restructure(ref_out, cand))))
        if failed and failing is None:
            failing = (batch, named_leaves(ref_out))
            first = runner.locate(batch, tol.site_rel)
    metrics = {getattr(metric, "__name__", "metric"): sum(scores) / len(scores)} if scores else {}
    advice = ()
    if failing is not None and backend in INT8_BACKENDS:
        from fp16lens.verify._int8_advice import int8_advice

        advice = int8_advice(runner, *failing, tol.min_cosine)
    return ParityResult(
        backend,
        {k: a.result() for k, a in accs.items()},
        tol,
        len(batches),
        first[0],
        first[1],
        metrics,
        getattr(runner, "notes", ()),
        advice,
    )


def _accumulate(accs, ref_leaves, cand: list[torch.Tensor], tol: Tolerance) -> bool:
    """Add one batch to the running metrics; whether this batch alone fails."""
    if len(ref_leaves) != len(cand):
        raise VerifyError(
            f"the candidate returns {len(cand)} tensor(s), the model {len(ref_leaves)}; "
            "verify a candidate exported from (or patched from) this model"
        )
    failed = False
    for (name, ref), out in zip(ref_leaves, cand):
        out = out.to(ref.device)
        accs.setdefault(name, Accumulator()).update(ref, out)
        one = Accumulator()
        one.update(ref, out)
        failed |= bool(ref.is_floating_point() and output_failures(name, one.result(), tol))
    return failed


def _restructure(ref_out, cand: list[torch.Tensor]):
    """The candidate's tensors in the reference output's structure, as FP32."""
    leaves, spec = tree_flatten(ref_out)
    it = iter(cand)
    mixed = [(_float(next(it)) if torch.is_tensor(x) else x) for x in leaves]
    return tree_unflatten(mixed, spec)


def _float(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _default_backend(candidate) -> str:
    if not isinstance(candidate, (str, Path)):
        return "torch-fp16"
    return "onnx-int8" if is_qdq(candidate) else "onnx-fp16"


def is_qdq(path: str | Path) -> bool:
    """Whether an ONNX file holds QuantizeLinear/DequantizeLinear nodes (an INT8 graph)."""
    from fp16lens.verify._int8_advice import QDQ_OPS

    if not Path(path).is_file():
        return False  # the runner names the missing file
    onnx = import_optional("onnx", "onnx", "running an ONNX candidate")
    proto = onnx.load(str(path), load_external_data=False)
    return any(n.op_type in QDQ_OPS for n in proto.graph.node)


def _runner(model: nn.Module, candidate, backend: str, fusions: bool, device=None):
    is_path = isinstance(candidate, (str, Path))
    wants_path = backend in ("onnx-fp16", "onnx-int8", "tensorrt")
    if is_path != wants_path or not (is_path or isinstance(candidate, nn.Module)):
        need = "an ONNX file path" if wants_path else "an nn.Module"
        raise VerifyError(
            f"backend {backend!r} needs {need} as candidate, got {type(candidate).__name__}; "
            "pass a model (or a patched copy) with backend 'torch-fp16'/'torch-emulated', "
            "or an exported ONNX path with 'onnx-fp16'/'onnx-int8'/'tensorrt'"
        )
    if backend == "torch-fp16":
        from fp16lens.verify._torch import TorchFp16

        return TorchFp16(candidate, device)
    if backend == "torch-emulated":
        from fp16lens.verify._torch import TorchEmulated

        return TorchEmulated(candidate, fusions=fusions, device=device)
    if backend in ("onnx-fp16", "onnx-int8"):
        from fp16lens.verify._onnx import OnnxInt8, OnnxRunner

        return (OnnxRunner if backend == "onnx-fp16" else OnnxInt8)(candidate, model)
    from fp16lens.verify._tensorrt import TensorRTRunner, TorchTensorRTRunner

    return (
        TensorRTRunner(candidate, model)
        if backend == "tensorrt"
        else TorchTensorRTRunner(candidate)
    )


@contextlib.contextmanager
def _eval(model: nn.Module):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
