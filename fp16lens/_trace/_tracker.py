"""Which module is running: a stack of frames kept by forward (pre-)hooks on one model's
modules, in the spirit of PyTorch's ``torch.utils.module_tracker.ModuleTracker`` (which
keeps qualified names only). watch's recorder and verify's tracer both attribute ops to
the innermost frame; a frame also numbers the functional ops run in its own forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fp16lens._core.compat import dispatch_mode_paused
from fp16lens._core.sites import is_island, site_name
from fp16lens._trace._ops import BOUNDARY_MODULES, is_builtin_leaf


@dataclass(frozen=True, slots=True)
class Frame:
    """One running module's forward."""

    name: str  # qualified name, as named_modules() gives it
    module: nn.Module
    leaf: bool  # a torch.nn leaf module: its ops are named after it
    island: bool  # the module itself is an FP32 island
    fp32: bool  # inside an FP32 island: this module or an enclosing one
    counts: dict[str, int] = field(default_factory=dict, compare=False)

    def nth(self, op: str) -> int:
        """How many times ``op`` ran in this forward so far, this call included."""
        n = self.counts[op] = self.counts.get(op, 0) + 1
        return n

    def op_site(self, op: str) -> str:
        """The site of this call of functional op ``op``: ``module:op#k``."""
        return site_name(self.name, op, self.nth(op))


class ModuleTracker:
    """The running modules of ``model``, innermost last, while attached.

    ``on_enter(frame, args, kwargs)`` runs just before a frame is pushed, ``on_leave(frame,
    args, output)`` just after it is popped (also when the forward raised: the hooks
    always run), so both see the stack outside the frame.
    ``attach()``/``detach()`` add and remove the hooks; ``with tracker:`` does both.
    """

    def __init__(
        self,
        model: nn.Module,
        on_enter: Callable[[Frame, tuple, dict], None] | None = None,
        on_leave: Callable[[Frame, tuple, object], None] | None = None,
    ):
        self.names: dict[nn.Module, str] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            self.names.setdefault(m, name)
        self.leaf = {m: is_builtin_leaf(m) for m in self.names}
        self.stack: list[Frame] = []
        self.on_enter = on_enter
        self.on_leave = on_leave
        self._handles: list = []

    @property
    def top(self) -> Frame | None:
        return self.stack[-1] if self.stack else None

    @property
    def in_island(self) -> bool:
        """Inside a module that keeps itself FP32 under ``.half()`` (patch's islands)."""
        return bool(self.stack) and self.stack[-1].fp32

    def attach(self) -> None:
        for m in self.names:
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, always_call=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stack.clear()

    def __enter__(self) -> ModuleTracker:
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def _pre(self, module, args, kwargs):
        island = is_island(module)
        stack = self.stack
        frame = Frame(
            self.names.get(module, "?"),
            module,
            self.leaf.get(module, False),
            island,
            island or bool(stack and stack[-1].fp32),
        )
        if self.on_enter is not None:
            self.on_enter(frame, args, kwargs)
        stack.append(frame)
        return None

    def _post(self, module, args, output):
        if not self.stack:
            return None
        frame = self.stack.pop()
        if self.on_leave is not None:
            self.on_leave(frame, args, output)
        return None


def pause_at_boundary(mode: TorchDispatchMode, frame):
    """``(frame, exit stack)`` with ``mode`` paused while a boundary module (``nn.Linear``:
    several aten ops for one output, recorded at its boundary) runs; None for other
    modules, or when ``mode`` is not the innermost mode (its ops are then seen one by one)."""
    if type(frame.module) not in BOUNDARY_MODULES:
        return None
    stack = contextlib.ExitStack()
    if stack.enter_context(dispatch_mode_paused(mode)):
        return frame, stack
    stack.close()
    return None
