"""Which graph the scan runs for a batch: for each If, the batch's condition (a small run
of the nodes it depends on), and a copy of the graph with each If replaced by its taken
branch (``_inline.inline_if``). Nested Ifs come up to the main graph that way and are
resolved in the next round, until none is left or a condition depends on a Loop/Scan.
Inlined graphs are cached per tuple of conditions, so a scan of many batches down one path
builds one graph; a batch is first run on the graph of the batch before, whose run
computes the conditions it assumes (``OnnxGraph.checks``): the conditions are learnt apart
only when the path changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fp16lens._core import WatchError
from fp16lens._core.onnx_types import ancestors
from fp16lens._core.sites import IF_BRANCHES
from fp16lens.watch.onnx._graph import onnx_module
from fp16lens.watch.onnx._inline import inline_if, node_site

if TYPE_CHECKING:  # onnx and onnxruntime are optional (and not followed by mypy: its names are Any)
    from onnx import ModelProto
    from onnxruntime import InferenceSession


@dataclass
class Probe:
    """The top-level Ifs of one stage whose conditions can be known, and a pruned model
    computing those conditions (None: all are graph inputs or constants)."""

    ifs: list[int]  # node indices
    conds: list[str]
    session: InferenceSession | None = None
    consts: dict[str, bool] = field(default_factory=dict)

    def run(self, feed: dict) -> tuple[bool, ...]:
        got = {}
        if self.session is not None:
            order = [o.name for o in self.session.get_outputs()]
            fed = {i.name: feed[i.name] for i in self.session.get_inputs()}
            try:
                got = dict(zip(order, self.session.run(order, fed)))
            except Exception as exc:  # onnxruntime's Fail/InvalidArgument: shapes, dtypes
                raise WatchError(
                    f"ONNX Runtime failed computing the conditions of If nodes {', '.join(order[:3])} "
                    f"({str(exc).splitlines()[0][:300]}); give inputs of the shapes and dtypes the "
                    "model was exported for"
                ) from exc
        values = {**self.consts, **got, **feed}
        return tuple(bool(np.asarray(values[c]).reshape(-1)[0]) for c in self.conds)


def probe(model, make_session) -> Probe:
    onnx = onnx_module()
    g = model.graph
    ifs, conds, keep = [], [], set()
    for i, node in enumerate(g.node):
        if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
            continue
        up = ancestors(g, [node.input[0]])
        if up is not None:
            ifs.append(i)
            conds.append(node.input[0])
            keep |= up
    out = Probe(ifs, conds)
    inputs = {i.name for i in g.input}
    computed = [c for c in dict.fromkeys(conds) if c not in inputs]
    inits = {t.name: t for t in g.initializer}
    for c in [c for c in computed if c in inits]:
        out.consts[c] = bool(onnx.numpy_helper.to_array(inits[c]).reshape(-1)[0])
    computed = [c for c in computed if c not in inits]
    if computed:
        nodes = [g.node[i] for i in sorted(keep)]
        used = {t for n in nodes for t in n.input}
        pruned = onnx.helper.make_graph(
            nodes,
            f"{g.name}_conditions",
            [i for i in g.input if i.name in used],
            [onnx.helper.make_tensor_value_info(c, onnx.TensorProto.BOOL, None) for c in computed],
            [t for t in g.initializer if t.name in used],
        )
        m = onnx.helper.make_model(
            pruned, opset_imports=model.opset_import, ir_version=model.ir_version
        )
        m.functions.extend(model.functions)
        out.session = make_session(m)
    return out


@dataclass
class Inliner:
    """Per batch, the graph to scan: ``resolve(feed)`` -> (key, inlined ModelProto, the
    (If site, branch) pairs inlined, the (condition tensor, value) pairs it assumes: each is
    a tensor of the inlined graph too, so a later batch can be checked in the scan's own
    run). The key is the conditions met, stage by stage."""

    root: ModelProto
    make_session: Callable[[ModelProto], InferenceSession]
    _probes: dict = field(default_factory=dict)
    _models: dict = field(default_factory=dict)

    def resolve(self, feed: dict):
        key: tuple = ()
        model, taken = self.root, ()
        checks: tuple[tuple[str, bool], ...] = ()
        while True:
            if key not in self._probes:
                self._probes[key] = probe(model, self.make_session)
            p = self._probes[key]
            if not p.ifs:
                return key, model, taken, list(dict.fromkeys(checks))
            conds = p.run(feed)
            key = (*key, conds)
            checks = (*checks, *((c, v) for c, v in zip(p.conds, conds) if c not in p.consts))
            if key not in self._models:
                self._models[key] = self._inline(model, p.ifs, conds, taken)
            model, taken = self._models[key]

    @staticmethod
    def _inline(model, ifs: list[int], conds: tuple[bool, ...], taken: tuple):
        onnx = onnx_module()
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        done = []
        for i, cond in sorted(zip(ifs, conds), reverse=True):  # last first: indices stay valid
            done.append((node_site(copy.graph.node[i]), IF_BRANCHES[cond]))
            inline_if(copy, i, cond)
        return copy, (*taken, *reversed(done))
