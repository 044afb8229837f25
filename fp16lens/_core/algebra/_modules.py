"""Built-in modules: by isinstance for an instance (patch), by class name for a report.

watch names a built-in leaf module's site after its class (``Conv2d``); the name table is
derived from the same isinstance rules, so the report and patch cannot disagree on a
module type. Three kinds depend on the instance, which only patch sees: a batch norm
without running statistics, an instance norm tracking them, and a constant pad with a
value other than 0 are blocking. By name a batch or instance norm takes its usual kind
and a ConstantPad (its value unknown) is blocking.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.padding import _ConstantPadNd

from fp16lens._core.algebra._classes import Kind

_LINEAR = (_ConvNd, nn.Linear)
_NORM = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, _InstanceNorm)
_HOMOG = (
    nn.ReLU, nn.LeakyReLU, nn.PReLU, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Upsample,
    nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
    nn.Dropout3d, nn.AlphaDropout, nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle,
)  # fmt: skip


def type_kind(cls: type) -> Kind:
    """The kind of a module class, before looking at the instance."""
    if issubclass(cls, _LINEAR):
        return Kind.LINEAR
    if issubclass(cls, _BatchNorm):
        return Kind.BN
    if issubclass(cls, _NORM):
        return Kind.NORM
    if issubclass(cls, (*_HOMOG, _ConstantPadNd)):
        return Kind.HOMOG
    return Kind.BLOCK


def module_kind(module: nn.Module) -> Kind:
    """The kind of a built-in leaf module (watch names those sites after the module)."""
    kind = type_kind(type(module))
    if kind is Kind.BN and (module.running_mean is None or module.running_var is None):
        return Kind.BLOCK  # batch statistics: no fixed affine form
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        return Kind.BLOCK
    if isinstance(module, _ConstantPadNd) and module.value != 0:
        return Kind.BLOCK  # a non-zero pad value does not scale
    return kind


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


@functools.cache
def _by_name() -> dict[str, Kind]:
    """Every torch.nn module class (those watch makes sites), the public names winning."""
    inner = [c for c in _subclasses(nn.Module) if c.__module__.startswith("torch.nn.")]
    public = [c for c in vars(nn).values() if isinstance(c, type) and issubclass(c, nn.Module)]
    table = {c.__name__.lower(): type_kind(c) for c in (*inner, *public) if c is not nn.Module}
    for c in (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d):
        table[c.__name__.lower()] = Kind.BLOCK  # its value is unknown by name: assume not 0
    return table


def module_name_kind(name: str) -> Kind | None:
    """The kind of a torch.nn module class by its name (case-insensitive); None if unknown."""
    return _by_name().get(name.lower())


def norm_has_affine(module: nn.Module) -> bool:
    """A norm whose output is multiplied by a weight (and shifted) can absorb an output 1/p."""
    return getattr(module, "weight", None) is not None
