"""export() of an ONNX file (no PyTorch source): the FP32 graph re-typed to strongly typed
FP16 or to INT8 Q/DQ by the same converters the PyTorch path uses.

The FP32 islands are node names: those ``fp16lens.patch`` recorded in the file's metadata
(``fp16lens.fp32_nodes``, a JSON list), those the caller names, and every node stamped
with a module in ``fp32_modules`` (a file written by ``export(..., precision="fp32")``).
A node without a module stamp is its own unit: it is stamped with its name, the site name
``scan`` gives it, so that verify names the node where the FP16 graph departs.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from pathlib import Path

from fp16lens._core import ExportError, OptionError, import_optional
from fp16lens._core.onnx_types import FP32_NODES_KEY, in_order, read_file
from fp16lens.export._naming import MODULE_KEY, NodeOrigin, map_nodes, stamp
from fp16lens.export._onnx_meta import in_islands

ONNX_EXPORTER = "onnx"
_FLOAT16 = 10
_QDQ = ("QuantizeLinear", "DequantizeLinear")


def load_source(model):
    """A private copy of the FP32 graph (a path's external data read in), its nodes in
    topological order (``in_order``: the file written must pass the checker)."""
    onnx = import_optional("onnx", "onnx", "converting an ONNX model")
    if isinstance(model, (str, Path)):
        return in_order(read_file(onnx, Path(model), ExportError))
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    return in_order(proto)


def check_fp32_source(proto, src) -> None:
    """Refuse a graph that is already FP16 or INT8: converting it twice loses the FP32 truth."""
    g = proto.graph
    if any(n.op_type in _QDQ for n in g.node):
        raise ExportError(
            f"{src} already holds QuantizeLinear/DequantizeLinear nodes (an INT8 graph); "
            "export from the FP32 model instead"
        )
    half = [i.name for i in g.initializer if i.data_type == _FLOAT16]
    half += [v.name for v in (*g.input, *g.output) if v.type.tensor_type.elem_type == _FLOAT16]
    if half:
        raise ExportError(
            f"{src} already holds FP16 tensors ({', '.join(half[:3])}, ...); export from the "
            "FP32 model it came from, or, with only this file, export the FP32 graph "
            "`fp16lens patch` writes from it (scan and patch read an FP16 file as its FP32 twin)"
        )


def name_nodes(graph) -> None:
    """Every node gets a unique name: an unnamed one its first output (as scan names its
    site, e.g. paddle2onnx's ``batch_norm_0.tmp_3``), a repeated one ``name#k``."""
    taken: dict[str, int] = {}
    for node in graph.node:
        base = node.name or (node.output[0] if node.output else node.op_type)
        taken[base] = taken.get(base, 0) + 1
        node.name = base if taken[base] == 1 else f"{base}#{taken[base]}"


def node_origins(graph) -> dict[str, NodeOrigin]:
    """Node name -> origin: the module stamp export wrote, else the node itself."""
    mapped = map_nodes(graph, set(), [])
    out = {}
    for node, origin in zip(graph.node, mapped):
        stamped = any(p.key == MODULE_KEY for p in node.metadata_props)
        out[node.name] = origin if stamped else NodeOrigin(node.name, (node.name,))
    return out


def recorded_fp32_nodes(proto) -> list[str]:
    """The FP32 islands ``fp16lens.patch`` recorded in the graph's metadata."""
    raw = next((p.value for p in proto.metadata_props if p.key == FP32_NODES_KEY), None)
    if raw is None:
        return []
    try:
        nodes = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ExportError(
            f"metadata {FP32_NODES_KEY!r} is not JSON ({exc.msg}); it must be a list of node "
            "names, as fp16lens.patch writes it"
        ) from exc
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise ExportError(
            f"metadata {FP32_NODES_KEY!r} must be a JSON list of node names, got {raw!r}"
        )
    return nodes


def island_nodes(
    proto, origins: dict[str, NodeOrigin], fp32_nodes: Iterable[str], fp32_modules: Iterable[str]
) -> set[str]:
    """Recorded plus requested FP32 nodes, each checked to exist, plus the nodes of
    ``fp32_modules``."""
    names = [n.name for n in proto.graph.node]
    wanted = [*recorded_fp32_nodes(proto), *fp32_nodes]
    for name in wanted:
        if name not in origins:
            close = difflib.get_close_matches(name, names, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ExportError(f"fp32_nodes names {name!r}, which is not a node of the graph.{hint}")
    modules = tuple(fp32_modules)
    for module in modules:
        if not any(in_islands(o.modules, (module,)) for o in origins.values()):
            raise ExportError(
                f"fp32_modules names {module!r}, which no node of the graph comes from"
            )
    by_module = {n for n, o in origins.items() if modules and in_islands(o.modules, modules)}
    return set(wanted) | by_module


def prepare(model, fp32_nodes: Iterable[str] | None, fp32_modules: Iterable[str] | None):
    """(FP32 proto with named, stamped nodes, its island nodes) of an ONNX source."""
    for arg, what in ((fp32_nodes, "fp32_nodes"), (fp32_modules, "fp32_modules")):
        if isinstance(arg, str):
            raise OptionError(f"{what} must be a list of names, got the string {arg!r}")
    proto = load_source(model)
    src = model if isinstance(model, (str, Path)) else "the ONNX model"
    check_fp32_source(proto, src)
    name_nodes(proto.graph)
    origins = node_origins(proto.graph)
    islands = island_nodes(proto, origins, fp32_nodes or (), fp32_modules or ())
    for node in proto.graph.node:
        stamp(node, origins[node.name])
    return proto, origins, islands
