"""Built-in modules: by isinstance for an instance (patch), by class name for a report.

watch names a built-in leaf module's site after its class (``Conv2d``); the name table is
derived from the same isinstance rules, so the report and patch cannot disagree on a
module type. Three kinds depend on the instance, which only patch sees: a batch norm
without running statistics, an instance norm tracking them, and a constant pad with a
value other than 0 are blocking. By name a batch or instance norm takes its usual kind
and a ConstantPad (its value unknown) is blocking.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.padding import _ConstantPadNd

from fp16lens._core.algebra._classes import Kind

_LINEAR = (_ConvNd, nn.Linear, nn.Embedding)  # an embedding: its table absorbs an output 1/p
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
    """The kind of a built-in leaf module (watch names those sites after the module), or of
    a module recognized by what it computes (``fused_kind``)."""
    if not type(module).__module__.startswith("torch.nn."):
        fused = fused_kind(module)
        if fused is not None:
            return fused
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


def is_batch_norm(op: str) -> bool:
    """A batch norm module's class name, or the functional ``batch_norm`` (a report's op)."""
    return op.lower() == "batch_norm" or module_name_kind(op) is Kind.BN


def norm_has_affine(module: nn.Module) -> bool:
    """A norm whose output is multiplied by a weight (and shifted) can absorb an output 1/p."""
    return getattr(module, "weight", None) is not None


# ---- modules recognized by what they compute ------------------------------------------
# timm's BatchNormAct2d and FrozenBatchNorm2d, torchvision's FrozenBatchNorm2d, HF's
# T5LayerNorm / LlamaRMSNorm, timm's LayerNorm2d: not built-in leaves, so watch records
# their functional ops. A numeric probe on a float64 copy (its child modules made
# identities: BatchNormAct's activation) decides whether the module is a batch norm from
# its own buffers, or a norm that is scale invariant once eps -> eps/p^2, and whether
# patch's rules on its parameters do what they do on the built-ins.
_EPS_NAMES = ("eps", "variance_epsilon")
_SHAPES = ((2, -1, 3, 3), (2, -1, 5), (4, -1), (2, 3, -1))


def eps_name(module: nn.Module) -> str | None:
    """The attribute holding a norm's epsilon (``eps``, HF's ``variance_epsilon``)."""
    return next((n for n in _EPS_NAMES if isinstance(getattr(module, n, None), float)), None)


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> kind or None


def _probe(module: nn.Module) -> Kind | None:
    if module not in _PROBED:
        _PROBED[module] = _probe_kind(module)
    return _PROBED[module]


def _probe_kind(module: nn.Module) -> Kind | None:
    try:
        if eps_name(module) is None:
            return Kind.LINEAR if _is_linear(module) else None
        if _is_bn_like(module):
            return Kind.BN
        if _is_invariant_norm(module):
            return Kind.NORM
    except Exception:  # a forward that refuses the probe's inputs: not recognized
        return None
    return None


def fused_kind(module: nn.Module) -> Kind | None:
    """BN for a module computing an eval batch norm from its own buffers (running_mean,
    running_var, weight, bias, eps), NORM for an affine norm invariant to its input's scale
    with eps/p^2, LINEAR for a leaf module without eps that the linear rule rescales
    exactly (HF's Conv1D: ``x @ W + b``); None otherwise. Decided by a numeric probe on a
    float64 copy."""
    if not torch.is_tensor(getattr(module, "weight", None)):
        return None
    return _probe(module)


def _stripped(module: nn.Module) -> nn.Module:
    m = copy.deepcopy(module).double().eval()
    for name, _ in list(m.named_children()):
        setattr(m, name, nn.Identity())
    return m


def _inputs(n: int):
    g = torch.Generator().manual_seed(0)
    for shape in _SHAPES:
        yield (
            torch.randn([n if d < 0 else d for d in shape], generator=g, dtype=torch.float64) * 3
            + 1
        )


def _same(a, b) -> bool:
    return torch.is_tensor(a) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-9)


@torch.no_grad()
def _is_bn_like(module: nn.Module) -> bool:
    mean, var = getattr(module, "running_mean", None), getattr(module, "running_var", None)
    if not (isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor) and mean.dim() == 1):
        return False
    m = _stripped(module)
    x = next(x for x in _inputs(mean.numel()) if x.dim() > 1)
    view = [1, -1] + [1] * (x.dim() - 2)
    bias = m.bias if torch.is_tensor(getattr(m, "bias", None)) else torch.zeros_like(m.running_mean)
    want = (x - m.running_mean.view(view)) / torch.sqrt(m.running_var.view(view) + m.eps)
    want = want * m.weight.view(view) + bias.view(view)
    if not _same(m(x), want):
        return False
    for t in (m.running_mean, m.weight, bias):  # the rule's scales: the input / 2, the output / 4
        t.mul_(0.5 if t is m.running_mean else 0.25)
    m.running_var.mul_(0.25)
    m.eps = m.eps * 0.25
    return _same(m(x / 2), want / 4)


@torch.no_grad()
def _is_linear(module: nn.Module) -> bool:
    """A leaf module whose output, with W -> W s_in / s_out and b -> b / s_out (the linear
    rule), on x / s_in is its output / s_out: checked at s_in = 2, s_out = 4 on inputs
    whose last dimension is one of the weight's."""
    if next(module.children(), None) is not None or module.weight.dim() < 2:
        return False
    m = _stripped(module)
    bias: torch.Tensor | None = getattr(m, "bias", None)
    for n in dict.fromkeys(m.weight.shape):
        x = torch.randn(2, 3, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        try:
            y = m(x)
        except RuntimeError:
            continue
        if not (torch.is_tensor(y) and torch.isfinite(y).all()) or _same(y, torch.zeros_like(y)):
            return False
        m.weight.mul_(0.5)  # W x 2 / 4
        if isinstance(bias, torch.Tensor):
            bias.mul_(0.25)
        return _same(m(x / 2), y / 4)
    return False


@torch.no_grad()
def _is_invariant_norm(module: nn.Module) -> bool:
    m, name = _stripped(module), eps_name(module)
    if name is None:  # not a norm (the probe asks eps_name first)
        return False
    for x in _inputs(m.weight.numel()):
        try:
            y = m(x)
        except RuntimeError:
            continue
        if not (_same(y, y) and torch.isfinite(y).all()) or _same(y, torch.zeros_like(y)):
            return False
        setattr(m, name, getattr(m, name) / 16)
        scaled = _same(m(x / 4), y)
        for t in (m.weight, getattr(m, "bias", None)):
            if isinstance(t, torch.Tensor):
                t.div_(4)
        return scaled and _same(m(x / 4), y / 4)
    return False


def _call(m: nn.Module, x: torch.Tensor):
    """``m`` run with ``x`` for each argument its forward requires; its first tensor out."""
    params = inspect.signature(m.forward).parameters.values()
    n = sum(p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    out = m(*[x] * max(n, 1))
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _weights(m: nn.Module):
    """((weight name, bias name or None), weight, bias) of each submodule with a matrix
    weight, and of each matrix parameter of ``m`` itself (``in_proj_weight``, no bias)."""
    for name, sub in m.named_modules():
        w, b = getattr(sub, "weight", None), getattr(sub, "bias", None)
        if name and isinstance(w, torch.Tensor) and w.dim() >= 2:
            yield (f"{name}.weight", f"{name}.bias" if torch.is_tensor(b) else None), w, b
    for name, p in m.named_parameters(recurse=False):
        if p.dim() >= 2 and name != "weight":
            yield (name, None), p, None


@torch.no_grad()
def _probe_weights(module: nn.Module, x: torch.Tensor, s_in: float, s_out: float) -> tuple | None:
    """The names (inside ``module``) of the one weight and its bias (None without) for
    which the linear rule W s_in/s_out, b/s_out on input x/s_in divides the module's output
    by s_out exactly, or None."""
    m = copy.deepcopy(module).double().eval()
    x = x.double()
    try:
        y = _call(m, x)
    except Exception:  # a forward that needs more than its one input: not probed
        return None
    if not (torch.is_tensor(y) and torch.isfinite(y).all()) or _same(y, torch.zeros_like(y)):
        return None
    found = []
    for name, w, b in _weights(m):
        saved = [t.clone() for t in (w, b) if torch.is_tensor(t)]
        w.mul_(s_in / s_out)
        if torch.is_tensor(b):
            b.div_(s_out)
        if _same(_call(m, x / s_in), y / s_out):
            found.append(name)
        for t, v in zip([t for t in (w, b) if torch.is_tensor(t)], saved):
            t.copy_(v)
    return found[0] if len(found) == 1 else None


def output_linear_child(module: nn.Module, x: torch.Tensor) -> tuple | None:
    """The names of the one submodule's weight and bias (inside ``module``) that, divided by 4,
    divide ``module(x)`` by 4 exactly: a forward that ends in a linear map with that
    submodule's parameters, read functionally (torchvision's Swin attention runs
    ``F.linear(x, self.proj.weight, self.proj.bias)``). None when none or several do."""
    return _probe_weights(module, x, 1.0, 4.0)


def input_linear_weight(module: nn.Module, x: torch.Tensor) -> tuple | None:
    """The names of the one weight (a submodule's, or a matrix parameter) and its bias that,
    multiplied by 2, makes ``module(x / 2)`` equal ``module(x)`` (x passed to every
    argument the forward requires): a forward that starts with a linear map of its input
    (``nn.MultiheadAttention``'s ``in_proj_weight`` in self-attention). None when none or
    several do."""
    return _probe_weights(module, x, 2.0, 1.0)
