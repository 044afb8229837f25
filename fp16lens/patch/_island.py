"""Fp32Island: a module that runs in FP32 inside a model that is otherwise cast to half.

The island is invisible to everything around it: its outputs have the dtype its consumers
expect, its state_dict keys are those of the module it wraps (a patched model's checkpoint
loads into the original class and back), and PyTorch's fused TransformerEncoderLayer path,
which reads the parameters of its submodules directly, is not taken around it.
"""

from __future__ import annotations

import torch
from torch import nn

from fp16lens._core.compat import register_state_dict_post_hook
from fp16lens._core.sites import ISLAND_ATTR

_INNER = "module"  # the wrapped module's attribute name, removed from state_dict keys


def _keep_fp32(fn):
    """Wrap an ``_apply`` function so FP32 tensors keep their dtype (and exact values)
    while device moves still happen: ``.half()`` leaves them FP32, ``.cuda()`` moves them."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        if t.dtype == torch.float32 and out.is_floating_point() and out.dtype != torch.float32:
            return t.to(device=out.device)
        return out

    return apply


def _cast_dtype(fn) -> torch.dtype | None:
    """The float dtype ``fn`` (an ``_apply`` function) casts a model to; None when it keeps
    dtypes (device moves, ``share_memory``) or is not a plain tensor function."""
    try:
        f32, f16 = fn(torch.zeros(1)), fn(torch.zeros(1, dtype=torch.float16))
    except Exception:  # an exotic fn: it is applied to the real tensors below anyway
        return None
    if f32.dtype == torch.float32 and f16.dtype == torch.float16:
        return None
    return f32.dtype if f32.is_floating_point() else None


def _no_fused_path(module, args):
    """Forward pre-hook, a no-op. ``nn.TransformerEncoderLayer`` reads the weights of its
    ``self_attn``, norms and linears itself for its fused kernel, which would bypass the
    island and mix FP32 weights with FP16 activations; it takes its module-by-module path
    (which calls the island) when any submodule has a hook."""
    return None


def _unwrap_keys(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: ``prefix + "module.w"`` -> ``prefix + "w"``, metadata too
    (the wrapped module's version under the island's name)."""

    def outer(key: str) -> str:
        return prefix[:-1] if key == prefix + _INNER else prefix + key[len(prefix + _INNER) + 1 :]

    inner = prefix + _INNER + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[outer(key)] = state_dict.pop(key)
    meta = getattr(state_dict, "_metadata", None) or {}
    for key in [k for k in meta if k == prefix + _INNER or k.startswith(inner)]:
        meta[outer(key)] = meta.pop(key)


def _leave(out, dtype: torch.dtype, pending: list[float]):
    """``out`` with its float tensors cast to ``dtype``; the first one is divided by the
    scale ``pending`` holds (a one-element list, emptied once used)."""
    if torch.is_tensor(out):
        if not out.is_floating_point():
            return out
        scale = pending.pop() if pending else 1.0
        return (out / scale if scale != 1.0 else out).to(dtype)
    if isinstance(out, (tuple, list)):
        items = [_leave(o, dtype, pending) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, dict):
        return type(out)((k, _leave(v, dtype, pending)) for k, v in out.items())
    return out


