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
``.half()`` leaves them; their output is rounded when it leaves the island (unless the
island hands it on in FP32, ``fp32_out``). Ops that a
``.half()`` model itself runs in FP32 (its own upcasts, FP32 constants made in forward;
found by one FP16 run on ``meta``) are not rounded either.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from fp16lens._core.sites import is_island as is_fp32_island
from fp16lens.verify._trace import SiteTracer, Trace
from fp16lens.watch import compute_index, op_name

_STORED = (torch.float32, torch.float64)
# chain stage -> ops that may continue a fused chain from it
_CHAIN = {
    "head": frozenset({"batch_norm", "add", "relu"}),
    "batch_norm": frozenset({"add", "relu"}),
    "add": frozenset({"relu"}),
}
_HEADS = frozenset({"convolution", "addmm"})


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
        # compute ops a .half() model runs in FP32 (its own upcasts; watch._halfdtypes)
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
        """An FP32 island hands its output back to FP16 storage: round it (not where it
        hands it on in FP32: to islands after it, or as the model's output)."""
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
        return super().__torch_dispatch__(func, types, args, kwargs)

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
