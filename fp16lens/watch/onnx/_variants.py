"""The graphs one scan runs: the model itself, or with If nodes, one inlined graph per
tuple of conditions its batches meet (``_inline.Inliner``), each with its own ONNX Runtime
session, built the first time a batch needs it. Their sites share one list (a site is
known by its name across graphs), so the accumulator sees one model."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fp16lens._core import WatchError
from fp16lens.watch._recorder import INPUT_SITE, Forward, SiteInfo
from fp16lens.watch.onnx._graph import OnnxGraph, analyse
from fp16lens.watch.onnx._paths import Inliner
from fp16lens.watch.onnx._run import feed, ort_session, run_batch, session


@dataclass
class Variant:
    key: tuple
    graph: OnnxGraph
    session: Any
    ids: list[int]  # global site id of each of the graph's sites
    taken: tuple[tuple[str, str], ...]  # (If site, branch) inlined, in order


@dataclass
class Graphs:
    root: OnnxGraph
    sites: list[SiteInfo] = field(default_factory=list)
    variants: dict[tuple, Variant] = field(default_factory=dict)
    batches: Counter = field(default_factory=Counter)  # key -> batches that took it
    _ids: dict[str, int] = field(default_factory=dict)
    _where: dict[str, tuple[OnnxGraph, int]] = field(default_factory=dict)
    _inliner: Inliner | None = None
    _last: Variant | None = None  # the graph of the batch before

    def __post_init__(self):
        if any(n.op_type == "If" for n in self.root.proto.graph.node):
            self._inliner = Inliner(self.root.proto, lambda m: ort_session(m, self.root.name))

    def run(
        self,
        batch: Any,
        index: int,
        threshold: float,
        sample_size: int,
        observe: Callable | None = None,
    ) -> Forward:
        fw = None
        if self._last is not None:  # the batch before's path: its run checks the conditions
            v = self._last
            try:
                fw = run_batch(v.graph, v.session, batch, index, threshold, sample_size, observe)
            except WatchError:  # a branch this batch does not take may not run on it
                if not v.graph.checks:
                    raise
        if fw is None:
            key, model, taken, checks = (
                ((), None, (), [])
                if self._inliner is None
                else self._inliner.resolve(feed(self.root, batch))
            )
            v = self.variants.get(key) or self._variant(key, model, taken, checks)
            fw = run_batch(v.graph, v.session, batch, index, threshold, sample_size, observe)
            if fw is None:
                raise WatchError(
                    f"the If conditions of batch {index} changed between two runs of "
                    f"{self.root.name}; please report it with the model"
                )
        self._last = v
        self.batches[v.key] += 1
        fw.sites = [s if s == INPUT_SITE else v.ids[s] for s in fw.sites]
        fw.internal = [(v.ids[s], *rest) for s, *rest in fw.internal]
        return fw

    def _variant(self, key: tuple, model, taken, checks) -> Variant:
        graph = self.root if model is None or model is self.root.proto else analyse(model)
        graph.name, graph.checks = self.root.name, checks
        ids = []
        for local, info in enumerate(graph.sites):
            self._where.setdefault(info.name, (graph, local))
            if info.name not in self._ids:
                self._ids[info.name] = len(self.sites)
                self.sites.append(dataclasses.replace(info, order=len(self.sites)))
            ids.append(self._ids[info.name])
        v = self.variants[key] = Variant(key, graph, session(graph), ids, taken)
        return v

    def release(self) -> None:
        """Drop the If probes' sessions (the scan is done)."""
        self._inliner = None
        self._last = None

    def of_site(self, name: str) -> tuple[OnnxGraph, int] | None:
        """A graph holding site ``name`` and the site's id there."""
        return self._where.get(name)
