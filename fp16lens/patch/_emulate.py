"""FP16 storage emulated in FP32: every op computes in FP32 and its float output is
rounded to FP16 and back (``t.half().float()``), which is what storing it in FP16 does
to range (> 65504 becomes inf) and to precision (11 significant bits).

With ``fusions=True`` the pre-activations TensorRT keeps inside one kernel are not
rounded: a convolution or matmul output consumed by a batch norm, a residual add or a
ReLU continues a fused chain (conv -> bn -> add -> relu) and is rounded only when
something else reads it, or when the chain ends. Accumulation inside an op stays FP32.
Parameters are rounded as ``.half()`` stores them (a batch norm's running_var beyond
65504 becomes inf), even where TensorRT folds the batch norm into its conv first.
Modules marked ``fp16lens_fp32`` (patch's Fp32Island) compute and store in FP32, as
``.half()`` leaves them; their output is rounded when it leaves the island, unless the
island hands FP32 onward (``fp32_out``: patch's last resort, ``_widen.Fp32Span``). Ops that a
``.half()`` model itself runs in FP32 (its own upcasts, FP32 constants made in forward;
found by one FP16 run on ``meta``) are not rounded either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from fp16lens._core.sites import is_island as is_fp32_island
from fp16lens._core.sites import site_name
from fp16lens._trace import call_model, compute_index, fp32_compute_ops, op_name
from fp16lens.patch._trace import SiteTracer, Trace

_STORED = (torch.float32, torch.float64)
# chain stage -> ops that may continue a fused chain from it
_CHAIN = {
    "head": frozenset({"batch_norm", "add", "relu"}),
    "batch_norm": frozenset({"add", "relu"}),
    "add": frozenset({"relu"}),
}
_HEADS = frozenset({"convolution", "addmm"})
# ops whose FP16 CPU kernels read a scalar operand (a Python number, a 0-dim tensor, add's
# alpha) as FP16, measured on torch 2.4 to 2.15 (mul and div keep it FP32): `s > 0.3`
# compares with 0.2998, `x + 1000.3` adds 1000.5
_COMPARE = frozenset({"gt", "ge", "lt", "le", "eq", "ne"})
_FP16_SCALAR = _COMPARE | {"add", "sub", "rsub", "pow", "fmod", "remainder"}
# a site flushes where FP16 storage rounds this share of its non-zero outputs to 0
FLUSH_SHARE = 0.01


def round_fp16_(t: torch.Tensor) -> None:
    """Round a float tensor to the nearest FP16 value in place (inf beyond 65504)."""
    if t.dtype in _STORED and t.numel():
        t.copy_(t.to(torch.float16))


def round_module_(model: torch.nn.Module) -> None:
    """Parameters and float buffers stored in FP16: round them in place (FP32 islands,
    which ``.half()`` leaves in FP32, keep theirs)."""
    islands = [f"{n}." for n, m in model.named_modules() if is_fp32_island(m)]
    with torch.no_grad():
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            if not any(name.startswith(i) or i == "." for i in islands):
                round_fp16_(t)


class StorageRounding(SiteTracer):
    """A SiteTracer whose ops store their float outputs in FP16 (see module docstring)."""

    def __init__(self, trace: Trace, fusions: bool = False, fp32_ops: set[int] | None = None):
        super().__init__(trace)
        self.fusions = fusions
        # compute ops a .half() model runs in FP32 (its own upcasts; fp16lens._trace)
        self.fp32_ops = fp32_ops or set()
        self.count = [0]
        self.pending = WeakIdKeyDictionary()  # unrounded tensor -> chain stage
        self._continues = False

    def before(self, func, args, kwargs) -> None:
        if not self.pending:
            return
        name = op_name(func)
        for t in tree_flatten((args, kwargs))[0]:
            stage = self.pending.get(t) if torch.is_tensor(t) else None
            if stage is not None and name not in _CHAIN.get(stage, ()):
                del self.pending[t]
                round_fp16_(t)

    def leave(self, frame, output) -> None:
        """An FP32 island hands its output back to FP16 storage: round it."""
        if frame.island and not self.in_island and not getattr(frame.module, "fp32_out", False):
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.is_floating_point():
                    round_fp16_(t)

    def store(self, func, outputs: list[torch.Tensor]) -> None:
        k = compute_index(func, outputs, self.count)
        if self.in_island or (k is not None and k in self.fp32_ops):
            return
        name = op_name(func)
        writes = _writes(func)
        stage = self._fused_stage(func, name) if self.fusions else None
        for t in outputs:
            if _is_view(func, writes) or t.dtype not in _STORED:
                continue
            if stage is not None:
                self.pending[t] = stage
            else:
                self.pending.pop(t, None)
                round_fp16_(t)

    def _fused_stage(self, func, name: str) -> str | None:
        """The chain stage of this op's output when it stays inside a fused kernel."""
        if name in _HEADS:
            return "head"
        return name if name in _CHAIN and self._continues else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._continues = self.fusions and bool(self.pending) and self._chained(func, args, kwargs)
        if op_name(func) in _FP16_SCALAR and not self.in_island:
            args, kwargs = self._fp16_scalars(func, args, kwargs or {})
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _fp16_scalars(self, func, args, kwargs: dict) -> tuple[tuple, dict]:
        """The scalar operands of an add, sub, pow, fmod, remainder or comparison as an FP16
        kernel reads them: rounded to FP16, where the op computes in FP16 (not where ``.half()`` runs it
        in FP32; a comparison is judged by its tensor operand holding FP16 values)."""
        tensors = [a for a in args if torch.is_tensor(a) and a.is_floating_point() and a.dim()]
        if not tensors or tensors[0].dtype not in _STORED:
            return args, kwargs
        if op_name(func) in _COMPARE:
            t = tensors[0]
            if not torch.equal(t.to(torch.float16).to(t.dtype), t):
                return args, kwargs  # an FP32 operand (the model's own upcast)
        elif self.count[0] in self.fp32_ops:
            return args, kwargs

        def fp16(v):
            if isinstance(v, float):
                return float(torch.tensor(v, dtype=torch.float16))
            if torch.is_tensor(v) and v.dim() == 0 and v.dtype in _STORED:
                return v.to(torch.float16).to(v.dtype)
            return v

        return tuple(fp16(a) for a in args), {k: fp16(v) for k, v in kwargs.items()}

    def _chained(self, func, args, kwargs) -> bool:
        """Whether an input of this op is a pending tensor whose chain this op continues."""
        name = op_name(func)
        for t in tree_flatten((args, kwargs or {}))[0]:
            if torch.is_tensor(t) and name in _CHAIN.get(self.pending.get(t, ""), ()):
                return True
        return False

    def flush(self, output) -> None:
        """Round what a fused chain left unrounded in the model's final outputs."""
        for t in tree_flatten(output)[0]:
            if torch.is_tensor(t) and t in self.pending:
                del self.pending[t]
                round_fp16_(t)


