"""Site names of the functional ops in a torch.fx GraphModule's forward: the fx node
that runs the op (``:add_1``, ``backbone:conv2d_3``), as ``print(gm.graph)`` shows it.

A GraphModule's forward is generated code; fx keeps a map from its line numbers to
graph nodes. The op's Python frame inside that forward gives the line, so the node.
"""

from __future__ import annotations

import sys
from types import FrameType

from torch import fx, nn

_DEPTH = 48  # frames between the generated forward and the dispatch mode (F.interpolate: ~6)


def graph_forwards(names: dict[nn.Module, str]) -> dict[str, tuple]:
    """Per GraphModule name: (forward's code object, line map, prologue start, node names)."""
    out = {}
    for module, name in names.items():
        if not isinstance(module, fx.GraphModule) or name in out:
            continue
        code = getattr(getattr(type(module), "forward", None), "__code__", None)
        lines = getattr(module, "_lineno_map", None)
        if code is not None and lines:
            nodes = [n.name for n in module.graph.nodes]
            out[name] = (code, lines, getattr(module, "_prologue_start", 0), nodes)
    return out


def running_node(forward: tuple) -> str | None:
    """The name of the fx node whose line of ``forward`` is running, None when not found."""
    code, lines, start, nodes = forward
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        if frame.f_code is code:
            index = lines.get(frame.f_lineno - start)
            return nodes[index] if index is not None and index < len(nodes) else None
        frame = frame.f_back
    return None


def model_class(model: nn.Module) -> str:
    """The model's class as its user knows it: ``Net``, ``Outer.Block``; a GraphModule
    (whose class fx makes inside a function) as ``GraphModule`` with where it came from."""
    cls = type(model)
    if not isinstance(model, fx.GraphModule):
        return cls.__name__ if "<locals>" in cls.__qualname__ else cls.__qualname__
    if any(c.__name__ == "_StatefulGraphModule" for c in cls.__mro__):
        return "GraphModule (torch.export)"
    if any(type(m).__module__.startswith("onnx2torch.") for m in model.modules()):
        return "GraphModule (converted from ONNX)"
    if cls.__name__ != "GraphModule":  # symbolic_trace names the class after the root's
        return f"GraphModule (traced {cls.__name__})"
    return "GraphModule"
