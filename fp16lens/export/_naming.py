"""ONNX node -> module qualified name, from the exporters' scope information.

The dynamo exporter writes ``pkg.torch.onnx.name_scopes`` into each node's metadata:
``['', 'backbone', 'backbone.layer4', 'backbone.layer4.1', 'backbone.layer4.1.bn2',
'<fx node>']`` -- the module is the entry before the FX node name. The TorchScript
exporter scopes node names instead: ``/backbone/layer4/layer4.1/conv2/Conv``.

The mapping is written back into every node as ``fp16lens.*`` metadata, so a saved
file carries it (``node_map_from_model`` reads it back).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass

MODULE_KEY = "fp16lens.module"
MODULES_KEY = "fp16lens.modules"
OP_KEY = "fp16lens.op"
FX_KEY = "fp16lens.fx_node"
_SCOPES = "pkg.torch.onnx.name_scopes"
_FX_NODE = "pkg.torch.onnx.fx_node"
_REPEAT = re.compile(r"_\d+$")
_TARGET = re.compile(r"target=torch\.ops\.aten\.([A-Za-z0-9_]+)\.")


@dataclass(frozen=True)
class NodeOrigin:
    """Where one ONNX node came from: its module, every module merged into it, the aten op."""

    module: str | None
    modules: tuple[str, ...] = ()
    op: str = ""
    fx_node: str = ""


def module_from_scopes(scopes: list[str], names: set[str]) -> str | None:
    """The module of a dynamo node: the last scope entry (before the FX node) that is a module."""
    for entry in reversed(scopes[:-1]):
        if entry in names:
            return entry
    return "" if scopes else None


def module_from_scoped_name(node_name: str, names: set[str]) -> str | None:
    """The module of a TorchScript node named ``/a/b/b.0/Conv`` (``a.b.0``); None if unscoped."""
    parts = [p for p in node_name.split("/") if p]
    if not parts or not node_name.startswith("/"):
        return None
    qual = ""
    for part in parts[:-1]:
        parent = qual.rpartition(".")[0] if "." in part else qual
        bare = _REPEAT.sub("", part)  # a module called twice: relu, relu_1
        found = [
            c for c in (_join(qual, part), _join(parent, part), _join(qual, bare)) if c in names
        ]
        if not found:
            return qual
        qual = found[0]
    return qual


def origin_of(node, names: set[str], param_owner: dict[str, str]) -> NodeOrigin:
    """Everything the exporter recorded about one node."""
    meta = {p.key: p.value for p in node.metadata_props}
    if MODULE_KEY in meta:
        mods = tuple(meta.get(MODULES_KEY, meta[MODULE_KEY]).split(","))
        return NodeOrigin(meta[MODULE_KEY], mods, meta.get(OP_KEY, ""), meta.get(FX_KEY, ""))
    if _SCOPES in meta:
        scopes = ast.literal_eval(meta[_SCOPES])
        module = module_from_scopes(scopes, names)
        match = _TARGET.search(meta.get(_FX_NODE, ""))
        op, fx = (match.group(1) if match else ""), (scopes[-1] if scopes else "")
    else:
        module, op, fx = module_from_scoped_name(node.name, names), "", ""
    folded = [param_owner[i] for i in node.input if i in param_owner]
    modules = _unique([*folded, module] if module is not None else folded)
    return NodeOrigin(module, tuple(modules), op, fx)


def map_nodes(graph, names: Iterable[str], param_names: Iterable[str]) -> list[NodeOrigin]:
    """Origins of all nodes in graph order; unscoped nodes borrow a neighbour's module."""
    names = set(names)
    owner = {p: p.rpartition(".")[0] for p in param_names}
    origins = [origin_of(n, names, owner) for n in graph.node]
    return _fill_unmapped(graph, origins)


def _fill_unmapped(graph, origins: list[NodeOrigin]) -> list[NodeOrigin]:
    """A node without scope (a shared weight's Identity, a shape helper) takes the module of
    its first consumer, else of its producer."""
    consumer: dict[str, int] = {}
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for t in node.input:
            consumer.setdefault(t, i)
        for t in node.output:
            producer[t] = i
    for _ in range(3):  # chains of helpers resolve in a few passes
        for i, node in enumerate(graph.node):
            if origins[i].module is not None:
                continue
            near = [consumer.get(t) for t in node.output] + [producer.get(t) for t in node.input]
            for j in near:
                if j is not None and (m := origins[j].module) is not None:
                    origins[i] = NodeOrigin(m, (m,), origins[i].op, origins[i].fx_node)
                    break
    return origins


def stamp(node, origin: NodeOrigin) -> None:
    """Write the origin into the node's metadata (replacing an earlier stamp)."""
    keep = [p for p in node.metadata_props if not p.key.startswith("fp16lens.")]
    del node.metadata_props[:]
    node.metadata_props.extend(keep)
    if origin.module is None:
        return
    for key, value in (
        (MODULE_KEY, origin.module),
        (MODULES_KEY, ",".join(origin.modules)),
        (OP_KEY, origin.op),
        (FX_KEY, origin.fx_node),
    ):
        entry = node.metadata_props.add()
        entry.key, entry.value = key, value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
