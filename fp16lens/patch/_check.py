"""The check after a rewrite: the patched model's FP32 outputs equal the original's, on
the caller's batches or, without them, on inputs like the recorded ones
(``report_batch``: each input's dtype, shape and value range from ``ReportMeta.inputs``,
so token ids stay integers within the vocabulary)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fp16lens._core import PatchError
from fp16lens._trace import float_outputs
from fp16lens.report import Report

TOLERANCE = 1e-4
"""Relative to each output's largest |value|: rescaling by powers of two is exact, the
affine form of a batch norm rounds once (~1e-7); anything near 1e-4 is a wrong rewrite."""


NOT_CHECKED = "FP32 equivalence not checked"
"""How a note saying the FP32 check could not run begins (patch turns it into a warning)."""


def report_batch(report: Report, device=None):
    """One batch like the recorded inputs (seeded): a tuple of positional inputs, or a dict
    when the model was called with keywords; None when the report recorded nothing usable.
    Floats are uniform in the recorded [min, max], integers uniform in it (token ids),
    booleans as recorded (all-True attention masks stay all True)."""
    g = torch.Generator().manual_seed(0)
    specs = report.meta.inputs
    if not specs:
        shapes = report.meta.input_shapes
        if not shapes:
            return None
        return tuple(torch.rand(s, generator=g).to(device) for s in shapes[0])
    args, kwargs = [], {}
    for spec in specs:
        value = _synth(spec, g)
        if value is _UNKNOWN:
            return None
        if value is not None and torch.is_tensor(value):
            value = value.to(device)
        if spec["name"].isdigit():
            args.append(value)
        else:
            kwargs[spec["name"]] = value
    if kwargs:
        if args:
            return None  # positional and keywords together: not a batch form scan takes
        return kwargs
    return tuple(args)


_UNKNOWN = object()


def _synth(spec: dict, g: torch.Generator):
    kind = spec.get("dtype", "")
    if kind == "python":
        return spec.get("value")
    dtype = getattr(torch, kind, None)
    if not isinstance(dtype, torch.dtype):
        return _UNKNOWN
    shape, lo, hi = spec.get("shape", []), float(spec.get("min", 0.0)), float(spec.get("max", 0.0))
    if dtype == torch.bool:
        if lo == hi:
            return torch.full(shape, bool(lo))
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    if dtype.is_complex:
        return _UNKNOWN
    return torch.randint(int(lo), int(hi) + 1, shape, generator=g).to(dtype)


@torch.no_grad()
def check_equivalent(
    original: nn.Module,
    patched: nn.Module,
    report: Report,
    batches=None,
    input_scales: dict[int, float] | None = None,
) -> list[str]:
    """Compare both models in FP32 on ``batches`` (each a tensor, a tuple of positional
    inputs or a dict of keywords), else on one batch like the report's recorded inputs
    (``report_batch``); float input k of the patched model divided by ``input_scales[k]``
    (a folded input). Returns notes (why nothing was compared, beginning with
    ``NOT_CHECKED``); raises PatchError on a mismatch."""
    from fp16lens._trace import call_model

    device = next((p.device for p in original.parameters()), torch.device("cpu"))
    floor = 0.0
    if batches is None:
        floor = _output_floor(report)
        one = report_batch(report, device)
        if one is None:
            return [f"{NOT_CHECKED}: the report holds no inputs to make one from (pass batches=)"]
        batches, what = [one], "inputs like the report's recorded ones"
    else:
        what = "the given batches"
    for batch in batches:
        try:
            want, got = (
                call_model(original, batch),
                call_model(patched, scale_batch(batch, input_scales)),
            )
        except Exception as exc:  # the report's inputs may not be all the model needs
            return [
                f"{NOT_CHECKED}: the model does not run on {what} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); pass batches="
            ]
        _compare(want, got, floor, lambda batch=batch: _exact_run(original, batch))
    return []


def _exact_run(original: nn.Module, batch):
    """The original model in float64 on ``batch`` (its floats in float64), or None where it
    cannot run so: the arithmetic an FP32 difference is judged against."""
    from torch.utils._pytree import tree_map

    from fp16lens._trace import call_model

    def wide(t):
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    try:
        return call_model(copy.deepcopy(original).double(), tree_map(wide, batch))
    except Exception:  # a model that cannot run in float64: no exact reference
        return None


def scale_batch(batch, input_scales: dict[int, float] | None):
    """``batch`` as a patched model with folded inputs takes it: float input k (float
    tensors counted in order, positional or keyword) divided by ``input_scales[k]``."""
    if not input_scales:
        return batch
    k = 0

    def scale(x):
        nonlocal k
        if torch.is_tensor(x) and x.is_floating_point():
            x = x / input_scales[k] if k in input_scales else x
            k += 1
        return x

    if isinstance(batch, dict):
        return {name: scale(v) for name, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(scale(v) for v in batch)
    return scale(batch)


def _output_floor(report: Report) -> float:
    """The smallest largest-|value| the report recorded at a site no other site reads (the
    model's outputs): on inputs like the recorded ones an output may be nearly 0 (a
    saturated sigmoid on random pixels), where relative rounding in the 7th digit would
    look like a wrong rewrite; its error is measured against at least this scale."""
    read = {p for p, _ in report.edges}
    sinks = [
        s.absmax for n, s in report.sites.items() if n not in read and 0 < s.absmax < float("inf")
    ]
    return min(sinks, default=0.0)


def _compare(want, got, floor: float = 0.0, exact=None) -> None:
    """Raise PatchError where the patched FP32 output ``got`` departs from the original's
    ``want`` by more than TOLERANCE, unless ``exact()`` (the original in float64) shows the
    difference is the original's own FP32 rounding: the patched output is then no farther
    from exact arithmetic than the original, give or take TOLERANCE (a model whose values
    reach 1e8 rounds away its small outputs' digits; rescaling by 2^k only moves that)."""
    exact_outs = None
    for i, (a, b) in enumerate(zip(float_outputs(want), float_outputs(got))):
        err = relative_error(a, b, floor)
        if err <= TOLERANCE:
            continue
        if exact_outs is None and exact is not None:
            found = exact()
            exact_outs = float_outputs(found) if found is not None else []
        if exact_outs and i < len(exact_outs):
            ref = exact_outs[i].to(a.dtype)
            if relative_error(ref, b, floor) <= TOLERANCE + relative_error(ref, a, floor):
                continue
        raise PatchError(
            f"the patched model's FP32 output {i} differs from the original's (relative "
            f"error {err:.3g} > {TOLERANCE:g}): a rescaled tensor reaches it by a path the "
            "report's dataflow does not show; the model was left untouched. Keep the "
            "affected modules in FP32 instead: export(..., fp32_modules=[...])"
        )


def relative_error(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| / max(max |a|, floor) (0 for two all-zero tensors), in float64, over the
    finite values; inf when the two differ in where they are non-finite (a NaN both hold,
    or the same inf, is no difference: the original itself gives it on that input)."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    finite = torch.isfinite(a)
    same = (a == b) | (a.isnan() & b.isnan())
    if not bool((finite == torch.isfinite(b)).all()) or not bool((same | finite).all()):
        return float("inf")
    a, b = a[finite], b[finite]
    scale = max(float(a.abs().max()) if a.numel() else 0.0, floor)
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else diff
