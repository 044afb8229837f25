"""The rescaling rules as pure tensor functions (no modules, no side effects).

Every rule maps the parameters of an op that sees its input divided by ``s_in`` and must
produce its output divided by ``s_out``. With powers of two every rule is exact in binary
floating point (barring under/overflow); the arithmetic runs in float64 and the result
keeps the parameter's dtype.
"""

from __future__ import annotations

import torch

from fp16lens._core import FP16_MAX, FP16_MIN_NORMAL


def _cast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(dtype=like.dtype, device=like.device)


def scale_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, s_in: float, s_out: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """conv/linear: W x + b  ->  (W s_in / s_out)(x / s_in) + b / s_out = (W x + b) / s_out."""
    w = _cast(weight.detach().double() * (s_in / s_out), weight)
    b = None if bias is None else _cast(bias.detach().double() / s_out, bias)
    return w, b


def scale_input_weight(weight: torch.Tensor, s_in: float) -> torch.Tensor:
    """The first layer of an input the caller divides by ``s_in``: W (x / s_in) s_in = W x
    (a conv/linear weight, an RNN's ``weight_ih_l0``; the bias is unchanged)."""
    return _cast(weight.detach().double() * s_in, weight)


def scale_bn(
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    s_in: float,
    s_out: float,
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None, torch.Tensor | None]:
    """Batch norm (eval) seeing x / s_in and producing BN(x) / s_out.

    ((x/s_in) - mean/s_in) / sqrt(var/s_in^2 + eps/s_in^2) = (x - mean)/sqrt(var + eps):
    the statistics absorb the input scale, the affine part the output scale.
    """
    m = _cast(mean.detach().double() / s_in, mean)
    v = _cast(var.detach().double() / (s_in * s_in), var)
    w = None if weight is None else _cast(weight.detach().double() / s_out, weight)
    b = None if bias is None else _cast(bias.detach().double() / s_out, bias)
    return m, v, eps / (s_in * s_in), w, b


def bn_affine(
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    s_in: float = 1.0,
    s_out: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact affine form of an eval batch norm, computed in float64:
    scale = gamma / sqrt(var + eps), shift = beta - mean * scale, then the input and output
    scales folded in: BN(x)/s_out = (scale s_in / s_out)(x / s_in) + shift / s_out."""
    g = torch.ones_like(var, dtype=torch.float64) if weight is None else weight.detach().double()
    beta = torch.zeros_like(var, dtype=torch.float64) if bias is None else bias.detach().double()
    scale = g / torch.sqrt(var.detach().double() + eps)
    shift = beta - mean.detach().double() * scale
    return _cast(scale * (s_in / s_out), var), _cast(shift / s_out, var)


def bn_affine_stats(eps: float) -> tuple[float, float]:
    """The statistics a batch norm in its exact affine form stores while it keeps its own
    ``eps`` (a state_dict holds the weights and statistics, not eps: a checkpoint loaded into
    the original class must compute the same). Returns ``(running_var, c)``: c is the
    smallest power of two with c^2 >= 2 eps (1 for any eps <= 0.5) and running_var is
    c^2 - eps rounded once to FP32, so FP32's var + eps rounds to exactly c^2 (the rounding
    error is at most half an ulp below c^2) and sqrt gives c exactly; the weight carries
    the factor c (``scale * c``, exact). In FP16, var rounds to FP16's grid and
    1/sqrt(var + eps) is within 2^-12 of 1/c: below FP16's own rounding of the output."""
    c = 1.0
    while c * c < 2 * eps:
        c *= 2.0
    eps32 = float(torch.tensor(eps, dtype=torch.float32))
    var = float(torch.tensor(c * c - eps32, dtype=torch.float64).float())  # exact, then once
    return var, c


def scale_norm_eps(eps: float, s_in: float) -> float:
    """layer/group/instance/RMS norm: norm(x / s) = norm(x) exactly when eps -> eps / s^2."""
    return eps / (s_in * s_in)


def fp16_holds(*tensors: torch.Tensor | None) -> bool:
    """True when every value is finite and within FP16's range (small values allowed)."""
    return all(
        t is None
        or t.numel() == 0
        or (bool(torch.isfinite(t).all()) and float(t.detach().abs().max()) <= FP16_MAX)
        for t in tensors
    )


def fp16_safe(*tensors: torch.Tensor | None) -> bool:
    """True when every value is finite in FP16 and no non-zero value falls below 2^-14."""
    if not fp16_holds(*tensors):
        return False
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        nz = t.detach().abs().double()
        nz = nz[nz > 0]
        if nz.numel() and float(nz.min()) < FP16_MIN_NORMAL:
            return False
    return True
