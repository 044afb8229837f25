"""Overflow inside an op that never shows at its output.

Each check returns ``(kind, peak, context)`` with ``peak`` a 0-d tensor (no host
sync) or None when the op is not of that kind. The finding's sentence is written
later, once, when the peak is known to exceed the threshold.
"""

from __future__ import annotations

import math

import torch

from fp16lens._core.sites import FindingKind
from fp16lens.watch._tensorstats import absmax


def bind(func, args, kwargs) -> dict:
    """The op's arguments by schema name."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs or {})
    return bound


def _dev_sq(x: torch.Tensor, dims) -> torch.Tensor:
    """max (x - mean)^2 over the rows of ``dims``, from per-row extremes and means
    (two passes, no tensor of deviations allocated)."""
    x = x.detach()
    dims = tuple(sorted(d % x.dim() for d in dims))
    rest = [d for d in range(x.dim()) if d not in dims]
    rows = x.permute(*rest, *dims).reshape(-1, math.prod(x.shape[d] for d in dims))
    lo, hi = torch.aminmax(rows, dim=1)
    mean = rows.mean(dim=1, dtype=torch.float32)
    d = torch.maximum(hi.float() - mean, mean - lo.float()).max()
    return d * d


def _reduced_dims(x: torch.Tensor, dim) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(x.dim()))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return tuple(d % max(x.dim(), 1) for d in dims)


def check_layer_norm(x: torch.Tensor, shape) -> tuple:
    """A LayerNorm over the last ``len(shape)`` dims of ``x``, decomposed: (x-mean)^2."""
    return (
        FindingKind.NORM_VARIANCE,
        _dev_sq(x, tuple(range(-len(shape), 0))),
        {"norm": "LayerNorm", "opset": 17},
    )


def _layer_norm(b, out):
    return check_layer_norm(b["input"], b["normalized_shape"])


def _group_norm(b, out):
    x = b["input"]
    xr = x.reshape(b["N"], b["group"], -1)
    return FindingKind.NORM_VARIANCE, _dev_sq(xr, (-1,)), {"norm": "GroupNorm", "opset": 18}


def _batch_norm(b, out):
    if not b.get("training", False):
        return None  # eval batch norm uses running statistics: a single affine op
    x = b["input"]
    dims = (0, *range(2, x.dim()))
    return (
        FindingKind.NORM_VARIANCE,
        _dev_sq(x, dims),
        {"norm": "InstanceNorm/BatchNorm (batch statistics)", "opset": None},
    )


def _rms_norm(b, out):
    x = b["input"]
    a = absmax(x)
    return FindingKind.RMS_SQUARE, a * a, {"norm": "RMSNorm"}


def _var(b, out):
    x = b["input"] if "input" in b else b["self"]
    dims = _reduced_dims(x, b.get("dim"))
    return FindingKind.NORM_VARIANCE, _dev_sq(x, dims), {"norm": "var/std", "opset": None}


def _mean(b, out):
    x = b["self"]
    n = math.prod(x.shape[d] for d in _reduced_dims(x, b.get("dim")))
    return FindingKind.SUM_BEFORE_MEAN, absmax(out) * n, {"op": "mean", "n": n}


def _avg_pool(b, out):
    k = b["kernel_size"]
    n = b.get("divisor_override") or math.prod(k if isinstance(k, (list, tuple)) else [k])
    return FindingKind.SUM_BEFORE_MEAN, absmax(out) * n, {"op": "average pooling", "n": n}


def _adaptive_avg_pool(b, out):
    x = b["self"]
    spatial = len(b["output_size"])
    n = math.prod(
        math.ceil(x.shape[-spatial + i] / max(out.shape[-spatial + i], 1)) for i in range(spatial)
    )
    return FindingKind.SUM_BEFORE_MEAN, absmax(out) * n, {"op": "adaptive average pooling", "n": n}


def _vector_norm(b, out):
    if b.get("ord", 2) not in (2, 2.0, None):
        return None
    a = absmax(out)
    return FindingKind.SUM_OF_SQUARES, a * a, {"op": "vector norm"}


_SCORES_CHUNK = 1 << 22  # score elements computed at a time


def scores_absmax(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """max |q k^T| * scale (0-d, FP32), with grouped-query attention (fewer key/value
    heads at dim -3) by broadcasting and the scores made a block of query rows at a
    time: the full (L, S) matrix of every head is never held at once."""
    q, k = q.detach().float(), k.detach().float()
    if q.dim() >= 3 and k.dim() == q.dim() and k.shape[-3] != q.shape[-3]:
        q = q.unflatten(-3, (k.shape[-3], q.shape[-3] // k.shape[-3]))  # (.., Hkv, G, L, E)
        k = k.unsqueeze(-3)  # (.., Hkv, 1, S, E)
    kt = k.transpose(-2, -1)
    per_row = max(1, math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])) * k.shape[-2])
    rows = max(1, _SCORES_CHUNK // per_row)
    peak = torch.zeros((), dtype=torch.float32, device=q.device)
    for i in range(0, q.shape[-2], rows):
        peak = torch.maximum(peak, absmax(torch.matmul(q[..., i : i + rows, :], kt)).float())
    return peak * scale


def _attention(b, out):
    q, k = b["query"], b["key"]
    scale = b.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (
        FindingKind.ATTENTION_SCORES,
        scores_absmax(q, k, scale),
        {"op": "scaled dot-product attention"},
    )


CHECKS = {
    "scaled_dot_product_attention": _attention,
    "scaled_dot_product_flash_attention_for_cpu": _attention,
    "scaled_dot_product_flash_attention": _attention,
    "scaled_dot_product_efficient_attention": _attention,
    "scaled_dot_product_cudnn_attention": _attention,
    "scaled_dot_product_fused_attention_overrideable": _attention,
    "layer_norm": _layer_norm,
    "group_norm": _group_norm,
    "batch_norm": _batch_norm,
    "rms_norm": _rms_norm,
    "var": _var,
    "std": _var,
    "var_mean": _var,
    "std_mean": _var,
    "mean": _mean,
    "avg_pool1d": _avg_pool,
    "avg_pool2d": _avg_pool,
    "avg_pool3d": _avg_pool,
    "adaptive_avg_pool1d": _adaptive_avg_pool,
    "adaptive_avg_pool2d": _adaptive_avg_pool,
    "adaptive_avg_pool3d": _adaptive_avg_pool,
    "linalg_vector_norm": _vector_norm,
    "norm": _vector_norm,
}


def _range_bound(b, absmax_of):
    """An upper bound of the check's peak from the input's known extremes, or None."""
    x = b.get("input", b.get("self", b.get("query")))
    if not isinstance(x, torch.Tensor):
        return None
    lo_hi = absmax_of(x)
    if lo_hi is None:
        return None
    lo, hi = lo_hi
    a = max(-lo, hi)
    if "query" in b:  # |q.k| <= d max|q| max|k|, times the scale
        k = absmax_of(b["key"])
        if k is None:
            return None
        scale = b.get("scale") or 1.0 / math.sqrt(x.shape[-1])
        return x.shape[-1] * a * max(-k[0], k[1]) * scale
    return (hi - lo) ** 2, a  # |x - mean| <= hi - lo; sums: n * max |x|


def _cannot_exceed(name: str, b, absmax_of, threshold: float) -> bool:
    """True when the input's known range proves the check's peak stays within the
    threshold: the exact check (a pass or a matmul) is then skipped. Only peaks past
    the threshold are ever reported, so this changes no report."""
    bound = _range_bound(b, absmax_of)
    if bound is None:
        return False
    if isinstance(bound, float):
        return bound <= threshold
    sq, a = bound
    fn = CHECKS[name]
    if fn in (_layer_norm, _group_norm, _batch_norm, _var):
        return sq <= threshold
    if fn in (_rms_norm, _vector_norm):  # x^2 (sum of squares: bounded by n x^2 below)
        n = 1 if fn is _rms_norm else b["self"].numel() if "self" in b else b["input"].numel()
        return a * a * n <= threshold
    if fn in (_mean, _avg_pool, _adaptive_avg_pool):
        return a * (b["self"] if "self" in b else b["input"]).numel() <= threshold
    return False


def check(
    name: str, func, args, kwargs, out: torch.Tensor, absmax_of=None, threshold: float = math.inf
):
    """Run the internal check for op ``name``, if it has one. ``absmax_of(t)`` gives a
    tensor's known (min, max) or None: when they prove no overflow, nothing is computed."""
    fn = CHECKS.get(name)
    if fn is None:
        return None
    try:
        b = bind(func, args, kwargs)
        if absmax_of is not None and _cannot_exceed(name, b, absmax_of, threshold):
            return None
        return fn(b, out)
    except (KeyError, TypeError, RuntimeError, IndexError):
        return None  # an overload with another signature: no internal estimate


