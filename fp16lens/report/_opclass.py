"""How a site's op commutes with a power-of-two scale (docs/DESIGN.md, the rescaling algebra).

``SiteStats.op`` is a module class ("Conv2d", "ReLU") or an aten op ("add", "gelu").
Pure lookups; the advice and the patch stage read the same classes, so what the report
suggests is what patch can do.
"""

from __future__ import annotations

import re

ABSORBING = "absorbing"  # conv, linear, batch norm (eval): W/p, b/p at an entry, pW at an exit
HOMOGENEOUS = "homogeneous"  # f(px) = p f(x): a scale passes through
INVARIANT = "invariant"  # f(px) = f(x): layer/group/instance/RMS norm, a natural exit
BLOCKING = "blocking"  # sigmoid, tanh, gelu, silu, exp, softmax, pow, unknown

_ABSORBING = re.compile(
    r"^(conv(olution)?(_?transpose)?\d?d?|conv_transpose\dd|convtranspose\dd|linear|addmm|mm|"
    r"bmm|matmul|baddbmm|lazy(conv|linear).*|batchnorm\dd|batch_norm|syncbatchnorm|"
    r"frozenbatchnorm2d|bilinear)$"
)
_INVARIANT = re.compile(
    r"^(layernorm|layer_norm|groupnorm|group_norm|instancenorm\dd|instance_norm|rmsnorm|"
    r"rms_norm|localresponsenorm)$"
)
_HOMOGENEOUS = re.compile(
    r"^(relu|leakyrelu|leaky_relu|prelu|_prelu_kernel|identity|dropout\dd?|"
    r"alphadropout|dropout|maxpool\dd|max_pool\dd(_with_indices)?|avgpool\dd|avg_pool\dd|"
    r"adaptiveavgpool\dd|adaptive_avg_pool\dd|adaptivemaxpool\dd|adaptive_max_pool\dd|"
    r"upsample|upsamplingnearest2d|upsamplingbilinear2d|upsample_(nearest|bilinear|linear|"
    r"trilinear|bicubic)\dd(_aa)?|upsample_\w+|interpolate|add|sub|cat|concat|stack|maximum|"
    r"minimum|zeropad\dd|flatten|unflatten|neg|pixelshuffle|pixelunshuffle|channelshuffle|"
    r"pixel_shuffle|pixel_unshuffle|mean|sum|amax|amin|max|min|native_dropout|"
    r"feature_dropout|alpha_dropout)$"
)


def op_class(op: str) -> str:
    """The class of ``op`` (module class name or aten op name), case-insensitive."""
    key = op.lower().removesuffix("_")
    if _ABSORBING.match(key):
        return ABSORBING
    if _INVARIANT.match(key):
        return INVARIANT
    if _HOMOGENEOUS.match(key):
        return HOMOGENEOUS
    return BLOCKING


def is_batch_norm(op: str) -> bool:
    return op.lower() in {
        "batchnorm1d",
        "batchnorm2d",
        "batchnorm3d",
        "syncbatchnorm",
        "batch_norm",
    }


JOINS = frozenset({"add", "sub", "cat", "concat", "stack", "maximum", "minimum"})


def is_join(op: str) -> bool:
    """Ops that combine several tensors elementwise or by concatenation."""
    return op.lower().removesuffix("_") in JOINS
