"""The sites of a watched model, numbered in the order they first run: a torch.nn leaf
module's name, or ``module:op#k`` for the k-th functional op in a module's forward
(in a GraphModule, the fx node that runs it). The recorder and the meta FP16 trace
name sites here, so both give one site the same id."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn

from fp16lens._core.sites import site_name
from fp16lens._trace import Frame, graph_forwards, running_node


@dataclass
class SiteInfo:
    name: str
    kind: str
    op: str
    module: str
    order: int


class SiteTable:
    def __init__(self, root: nn.Module, names: dict[nn.Module, str]):
        self.root = root
        self.graphs = graph_forwards(names)  # GraphModules: ops named by their fx node
        self.sites: list[SiteInfo] = []
        self.ids: dict[str, int] = {}

    def site(self, frame: Frame, op: str) -> int:
        """The site of ``op`` (the frame's own output when ``op`` is empty) run in ``frame``."""
        if frame.leaf:
            name = frame.name
        else:
            graph = self.graphs.get(frame.name) if self.graphs else None
            name = frame.op_site((running_node(graph) or op) if graph is not None else op)
        sid = self.ids.get(name)
        if sid is None:
            shown, kind = (type(frame.module).__name__, "module") if frame.leaf else (op, "op")
            sid = self._add(name, kind, shown, frame.name)
        return sid

    def fused_site(self, frame: Frame, rel: str, op: str) -> int:
        """The site of a step a fused kernel stores (see _fused_kernels.Stored): ``rel`` names an
        op (":softmax") or a submodule ("norm1") of the running module, or an op of a
        submodule ("self_attn:softmax"); ops are numbered as in ``site``."""
        sub, sep, what = rel.partition(":")
        owner = f"{frame.name}.{sub}" if frame.name and sub else (sub or frame.name)
        name = owner
        if not sep:  # a submodule: shown by its class, as when its forward runs
            with contextlib.suppress(AttributeError):
                op = type(self.root.get_submodule(owner)).__name__
        else:
            name = site_name(owner, what, frame.nth(what if not sub else rel))
        sid = self.ids.get(name)
        if sid is None:
            sid = self._add(name, "op" if sep else "module", op, owner)
        return sid

    def _add(self, name: str, kind: str, shown: str, module: str) -> int:
        sid = self.ids[name] = len(self.sites)
        self.sites.append(SiteInfo(name, kind, shown, module, sid))
        return sid