def _writes(func) -> bool:
    return any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)


def _is_view(func, writes: bool) -> bool:
    """An op returning an alias it did not write (a view): its values are already stored."""
    return not writes and any(r.alias_info is not None for r in func._schema.returns)


def _cast_floats(batch, dtype):
    """``batch`` (a tensor, a tuple/list of positional inputs or a dict of keywords) with
    its float tensors cast to ``dtype``."""

    def cast(a):
        return a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a

    if isinstance(batch, dict):
        return {k: cast(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return tuple(cast(a) for a in batch)
    return cast(batch)


def emulated_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in FP32 whose parameters and buffers are stored in FP16
    (rounded; FP32 islands keep theirs): what ``run_emulated`` runs."""
    import copy

    out = copy.deepcopy(model).eval().float()
    round_module_(out)
    return out


def run_emulated(
    model: torch.nn.Module,
    batch,
    trace: Trace | None = None,
    fp32_ops: set[int] | None = None,
    rounding: Callable[..., StorageRounding] = StorageRounding,
):
    """One forward of ``model`` (from ``emulated_copy``) on ``batch`` with FP16 storage of
    every stored tensor: the inputs rounded to FP16, each op's float output rounded (see
    the module docstring). ``trace`` (default: no copies) names the first non-finite op.
    ``fp32_ops``: the ops a ``.half()`` model runs in FP32 (None: found here on ``meta``);
    ``rounding``: makes the mode that stores each op's outputs (a subclass may count them)."""
    from fp16lens.patch._trace import traced

    x = _cast_floats(_cast_floats(batch, torch.float16), torch.float32)
    if fp32_ops is None:
        args, kwargs = (
            ((), x) if isinstance(x, dict) else ((x if isinstance(x, tuple) else (x,)), {})
        )
        fp32_ops = fp32_compute_ops(model, args, kwargs) or set()
    trace = trace if trace is not None else Trace(keep=False)
    mode = rounding(trace, fp32_ops=fp32_ops)
    with torch.no_grad():
        with traced(model, mode):
            out = call_model(model, x)
        mode.flush(out)
    return out


class _FlushCounting(StorageRounding):
    """StorageRounding that counts, per site, the non-zero float outputs its rounding makes
    0 (at most 2^-25 in magnitude), and those an FP32 island's rounded output loses."""

    def __init__(self, trace: Trace, fusions: bool = False, fp32_ops: set[int] | None = None):
        super().__init__(trace, fusions, fp32_ops)
        self.counts: dict[str, list[int]] = {}

    def _count(self, site: str, tensors) -> None:
        for t in tensors:
            if torch.is_tensor(t) and t.dtype in _STORED and t.numel():
                nz = t != 0
                c = self.counts.setdefault(site, [0, 0])
                c[0] += int((nz & (t.abs() <= 2.0**-25)).sum())
                c[1] += int(nz.sum())

    def store(self, func, outputs: list[torch.Tensor]) -> None:
        frame = self.tracker.top if self.tracker is not None else None
        k = None if frame is None else compute_index(func, outputs, [self.count[0]])
        if frame is not None and not self.in_island and (k is None or k not in self.fp32_ops):
            name = op_name(func)
            nth = frame.counts.get(name, 0) + 1  # _note numbers the call after this
            self._count(frame.name if frame.leaf else site_name(frame.name, name, nth), outputs)
        super().store(func, outputs)

    def leave(self, frame, output) -> None:
        if frame.island and not self.in_island and not getattr(frame.module, "fp32_out", False):
            self._count(frame.name, tree_flatten(output)[0])
        super().leave(frame, output)


def flushing_sites(emulated: torch.nn.Module, batch) -> list[tuple[str, float]]:
    """The sites whose FP16 storage rounds at least ``FLUSH_SHARE`` of their non-zero
    outputs to 0 on ``batch`` (``emulated``: an ``emulated_copy``), with that share, in
    run order: what real FP16 loses below 2^-24 without any value leaving range."""
    modes: list[_FlushCounting] = []

    def counting(*args, **kwargs) -> _FlushCounting:
        modes.append(_FlushCounting(*args, **kwargs))
        return modes[0]

    run_emulated(emulated, batch, Trace(keep=False), rounding=counting)
    return [(s, f / n) for s, (f, n) in modes[0].counts.items() if n and f / n >= FLUSH_SHARE]
