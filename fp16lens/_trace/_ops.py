"""How watch() treats each aten op: its display name and whether it is a site."""

from __future__ import annotations

import functools

from torch import nn

# Ops whose output holds (a subset of) the input values unchanged: not sites; the
# output inherits the producers of the inputs so the dataflow stays connected.
PASSTHROUGH = frozenset(
    [
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "permute",
        "transpose",
        "t",
        "expand",
        "expand_as",
        "squeeze",
        "unsqueeze",
        "select",
        "slice",
        "alias",
        "detach",
        "as_strided",
        "contiguous",
        "clone",
        "_to_copy",
        "unbind",
        "split",
        "split_with_sizes",
        "chunk",
        "flatten",
        "unflatten",
        "narrow",
        "lift_fresh",
        "lift_fresh_copy",
        "copy",
        "diagonal",
        "index_select",
        "index",
        "gather",
        "repeat",
        "tile",
        "movedim",
        "view_as",
        "roll",
        "flip",
        "constant_pad_nd",
        "unfold",
        "pixel_shuffle",
        "pixel_unshuffle",
        "channel_shuffle",
        "_reshape_copy",
        "squeeze_copy",
        "unsqueeze_copy",
        "view_copy",
        "permute_copy",
        "transpose_copy",
        "t_copy",
        "slice_copy",
        "select_copy",
        "expand_copy",
        "alias_copy",
        "detach_copy",
        "split_copy",
        "unbind_copy",
    ]
)

# Ops that create tensors from nothing: neither sites nor producers.
FACTORY = frozenset(
    [
        "empty",
        "empty_like",
        "empty_strided",
        "zeros",
        "zeros_like",
        "ones",
        "ones_like",
        "full",
        "full_like",
        "arange",
        "scalar_tensor",
        "rand",
        "rand_like",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty_strided",
        "linspace",
        "logspace",
        "eye",
        "_local_scalar_dense",
        "fill",
        "zero",
        "normal",
        "uniform",
        "bernoulli",
    ]
)

# Passthroughs whose output holds exactly the input's values (so its extremes too).
VALUE_PRESERVING = frozenset(
    [
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "permute",
        "transpose",
        "t",
        "expand",
        "expand_as",
        "squeeze",
        "unsqueeze",
        "alias",
        "detach",
        "contiguous",
        "clone",
        "flatten",
        "unflatten",
        "movedim",
        "view_as",
        "lift_fresh",
        "lift_fresh_copy",
        "_reshape_copy",
        "squeeze_copy",
        "unsqueeze_copy",
        "view_copy",
        "permute_copy",
        "transpose_copy",
        "t_copy",
        "expand_copy",
        "alias_copy",
        "detach_copy",
    ]
)

# Elementwise ops that are monotone in their first argument when every other argument
# is a number: the output's extremes follow exactly from the input's.
MONOTONE = frozenset(
    [
        "relu",
        "hardtanh",
        "clamp",
        "clamp_min",
        "clamp_max",
        "leaky_relu",
        "mul",
        "div",
        "add",
        "sub",
        "rsub",
        "neg",
    ]
)

_RENAME = {
    "_native_batch_norm_legit_no_training": "batch_norm",
    "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_functional": "batch_norm",
    "native_batch_norm": "batch_norm",
    "cudnn_batch_norm": "batch_norm",
    "native_layer_norm": "layer_norm",
    "native_group_norm": "group_norm",
    "_fused_rms_norm": "rms_norm",
    "_convolution": "convolution",
    "_adaptive_avg_pool2d": "adaptive_avg_pool2d",
    "_adaptive_avg_pool3d": "adaptive_avg_pool3d",
}


def _display(raw: str) -> str:
    """A readable name of an overload packet's name: "add_" -> "add", "_to_copy" -> "to_copy"."""
    if raw in _RENAME:
        return _RENAME[raw]
    name = raw[:-1] if raw.endswith("_") and not raw.endswith("__") else raw
    return _RENAME.get(name, name.lstrip("_") or name)


@functools.cache
def op_name(func) -> str:
    """A readable name of an aten overload: aten.add_.Tensor -> "add"."""
    return _display(func.overloadpacket.__name__)


# the op classes above, in display names (what op_name gives)
PASSTHROUGH, FACTORY, VALUE_PRESERVING, MONOTONE = (
    frozenset(map(_display, s)) for s in (PASSTHROUGH, FACTORY, VALUE_PRESERVING, MONOTONE)
)


def is_builtin_leaf(module: nn.Module) -> bool:
    """A torch.nn leaf module (Conv2d, BatchNorm2d, ReLU, ...): its ops are named after it."""
    return type(module).__module__.startswith("torch.nn.") and next(module.children(), None) is None


# Built-in modules recorded at their boundary (one output event) rather than op by op:
# their aten ops (t, addmm, views) all carry the module's site name anyway.
BOUNDARY_MODULES = frozenset({nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear})


# Op classes the span logic and the fusion hint use.
MATMUL_LIKE = frozenset({"convolution", "addmm", "mm", "bmm", "matmul", "linear", "baddbmm"})
NORM_OPS = frozenset({"batch_norm", "layer_norm", "group_norm", "rms_norm", "instance_norm"})
