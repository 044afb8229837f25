"""The export result: where the file is, and how its nodes map back to the model's modules."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp16lens._core import import_optional
from fp16lens._core.onnx_types import PRECISION_KEY
from fp16lens._core.sites import parse_site
from fp16lens.export._naming import NodeOrigin, origin_of

EXPORTER_KEY = "fp16lens.exporter"


@dataclass(frozen=True)
class NodeRecord:
    """One ONNX node: its name, op type, outputs, and the module(s) it came from."""

    name: str
    op_type: str
    outputs: tuple[str, ...]
    origin: NodeOrigin


@dataclass(frozen=True)
class ExportArtifact:
    """An exported ONNX file.

    ``node_map``: ONNX node name -> module qualified name (the module whose output the node
    computes; ``""`` is the root module). ``node_modules`` adds every module merged into the
    node (a batch norm folded into its conv maps to both). ``fp32_nodes``: nodes computing
    in FP32 (the islands) in an FP16 export. ``parity``: for an FP16 export, the written file
    checked in real FP16 (a ``fp16lens.verify.ParityResult``; a warning says so where it
    fails): on a PyTorch model's example inputs, on an ONNX source's ``evaluation=``
    batches (None without them, and a warning says the file was not checked). ``int8``:
    for an INT8 export, its plan as plain data (units quantized, the INT8 FLOPs share, the
    target with its score, each unit kept out of INT8 with its FLOPs share and what it
    costs alone in INT8, the rewrites made); None otherwise and for a loaded artifact.
    """

    path: Path
    precision: str
    exporter: str
    opset: int
    nodes: tuple[NodeRecord, ...] = field(repr=False)
    fp32_nodes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    calibration_cache: Path | None = None
    parity: Any = field(default=None, repr=False, compare=False)
    int8: dict | None = field(default=None, repr=False, compare=False)

    @property
    def node_map(self) -> dict[str, str]:
        return {n.name: n.origin.module for n in self.nodes if n.origin.module is not None}

    @property
    def node_modules(self) -> dict[str, tuple[str, ...]]:
        return {n.name: n.origin.modules for n in self.nodes if n.origin.module is not None}

    @property
    def coverage(self) -> float:
        """Share of nodes mapped to a module."""
        return len(self.node_map) / len(self.nodes) if self.nodes else 1.0

    def tensor_for_site(self, site: str) -> str | None:
        """The ONNX tensor holding a report site's output, or None when the export has none.

        A module site (``layer4.1.bn2``) gives the output of the last node mapped to it or
        to a module inside it; a
        functional site (``layer4.1:add#2``) the output of the n-th such aten op in that
        module. A conv whose batch norm was folded into it has no tensor of its own (None).
        """
        name = parse_site(site)
        if not name.is_op:
            return _last_output([n for n in self.nodes if _within(n.origin.module, name.module)])
        groups = _op_groups(self.nodes, name.module, name.op)
        return _last_output(groups[name.nth - 1]) if 0 < name.nth <= len(groups) else None

    @classmethod
    def load(cls, path: str | Path) -> ExportArtifact:
        """Rebuild the artifact of a file written by ``export`` (the mapping lives in it)."""
        onnx = import_optional("onnx", "onnx", "reading an exported model")
        model = onnx.load(str(path), load_external_data=False)
        meta = {p.key: p.value for p in model.metadata_props}
        return cls(
            path=Path(path),
            precision=meta.get(PRECISION_KEY, "unknown"),
            exporter=meta.get(EXPORTER_KEY, "unknown"),
            opset=default_opset(model),
            nodes=records(model.graph),
        )

    def __repr__(self) -> str:
        return (
            f"ExportArtifact(path={str(self.path)!r}, precision={self.precision!r}, "
            f"exporter={self.exporter!r}, nodes={len(self.nodes)}, "
            f"fp32_nodes={len(self.fp32_nodes)}, warnings={len(self.warnings)})"
        )


def default_opset(model) -> int:
    """The model's ai.onnx opset version."""
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def records(graph) -> tuple[NodeRecord, ...]:
    """The nodes of a graph whose origins ``export`` stamped into their metadata."""
    return tuple(
        NodeRecord(n.name, n.op_type, tuple(n.output), origin_of(n, set(), {})) for n in graph.node
    )


def _within(name: str | None, module: str) -> bool:
    return name is not None and (name == module or not module or name.startswith(f"{module}."))


def _last_output(nodes: list[NodeRecord]) -> str | None:
    return nodes[-1].outputs[0] if nodes and nodes[-1].outputs else None


def _op_groups(nodes: tuple[NodeRecord, ...], module: str, op: str) -> list[list[NodeRecord]]:
    """Nodes of each call of aten ``op`` in ``module``'s forward, in graph order."""
    groups: dict[str, list[NodeRecord]] = {}
    for n in nodes:
        if n.origin.module != module:
            continue
        if n.origin.op == op or (not n.origin.fx_node and n.op_type.lower() == op.replace("_", "")):
            key = n.origin.fx_node or n.name
            groups.setdefault(key, []).append(n)
    return list(groups.values())