def describe(kind: str, peak: float, ctx: dict, threshold: float) -> str:
    """One sentence: what overflows inside the op, and by how much."""
    if kind == FindingKind.NORM_VARIANCE:
        opset = f" exported below opset {ctx['opset']}" if ctx.get("opset") else ""
        return (
            f"{ctx['norm']}{opset} computes (x-mean)^2 in FP16 when decomposed: "
            f"{peak:.3g} > {threshold:g} (|x-mean| up to {math.sqrt(peak):.3g}); "
            "the fused op's output stays in range"
        )
    if kind == FindingKind.RMS_SQUARE:
        return f"RMSNorm squares its input: x^2 up to {peak:.3g} > {threshold:g}"
    if kind == FindingKind.SUM_BEFORE_MEAN:
        return (
            f"{ctx['op']} sums {ctx['n']} values before dividing: |sum| up to {peak:.3g} "
            f"> {threshold:g}, though the mean ({peak / ctx['n']:.3g}) fits"
        )
    if kind == FindingKind.SUM_OF_SQUARES:
        return (
            f"the vector norm sums x^2 before the square root: up to {peak:.3g} > "
            f"{threshold:g}, though the norm ({math.sqrt(peak):.3g}) fits"
        )
    if kind == FindingKind.ATTENTION_SCORES:
        return (
            f"attention scores QK^T*scale reach {peak:.3g} > {threshold:g}: a fused kernel keeps "
            "them in FP32, but an unfused graph (ONNX MatMul, Softmax) stores them in FP16"
        )
    return f"{kind}: {peak:.3g} > {threshold:g}"
