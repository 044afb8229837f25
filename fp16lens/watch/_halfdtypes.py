"""The meta FP16 run of a watched model, recorded per site (``HalfTrace``): which site
calls a ``.half()`` model computes in FP32 (the run itself: ``fp16lens._trace._half``)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp16lens._trace import first_float, pause_at_boundary
from fp16lens.watch._opinfo import OpInfo


class HalfTrace(TorchDispatchMode):
    """The meta FP16 run of a watched model (``with HalfTrace(...): run_half_on_meta(...)``):
    the (site, call number) pairs whose output is FP32 there, sites named by the
    recorder's table from the tracker's frames. A ``nn.Linear`` is seen at its boundary,
    as the recorder sees it (``enter``/``leave``, called by the recorder's hooks)."""

    def __init__(self, tracker, table, ops: dict, all_ops: bool):
        super().__init__()
        self.tracker, self.table, self.ops, self.all_ops = tracker, table, ops, all_ops
        self.base = len(tracker.stack)  # frames below are the real forward's
        self.found: set[tuple[int, int]] = set()
        self.calls: dict[int, int] = {}
        self.paused = None  # (frame, exit stack) of the Linear whose ops are not seen

    def note(self, site: int, out: torch.Tensor) -> None:
        k = self.calls.get(site, 0)
        self.calls[site] = k + 1
        if out.dtype != torch.float16:
            self.found.add((site, k))

    def enter(self, frame) -> None:
        if self.paused is None:
            self.paused = pause_at_boundary(self, frame)

    def leave(self, frame, output) -> None:
        if self.paused is not None and self.paused[0] is frame:
            if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel():
                self.note(self.table.site(frame, ""), output)
            self.unpause()

    def unpause(self) -> None:
        if self.paused is not None:
            self.paused[1].close()
            self.paused = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if len(self.tracker.stack) <= self.base:
            return out
        info = self.ops.get(func)
        if info is None:
            info = self.ops[func] = OpInfo.of(func)
        if info.factory or info.passthrough:
            return out
        first = first_float(out)
        if first is None or first.numel() == 0:
            return out
        frame = self.tracker.stack[-1]
        if self.all_ops or frame.leaf:
            self.note(self.table.site(frame, info.name), first)
        return out
