"""Which ops a ``.half()`` model still computes in FP32.

A model cast with ``.half()`` does not run every op in FP16: its own code upcasts
(``x.to(torch.float32).pow(2).mean()`` in T5/Llama norms, ``softmax(..., dtype=float32)``),
and tensors it creates in forward (``torch.arange``, ``torch.tensor``) stay FP32 and
promote what they touch. Values there may exceed 65504 without any FP16 overflow.

Watching the FP32 model cannot tell an upcast from a no-op, so the model is run once
more, in FP16 on the ``meta`` device (shapes and dtypes only, no arithmetic, no memory),
and every site call whose output is FP32 there is remembered by (site, call number).
That run only matters where some value passes the threshold, so it is deferred: the
first forward call's inputs are kept as meta tensors (``FirstCall``) and the trace runs
at the end of the first forward call that has a value out of range, if any.
A model whose forward needs real values (``.item()``, data-dependent shapes) cannot run
on ``meta``: then nothing is known and every op counts as FP16, as before.
"""

from __future__ import annotations

import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from fp16lens._core.sites import is_island
from fp16lens._trace._ops import FACTORY, PASSTHROUGH, op_name


def _fp32_owned(model: torch.nn.Module) -> set[str]:
    """Names of parameters/buffers that ``.half()`` leaves in FP32: those under an island
    whose ``_apply`` keeps FP32 (``Fp32Island``); an island without one (``PortableIsland``,
    whose FP32 values are int32 bits) has its float buffers cast as any module's."""
    keep: set[str] = set()
    for prefix, m in model.named_modules(remove_duplicate=False):
        if is_island(m) and type(m)._apply is not torch.nn.Module._apply:
            dot = f"{prefix}." if prefix else ""
            keep.update(dot + n for n, _ in m.named_parameters(remove_duplicate=False))
            keep.update(dot + n for n, _ in m.named_buffers(remove_duplicate=False))
    return keep


def _to_meta(t, dtype=torch.float16):
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().to(device="meta", dtype=dtype if t.is_floating_point() else t.dtype)


def run_half_on_meta(model: torch.nn.Module, args, kwargs) -> None:
    """``model.half()(*args)`` with every tensor on ``meta``; the model is not modified
    (its parameters are swapped for the call only). Raises what the forward raises."""
    keep = _fp32_owned(model)
    state = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # tied: once
        state[name] = _to_meta(t, torch.float32 if name in keep else torch.float16)
    margs = tree_map(_to_meta, tuple(args))
    mkwargs = tree_map(_to_meta, dict(kwargs or {}))
    saved = _snapshot(model)
    for m in model.modules():  # an island hands back the dtype .half() casts it to
        if is_island(m) and hasattr(m, "outside_dtype"):
            m.outside_dtype = torch.float16
    try:
        # tensors the forward creates without a device land on meta too
        with torch.no_grad(), torch.device("meta"):
            torch.func.functional_call(model, state, margs, mkwargs, tie_weights=True, strict=False)
    finally:
        _restore(saved)


_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


def _snapshot(model: torch.nn.Module) -> list:
    """Each module's own attributes, with one level of dicts/lists/sets copied: a forward
    that caches what it computed (anchors, masks, rotary tables) must not keep the meta
    tensors of this run."""
    saved = []
    for m in model.modules():
        attrs = {}
        for k, v in m.__dict__.items():
            if k not in _MODULE_INTERNALS and type(v) in (dict, list, set):
                v = type(v)(v)
            attrs[k] = v
        saved.append((m, attrs))
    return saved


def _restore(saved: list, training: bool = False) -> None:
    for m, attrs in saved:
        if training:
            m.training = attrs["training"]
        for k in [k for k in m.__dict__ if k not in attrs]:
            del m.__dict__[k]
        for k, v in attrs.items():
            if k in _MODULE_INTERNALS:
                continue  # parameters, buffers, hooks: restored by functional_call itself
            if type(v) in (dict, list, set) and type(m.__dict__.get(k)) is type(v):
                cur = m.__dict__[k]
                cur.clear()
                cur.update(v) if not isinstance(cur, list) else cur.extend(v)
            else:
                m.__dict__[k] = v


class FirstCall:
    """The first forward call, as the deferred meta trace needs it: the module called,
    meta copies of its inputs (FP16 where floating), and its modules' attributes then."""

    def __init__(self, module: torch.nn.Module, args, kwargs):
        self.module = module
        self.args = tree_map(_to_meta, tuple(args))
        self.kwargs = tree_map(_to_meta, dict(kwargs or {}))
        self.state = _snapshot(module)

    def run_half_on_meta(self) -> None:
        """``run_half_on_meta`` on this call, with the modules' attributes (caches the
        forward calls since made, train/eval flags) as they were before it."""
        now = _snapshot(self.module)
        _restore(self.state, training=True)
        try:
            run_half_on_meta(self.module, self.args, self.kwargs)
        finally:
            _restore(now, training=True)


