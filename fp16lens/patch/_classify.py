"""How each site commutes with a scale p (see docs/DESIGN.md, "The rescaling algebra").

Kinds:
- "linear": conv / linear module (parameters absorb 1/p at an entry, p at an exit);
- "bn": batch norm module in eval with running statistics (absorbs both ways);
- "norm": layer/group/instance/RMS norm module (scale-invariant with eps / p^2;
  absorbs an output scale too when it has an affine weight and bias);
- "homog": f(p x) = p f(x), one scale flows through (relu, pooling, interpolation, ...);
- "join": several operands that must carry the same scale (add, sub, cat, max);
- "block": a module a scale cannot pass; it can become an FP32 island;
- "opaque": a functional op a scale cannot pass and that no module wraps.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.instancenorm import _InstanceNorm

LINEAR, BN, NORM, HOMOG, JOIN, BLOCK, OPAQUE = (
    "linear",
    "bn",
    "norm",
    "homog",
    "join",
    "block",
    "opaque",
)
ABSORB_OUT = frozenset({LINEAR, BN, BLOCK})
"""Kinds whose output scale can be chosen freely (BLOCK as a scaled FP32 island)."""
ABSORB_IN = frozenset({LINEAR, BN, NORM, BLOCK})
"""Kinds whose input scale can be absorbed (exits of a region)."""

_HOMOG_MODULES = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.PReLU,
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Upsample,
    nn.ZeroPad1d,
    nn.ZeroPad2d,
    nn.ZeroPad3d,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    nn.ChannelShuffle,
)
_NORM_MODULES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, _InstanceNorm)

_HOMOG_OPS = frozenset(
    {
        "relu",
        "leaky_relu",
        "prelu",
        "_prelu_kernel",
        "prelu_kernel",
        "dropout",
        "native_dropout",
        "feature_dropout",
        "alpha_dropout",
        "neg",
        "mean",
        "sum",
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "max_pool2d_with_indices",
        "max_pool3d_with_indices",
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "adaptive_max_pool3d",
        "pixel_shuffle",
        "pixel_unshuffle",
        "amax",
        "amin",
        "max",
        "min",
    }
)
_JOIN_OPS = frozenset({"add", "sub", "cat", "stack", "concat", "maximum", "minimum"})


def module_kind(module: nn.Module) -> str:
    """The kind of a built-in leaf module (watch names those sites after the module)."""
    if isinstance(module, (_ConvNd, nn.Linear)):
        return LINEAR
    if isinstance(module, _BatchNorm):
        ok = module.running_mean is not None and module.running_var is not None
        return BN if ok else BLOCK
    if isinstance(module, _NORM_MODULES):
        if isinstance(module, _InstanceNorm) and module.track_running_stats:
            return BLOCK
        return NORM
    if isinstance(module, nn.ConstantPad2d | nn.ConstantPad1d | nn.ConstantPad3d):
        return HOMOG if module.value == 0 else BLOCK
    if isinstance(module, _HOMOG_MODULES):
        return HOMOG
    return BLOCK


def op_kind(op: str, producers: int) -> str:
    """The kind of a functional op from its aten name and number of tensor producers.

    An add/sub with one producer adds a constant (or the tensor to itself): a scale does
    not pass it, so it is opaque; so is a mul/div (scalar or not, the report cannot tell).
    """
    if op.startswith("upsample") or op in _HOMOG_OPS:
        return HOMOG
    if op in _JOIN_OPS:
        return JOIN if producers >= 2 else OPAQUE
    return OPAQUE


def norm_has_affine(module: nn.Module) -> bool:
    """A norm whose output is multiplied by a weight (and shifted) can absorb an output 1/p."""
    return getattr(module, "weight", None) is not None
