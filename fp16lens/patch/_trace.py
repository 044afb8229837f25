"""Per-site outputs of one torch forward, in execution order.

A site is a module's qualified name (as ``named_modules()`` gives it) for a torch.nn
leaf module, or ``module:op`` (``#k`` for the k-th in one call) for a functional op run
in a module's own forward -- the names watch() uses. Module attribution follows the
forward (pre-)hooks of ``fp16lens._trace.ModuleTracker`` (as in PyTorch's own); every hook is
removed on exit. The tracer also notes the first op whose float output is non-finite.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fp16lens._trace import FACTORY, PASSTHROUGH, Frame, ModuleTracker, op_name


@dataclass
class Trace:
    """What one traced forward saw: (site, output copy) in order, and the first non-finite op."""

    records: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    first_nonfinite: str | None = None
    first_nonfinite_op: tuple[str, str] | None = None  # (innermost module, raw aten op)
    keep: bool = True
    find_nonfinite: bool = True

    def add(self, site: str, tensor: torch.Tensor) -> None:
        if self.keep:
            self.records.append((site, tensor.detach().float().clone()))


class SiteTracer(TorchDispatchMode):
    """Records per-site outputs; subclasses may transform each op's outputs (``store``).
    The running module comes from ``tracker`` (set by ``traced``)."""

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace
        self.tracker: ModuleTracker | None = None

    def store(self, func, outputs: list[torch.Tensor]) -> None:
        """Hook for subclasses: what storing the op's outputs does (nothing here)."""

    def before(self, func, args, kwargs) -> None:
        """Hook for subclasses: called with an op's arguments before it runs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.before(func, args, kwargs)
        out = func(*args, **kwargs)
        floats = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.is_floating_point()]
        if floats:
            self.store(func, floats)
            self._note(func, floats)
        return out

    def _note(self, func, floats: list[torch.Tensor]) -> None:
        frame = self.tracker.top if self.tracker is not None else None
        if frame is None:  # outside the model's modules: named as in its root
            frame = Frame("", None, False, False, False)
        name = op_name(func)
        if name in FACTORY:
            return
        site = frame.name if frame.leaf else None
        if site is None and name not in PASSTHROUGH:
            site = frame.op_site(name)
            self.trace.add(site, floats[0])
        if not self.trace.find_nonfinite or self.trace.first_nonfinite is not None:
            return
        if not all(bool(torch.isfinite(t).all()) for t in floats):
            self.trace.first_nonfinite = site or frame.name
            self.trace.first_nonfinite_op = (frame.name, func.overloadpacket.__name__)

    @property
    def in_island(self) -> bool:
        """Inside a module that keeps itself FP32 under ``.half()`` (patch's Fp32Island)."""
        return self.tracker is not None and self.tracker.in_island

    def leave(self, frame: Frame, output) -> None:
        """Hook for subclasses: a module's forward returned ``output``."""

    def left(self, frame: Frame, args, output) -> None:
        """The tracker's callback: ``frame`` was popped."""
        self.leave(frame, output)
        if frame.leaf:
            leaves = [
                t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.is_floating_point()
            ]
            if leaves:
                self.trace.add(frame.name, leaves[0])


@contextlib.contextmanager
def traced(model: nn.Module, tracer: SiteTracer):
    """Run ``model`` under ``tracer`` with module hooks; everything undone on exit."""
    tracker = ModuleTracker(model, on_leave=tracer.left)
    tracer.tracker = tracker
    try:
        with tracker, tracer:
            yield tracer.trace
    finally:
        tracer.tracker = None