# ops whose CPU and CUDA kernels refuse float operands of two dtypes (meta kernels accept them)
_ONE_DTYPE = frozenset(
    {"mm", "bmm", "addmm", "addmv", "mv", "dot", "baddbmm", "addbmm", "convolution"}
)


HALF_FAILS = "(.half() fails"
"""How an FP16 run names a ``.half()`` that cannot run, where it would name a site."""


class HalfFails(RuntimeError):
    """A ``.half()`` forward cannot run: an FP32 tensor meets FP16 weights in an op whose
    real kernels refuse two float dtypes."""

    def words(self) -> str:
        """Where an FP16 run names its first non-finite site: ``(.half() fails: why)``."""
        return f"{HALF_FAILS}: {self})"


_DTYPE_WORDS = re.compile(r"(?i)dtype|scalar type|type promot|\bhalf\b|float16|same type")
_MISSING_KERNEL = re.compile(r"(?i)not implemented for '")
"""A kernel's own error that refuses its operands' dtypes says so in ``_DTYPE_WORDS``;
"not implemented for 'Half'" is another matter (a CPU kernel missing, which the CPU
emulation does not need and a GPU has)."""


def dtype_refusal(text: str) -> str | None:
    """The first line of an error ``text`` when it refuses operands' dtypes, else None."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    if _DTYPE_WORDS.search(line) and not _MISSING_KERNEL.search(line):
        return line[:160]
    return None


_PROBE_NUMEL = 1 << 22
"""Operands up to this size are probed as real zeros (an in-place op can write them);
larger ones as one zero expanded to the shape (no memory)."""


def _on_cpu(t):
    if isinstance(t, torch.Tensor) and t.device.type == "meta":
        if t.numel() <= _PROBE_NUMEL:
            return torch.zeros(t.shape, dtype=t.dtype, device="cpu")
        return torch.zeros((), dtype=t.dtype, device="cpu").expand(t.shape)
    return torch.device("cpu") if isinstance(t, torch.device) and t.type == "meta" else t


def _real_kernel_refuses(func, args, kwargs) -> str | None:
    """Why the CPU kernel of ``func`` refuses these operands' dtypes, or None: the op run
    once on real zeros of the same shapes and dtypes. Any other refusal (a value, a
    layout, a kernel missing for FP16) is not about mixed dtypes and says nothing."""
    try:
        func(*tree_map(_on_cpu, tuple(args)), **tree_map(_on_cpu, dict(kwargs or {})))
    except Exception as exc:  # any refusal; only a dtype one counts
        return dtype_refusal(str(exc))
    return None


def _refuse_mixed(func, args, kwargs) -> None:
    """Raise ``HalfFails`` where the real ``.half()`` kernel refuses an op's float operands
    of two dtypes (meta kernels accept them): matmuls, convolutions and attention always;
    any other op (``prelu`` with an FP32 weight made in forward) when its CPU kernel,
    run once on these shapes, refuses them."""
    dtypes = {
        t.dtype
        for t in tree_flatten((args, kwargs or {}))[0]
        if torch.is_tensor(t) and t.is_floating_point()
    }
    if len(dtypes) < 2:
        return
    name = func.overloadpacket.__name__
    if name in _ONE_DTYPE or "scaled_dot_product" in name:
        got = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise HalfFails(f"{name}: operands must have the same dtype, got {got}")
    why = _real_kernel_refuses(func, args, kwargs)
    if why is not None:
        raise HalfFails(f"{name}: {why}")


def fp32_compute_ops(
    model: torch.nn.Module, args, kwargs=None, *, refuse_mixed: bool = False
) -> set[int] | None:
    """Positions (among the ops that compute new float values: no views, copies, casts
    or factories) of the ops a ``.half()`` model runs in FP32; None when the forward
    cannot run on meta. An FP32 run of the same code dispatches the same compute ops
    in the same order (a cast to float32 is not dispatched there, and not counted here).
    ``refuse_mixed``: raise ``HalfFails`` where the real ``.half()`` cannot run (a matmul,
    convolution or attention of two float dtypes, or an op refusing its dtypes), which
    meta kernels alone let pass: one trace answers both questions."""
    found: set[int] = set()
    count = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if refuse_mixed:
                _refuse_mixed(func, a, kw)
            out = func(*a, **(kw or {}))
            k = compute_index(func, out, count)
            if k is not None and first_float(out).dtype != torch.float16:
                found.add(k)
            return out

    try:
        with Count():
            run_half_on_meta(model, args, kwargs)
    except HalfFails:
        raise
    except RuntimeError as exc:
        text = str(exc)
        why = dtype_refusal(text) if refuse_mixed else None
        if why is not None:
            raise HalfFails(why) from exc
        return None
    except Exception:
        return None
    return found


def first_float(out):
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (list, tuple)):
        return next((t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return None


def compute_index(func, out, count: list[int]) -> int | None:
    """The running position of a compute op with a float output (``count`` is bumped)."""
    name = op_name(func)
    if name in FACTORY or name in PASSTHROUGH:
        return None
    t = first_float(out)
    if t is None or t.numel() == 0:
        return None
    count[0] += 1
    return count[0] - 1