class Fp32Island(nn.Module):
    """Runs ``module`` in FP32: ``module(x.float() * in_scale) / out_scale`` cast back to the
    dtype outside the island. The scales connect the island to rescaled regions on either
    side (the values inside may exceed FP16; the island's output is in range).

    Positional float tensors are the activations: cast to FP32 and multiplied by
    ``in_scale``; those inside a positional tuple or list (a recurrent state) are only
    cast. Keyword float tensors (attention masks) are only cast. Of the output,
    the first float tensor (a tensor, or element 0 of ``MultiheadAttention``'s tuple) is
    divided by ``out_scale``; every float tensor goes back to the outside dtype: the
    input's float dtype, else (integer inputs: an embedding) the dtype the model was last
    cast to (``.half()``, ``.float()``, ``.to(dtype)``).

    Islands that follow each other on a span pass FP32 between them: ``fp32_out`` keeps the
    output FP32 (every consumer is another island, or it is the model's output), and
    ``fp32_in`` (inputs from such islands) hands back the dtype the model was cast to.

    The wrapped module's parameters are not rescaled, so its state_dict entries are those of
    the original model, under the original keys.
    """

    outside_dtype = torch.float32  # set per island; this default serves older pickles
    fp32_out = False  # class defaults: islands pickled before these existed
    fp32_in = False

    def __init__(
        self,
        module: nn.Module,
        in_scale: float = 1.0,
        out_scale: float = 1.0,
        fp32_out: bool = False,
        fp32_in: bool = False,
    ):
        super().__init__()
        self.fp32_out, self.fp32_in = bool(fp32_out), bool(fp32_in)
        tensors = [*module.parameters(), *module.buffers()]
        floats = [t.dtype for t in tensors if t.is_floating_point()]
        self.outside_dtype = floats[0] if floats else torch.float32
        self.module = module.float()
        self.in_scale = float(in_scale)
        self.out_scale = float(out_scale)
        self.train(module.training)
        self.register_forward_pre_hook(_no_fused_path)
        if isinstance(module, nn.MultiheadAttention):
            # an enclosing TransformerEncoderLayer takes its fused kernel (reading these
            # weights directly) only when self_attn._qkv_same_embed_dim; torch < 2.5 ignores
            # the hook above, so the island answers False (the wrapped module reads its own)
            self._qkv_same_embed_dim = False
        register_state_dict_post_hook(self, _unwrap_keys)

    def forward(self, *args, **kwargs):
        dtype = self.outside_dtype  # the first float input's, else the model's (a loop:
        for a in args:  # torch.export of torch 2.4 cannot trace next() over a generator)
            if torch.is_tensor(a) and a.is_floating_point() and not self.fp32_in:
                dtype = a.dtype
                break
        if self.fp32_out:
            dtype = torch.float32
        args = tuple(self._enter(a, self.in_scale) for a in args)
        kwargs = {k: self._enter(v, 1.0) for k, v in kwargs.items()}
        return _leave(self.module(*args, **kwargs), dtype, [self.out_scale])

    @staticmethod
    def _enter(a, scale: float):
        if isinstance(a, (tuple, list)):  # a recurrent state (LSTMCell's (h, c)): only cast
            return type(a)(Fp32Island._enter(t, 1.0) for t in a)
        if not (torch.is_tensor(a) and a.is_floating_point()):
            return a
        a = a.float()
        return a * scale if scale != 1.0 else a

    def __getattr__(self, name: str):
        """Attributes the model's own code reads from the wrapped module (``block.bn3.weight``,
        ``conv.out_channels``) pass through to it."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get(_INNER)
            if inner is None:
                raise
            return getattr(inner, name)

    def _apply(self, fn, recurse=True):
        dtype = _cast_dtype(fn)
        if dtype is not None:
            self.outside_dtype = dtype
        return super()._apply(_keep_fp32(fn), recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Keys are the wrapped module's (``prefix + "w"``): file them under ``module.``.
        Keys already under ``module.`` (checkpoints of islands before they kept the keys)
        stay, unless the wrapped module has a member of that name itself."""
        own = hasattr(self.module, _INNER)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if own or not key.startswith(f"{prefix}{_INNER}."):
                state_dict[f"{prefix}{_INNER}.{key[len(prefix) :]}"] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        flags = "".join(f", {k}=True" for k in ("fp32_in", "fp32_out") if getattr(self, k))
        return f"in_scale={self.in_scale:g}, out_scale={self.out_scale:g}{flags}"


setattr(Fp32Island, ISLAND_ATTR, True)  # the marker watch, verify and export recognise (is_island)
