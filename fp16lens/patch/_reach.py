"""How far an FP32 island reaches: it runs every op whose value FP16 cannot hold and no
region rescales, up to the ops where values are back in range, and islands that follow
each other on a span pass FP32 between them.

A set of sites kept FP32 (``fp32``) is realized by *hosts*, the modules that become
islands: a module site is its own host (an ONNX node too), a functional activation the
new child ``mark_activations`` planned, any other functional op its owning module (never
the model itself: such an op stays unresolved). A host's sites are all sites that run
inside it. In the site graph each of them blocks (``Kind.BLOCK``): a class ends there,
the host's single output may carry a scale out (``out_scale``, absorbed by the exits
after it), a module site's input a scale in.

The planner grows ``fp32`` until every island's output is in FP16 range:
- a class whose out-of-range values no region can rescale puts them in ``fp32``; where
  they already are, their consumers join (the island reaches the point where values are
  back in range, or the model output, whose value then stays FP32);
- an island whose output, divided by its ``out_scale``, is still beyond FP16 (an island
  of an internal finding, a scaled activation) joins ``fp32`` so that its output can
  carry a scale or reach further.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp16lens._core import FP16_MAX, FP16_MIN_NORMAL
from fp16lens._core.algebra import Kind, is_singular
from fp16lens._core.sites import site_module
from fp16lens.patch._graph import SiteGraph
from fp16lens.patch._plan import Island
from fp16lens.report import HIST_MIN_EXP, Report

_GROUP = ":fx"  # host_of: an op of the model's own forward, run by a new child (_fxisland.py)


@dataclass
class Host:
    """One island of an FP32 span: the module (or planned child) that runs ``sites``."""

    name: str  # the qualified module name (a site name for a planned activation child)
    sites: frozenset[str]
    single: bool  # one module site: its input takes a scale too
    nodes: tuple[str, ...] = ()  # a new child of the model running these fx nodes

    def entries(self, graph: SiteGraph) -> list[str]:
        return [s for s in self.sites if any(p not in self.sites for p in graph.producers[s])]

    def exits(self, graph: SiteGraph) -> list[str]:
        """Sites whose values leave the host (or are the model's output)."""
        return [
            s
            for s in self.sites
            if not graph.consumers[s] or any(c not in self.sites for c in graph.consumers[s])
        ]


def inside(name: str, host: str) -> bool:
    return name == host or name.startswith(host + ".")


def _single(graph: SiteGraph, report: Report, site: str, acts: dict[str, str]) -> bool:
    """A site that is a module of its own (a leaf module, an ONNX node, a planned
    activation child): its island runs that site alone."""
    st = report.sites.get(site)
    return site in acts or (
        st is not None and (st.kind == "module" or not graph.owners) and graph.is_module(site)
    )


def host_of(graph: SiteGraph, report: Report, site: str, acts: dict[str, str]) -> str | None:
    """The module that runs ``site`` as an island; None where none can (an op of the model's
    own forward, a site inside an island of an earlier patch)."""
    st = report.sites.get(site)
    if st is None or site in graph.frozen:
        return None
    if _single(graph, report, site, acts):
        return site  # an activation's site: named by rename_islands (a new child, or its owner)
    if st.kind == "module" or not graph.owners:
        return None
    owner = site_module(site)
    if not owner:
        return _GROUP if site in graph.fxnodes else None
    return owner if owner in graph.owners else None


def _module(report: Report, host: str) -> str:
    """The module a host name stands for (a functional activation's: its owner)."""
    st = report.sites.get(host)
    return st.module if st is not None and st.kind != "module" else host


def realize(
    graph: SiteGraph, report: Report, fp32: set[str], acts: dict[str, str]
) -> dict[str, Host]:
    """The hosts of ``fp32``: a host inside another one's module is part of it."""
    names = {h for s in fp32 if (h := host_of(graph, report, s, acts)) is not None}
    hosts = _groups(graph, report, fp32 - set(acts)) if _GROUP in names else {}
    names.discard(_GROUP)
    owners = {h for h in names if not _single(graph, report, h, acts)}
    for h in sorted(names):
        if any(o != h and inside(_module(report, h), o) for o in owners):
            continue
        if h not in owners:
            hosts[h] = Host(h, frozenset({h}), True)
            continue
        sites = frozenset(
            s
            for s, st in report.sites.items()
            if s not in graph.frozen and inside(s if st.kind == "module" else st.module, h)
        )
        hosts[h] = Host(h, sites, False)
    return hosts


def _groups(graph: SiteGraph, report: Report, fp32: set[str]) -> dict[str, Host]:
    """The model's own functional ops in ``fp32``, by connected piece: each a new child
    (``<op>_fp32``) where its fx nodes read one tensor and hand on one."""
    left = {s for s in fp32 if s in graph.fxnodes and host_of(graph, report, s, {}) == _GROUP}
    hosts: dict[str, Host] = {}
    while left:
        piece, todo = set(), [min(left, key=lambda s: report.sites[s].order)]
        while todo:
            s = todo.pop()
            if s in piece or s not in left:
                continue
            piece.add(s)
            todo += [*graph.producers[s], *graph.consumers[s]]
        left -= piece
        order = _single_input(graph, report, piece)
        if order is None:
            continue
        nodes = tuple(graph.fxnodes[s] for s in order)
        base = f"{graph.fxnodes[order[0]]}_fp32"
        name, k = base, 1
        while name in hosts or name in graph.owners:
            k += 1
            name = f"{base}{k}"
        hosts[name] = Host(name, frozenset(piece), False, nodes)
    return hosts


def _single_input(graph: SiteGraph, report: Report, piece: set[str]) -> list[str] | None:
    """``piece`` grown back through the model's own ops that feed it (``x + 3`` and
    ``relu6`` before ``x * relu6(x + 3)``) until its fx nodes read one tensor and hand on
    one; its sites in execution order, or None where that does not happen."""
    piece = set(piece)
    for _ in range(len(graph.fxnodes) + 1):
        order = sorted(piece, key=lambda s: report.sites[s].order)
        if graph.fxgroup is not None and graph.fxgroup({graph.fxnodes[s] for s in order}):
            return order
        feeding = {
            p
            for s in piece
            for p in graph.producers[s]
            if p not in piece and p in graph.fxnodes and host_of(graph, report, p, {}) == _GROUP
        }
        if not feeding:
            return None
        piece |= {max(feeding, key=lambda s: report.sites[s].order)}  # the latest one first
    return None


def mark(graph: SiteGraph, hosts: dict[str, Host]) -> None:
    """Every host's sites block (a class ends at them). A value that stays FP32 (``held``)
    and an output of a host beyond its first carry no scale; the inputs of a host of
    several sites share its one ``in_scale`` (a class), which carries none where one of
    its sites reads a model input."""
    graph.fp32 = {s for h in hosts.values() for s in h.sites}
    for s in graph.fp32:
        graph.kinds[s] = Kind.BLOCK
        graph.carries.pop(s, None)
        if held(graph, s):
            graph.pinned.add(s)
    for h in hosts.values():
        exits = h.exits(graph)
        if h.single:
            continue
        if len([s for s in exits if not held(graph, s)]) > 1:
            graph.pinned.update(exits)
        prods = tuple(
            dict.fromkeys(
                p for s in h.entries(graph) for p in graph.producers[s] if p not in h.sites
            )
        )
        if len(prods) > 1:
            graph.tied.append(prods)
        if prods and any(not graph.producers[s] for s in h.sites):
            graph.pinned.update(prods)


def held(graph: SiteGraph, site: str) -> bool:
    """Its value stays FP32: the site runs in an island and every consumer does too (or it
    is the model output)."""
    return site in graph.fp32 and all(c in graph.fp32 for c in graph.consumers[site])


def host_islands(
    graph: SiteGraph,
    report: Report,
    hosts: dict[str, Host],
    scales: dict[str, float],
    why: dict[str, str],
) -> list[Island]:
    """One island per host: its scales from the classes around it, FP32 in and out where
    its neighbours are islands too; ``why``: site -> why it runs in FP32."""
    out = []
    fp32_out_sites = {s for h in hosts.values() for s in h.exits(graph) if held(graph, s)}
    for h in hosts.values():
        exits, entries = h.exits(graph), h.entries(graph)
        outs = [s for s in exits if not held(graph, s)]
        in_scale = 1.0
        prods = [p for s in entries for p in graph.producers[s] if p not in h.sites]
        if prods:
            in_scale = graph.scale(prods[0], scales)
        out_scale = graph.scale(outs[0], scales) if len(outs) == 1 else 1.0
        fp32_out = bool(exits) and not outs
        fp32_in = any(p in fp32_out_sites for p in prods)
        first = next(
            (why[s] for s in sorted(h.sites, key=lambda s: report.sites[s].order) if s in why), ""
        )
        reason = _reason(first, fp32_out, fp32_in)
        out.append(
            Island(
                h.name,
                in_scale,
                out_scale,
                reason,
                fp32_out=fp32_out,
                fp32_in=fp32_in,
                nodes=h.nodes,
            )
        )
    return out


def _reason(first: str, fp32_out: bool, fp32_in: bool) -> str:
    what = first or "values beyond FP16 that no region rescales run in FP32"
    if fp32_in:
        what += "; fed in FP32 by the island before it"
    if fp32_out:
        what += "; hands its output on in FP32 (to islands after it, or the model output)"
    return what


def early_exits(
    graph: SiteGraph, report: Report, islands: list[Island], acts: dict[str, str]
) -> set[str]:
    """The sites of islands other than hosts (an internal finding's, a scaled module or
    activation) whose output divided by ``out_scale`` FP16 cannot hold: they join ``fp32``,
    so that their output carries a scale or their island reaches further. ``islands`` are
    named by site where a site is the island (before ``rename_islands``)."""
    grow: set[str] = set()
    for i in islands:
        if i.module in graph.fp32:
            continue
        if i.module in report.sites:
            sites = {i.module}
        else:
            sites = {
                s
                for s, st in report.sites.items()
                if inside(s if st.kind == "module" else st.module, i.module)
            }
        if sites & graph.fp32:
            continue
        for s in sites - graph.frozen:
            leaving = not graph.consumers[s] or any(c not in sites for c in graph.consumers[s])
            if leaving and not report.sites[s].absmax / i.out_scale <= FP16_MAX:
                grow.update(sites - graph.frozen)
                break
    return {s for s in grow if host_of(graph, report, s, acts) is not None}


def widen(
    graph: SiteGraph, report: Report, root: str, fp32: set[str], acts: dict[str, str]
) -> set[str]:
    """Sites to keep FP32 for a class no region can rescale: its out-of-range members, or
    where they already run in islands, their consumers (the island reaches further)."""
    over = [
        m
        for m in graph.members(root)
        if m in report.sites and m not in graph.frozen and not report.sites[m].absmax <= FP16_MAX
    ]
    new = {m for m in over if m not in fp32}
    if not new:
        new = {c for m in over for c in graph.consumers[m] if c not in fp32}
    return {s for s in new if host_of(graph, report, s, acts) is not None}


_REACH = 16  # sites followed downstream from an island, looking for an op singular at 0


def _sensitive(graph: SiteGraph, report: Report, site: str) -> bool:
    """Small values the island at ``site`` reads matter: it, or an op its values reach
    before a conv/linear/norm mixes them with others, is singular at 0 (``log``, ``1/x``):
    a magnitude flushed to 0 before ``sqrt`` still ends in ``log(0)``."""
    seen: set[str] = set()
    todo = [site]
    while todo and len(seen) < _REACH:
        s = todo.pop(0)
        if s in seen:
            continue
        seen.add(s)
        st = report.sites.get(s)
        if st is None:
            continue
        ops = [st]
        if (
            s in graph.fp32 and st.kind != "module" and graph.owners
        ):  # an owner island: every op it runs
            ops = [
                o
                for o in report.sites.values()
                if o.kind != "module" and inside(o.module, st.module)
            ]
        if any(is_singular(o.op) for o in ops):
            return True
        if s == site or graph.kinds[s] not in (Kind.LINEAR, Kind.BN, Kind.NORM):
            todo += graph.consumers[s]
    return False


def _smallest(st) -> float:
    """The lower edge of the lowest binade holding a non-zero value of the site (0: none)."""
    i = next((i for i, c in enumerate(st.hist) if c), None)
    return 0.0 if i is None else 2.0 ** (HIST_MIN_EXP + i - 1)  # bin 0: below 2^-26


def flushed_regions(
    graph: SiteGraph,
    report: Report,
    regions,
    scales: dict[str, float],
    islands: set[str],
    acts: dict[str, str],
) -> dict[str, str]:
    """Sites of regions that feed an island reading small values where they matter (a
    ``log`` after a magnitude) and whose scale pushes some of that island's non-zero
    inputs below FP16's normal range, where they lose their digits or flush (a tensor
    divided by 2^21 before a Log). Such a region and the island it feeds join ``fp32``:
    the values between them stay FP32."""
    grow: dict[str, str] = {}
    for r in regions:
        for e in r.exits:
            if e not in islands or not _sensitive(graph, report, e):
                continue
            for m in (p for p in graph.producers[e] if p in r.sites):
                if 0 < _smallest(report.sites[m]) / graph.scale(m, scales) < FP16_MIN_NORMAL:
                    grow.update(
                        (s, e) for s in (*r.sites, e) if host_of(graph, report, s, acts) is not None
                    )
    return grow


# ---- the seam for patch's widening loop (``replan``) ------------------------------------
def span_sites(report: Report, spans) -> set[str]:
    """Every site of the given spans (``Span`` objects, indexes into ``report.spans``, or the
    start sites of spans): kept FP32 end to end, ends included."""
    out: set[str] = set()
    for sp in spans:
        if isinstance(sp, int):
            sp = report.spans[sp]
        elif isinstance(sp, str):
            found = [x for x in report.spans if x.start == sp or sp in x.sites]
            out.update(s for x in found for s in x.sites)
            continue
        out.update(sp.sites)
    return out


def merged_sites(report: Report, groups) -> set[str]:
    """For each group of islands (``Island`` objects or the names ``Plan.islands`` gives
    them, or sites), their sites and every site on a path between two of them: kept FP32,
    they become one FP32 span."""
    producers: dict[str, list[str]] = {}
    consumers: dict[str, list[str]] = {}
    for p, c in report.edges:
        producers.setdefault(c, []).append(p)
        consumers.setdefault(p, []).append(c)
    out: set[str] = set()
    for group in groups:
        sites: set[str] = set()
        for i in group:
            names = [n for n in (getattr(i, "site", ""), getattr(i, "module", i)) if n]
            for n in names:
                sites |= {
                    s
                    for s, st in report.sites.items()
                    if s == n or inside(s if st.kind == "module" else st.module, n)
                }
        out |= sites | (_closure(sites, consumers) & _closure(sites, producers))
    return out


def _closure(start: set[str], edges: dict[str, list[str]]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        for n in edges.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen
