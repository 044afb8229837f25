"""The fix of an underflow finding (mechanism ``underflow``, kind ``flush-singular``) in an
ONNX graph: the nodes from the producer whose outputs flush through the singular node
(``Square``, the ``Add`` of its eps, ``Log``; a ``Sqrt`` before a ``Div``, and the
``Div``) become one FP32 island. In FP32 the producer's tiny values and the eps survive,
so the singular node sees what the FP32 graph sees; what it hands back (a log, a ratio)
is in FP16's normal range. The islands are named in ``metadata_props`` like every other
island, so ``fp16lens.export(..., precision="fp16")`` keeps their Casts."""

from __future__ import annotations

from fp16lens._core.sites import Mechanism
from fp16lens._core.underflow import ONNX_GUARDS, ONNX_SINGULAR_ARG, ONNX_ZERO_KEEPING
from fp16lens.patch._plan import Island
from fp16lens.patch.onnx._graph import FLOAT_TYPES, OnnxModel

# the singular input of each singular op, the guards and the zero-keeping nodes: the
# tables watch/onnx/_underflow.py judges by (one home, _core/underflow.py)
_SLOT = ONNX_SINGULAR_ARG
_GUARDS = ONNX_GUARDS
_PASS = ONNX_ZERO_KEEPING
_STEPS = 8  # nodes walked back from the singular node to the producer, and behind it


def _members(m: OnnxModel, site: str, sites: dict | None = None) -> list[str]:
    """Sites from where the flushes start to the singular node ``site``, in graph order:
    the chain of the singular input back through guards (an Add/Sub of a constant,
    Max/Min/Clip bounds) and value-keeping nodes (Sqrt, Abs, moves) to the first other
    node, the producer; then on back to the nodes that create flushes (``_behind``, by the
    scan's ``sites``), if any. basic-pitch's
    ``x² -> sum -> sqrt -> x²`` before its log: the first square already flushes 16% of the
    values on speech and 67% on quiet speech, which the magnitude then carries as zeros,
    so an island from the last square on leaves real FP16 at cosine 0.966 (quiet) where
    one from the first square gives 0.99998."""
    names = {id(n): s for s, n in m.nodes.items()}
    node = m.nodes[site]
    chain = [site]
    t = node.input[_SLOT.get(node.op_type, 0)]
    for _ in range(_STEPS):
        up = m.producer.get(t)
        if up is None or id(up) not in names or up.op_type == "Constant":
            break
        chain.append(names[id(up)])
        live = [i for i in up.input if i and i not in m.consts]
        if up.op_type in _PASS:
            t = up.input[0]
        elif up.op_type in _GUARDS and len(live) == 1:
            t = live[0]
        else:
            break
    if sites:
        chain += _behind(m, chain[-1], sites, names)
    order = {s: k for k, s in enumerate(m.nodes)}
    return sorted(dict.fromkeys(chain), key=order.__getitem__)


_FLUSH_MIN = 0.01  # a node creates flushes: at least 1% of its non-zero outputs below 2^-24,
_FLUSH_GAIN = 2.0  # and at least twice its input's share


def _live(m: OnnxModel, node) -> list[str]:
    """The float tensors ``node`` reads that are not constants (an axes input is not one)."""
    return list(
        dict.fromkeys(
            i
            for i in node.input
            if i and i not in m.consts and i not in m.inits and m.elem.get(i) in FLOAT_TYPES
        )
    )


def _behind(m: OnnxModel, head: str, sites: dict, names: dict) -> list[str]:
    """The nodes behind ``head`` that the island must hold: every node that creates
    flushes (``_creates``) within ``_STEPS`` nodes behind it, with the nodes between it
    and ``head``. The walk passes a node of one input that is not a constant (``x * x``
    reads one), and a node of several only where the flushes run through it (at least
    ``_FLUSH_MIN`` of its outputs flushed): DNSMOS's ``sqrt(re² + im²)`` before its log
    flushes in both squares, which the Add joins (an island from the Sqrt on leaves real
    FP16 at cosine 0.963; from the squares, within 0.002 MOS of FP32), while basic-pitch's
    CQT Concat, which flushes nothing itself, stops the walk."""
    parent: dict[str, str] = {}
    frontier, taken = [head], []
    for _ in range(_STEPS):
        ahead = []
        for site in frontier:
            node = m.nodes[site]
            live = _live(m, node)
            stats = sites.get(site)
            if len(live) != 1 and (stats is None or stats.underflow_share < _FLUSH_MIN):
                continue
            for t in live:
                up = m.producer.get(t)
                if up is None or id(up) not in names or up.op_type == "Constant":
                    continue
                name = names[id(up)]
                if name in parent or name == head:
                    continue
                parent[name] = site
                ahead.append(name)
                if _creates(m, name, sites, names):
                    taken.append(name)
        frontier = ahead
    held: list[str] = []
    for site in taken:
        while site != head and site not in held:
            held.append(site)
            site = parent[site]
    return held


def _creates(m: OnnxModel, site: str, sites: dict, names: dict) -> bool:
    """Whether ``site`` pushes values below 2^-24 that its input held above it: its
    flushed share (the scan's, over non-zero FP32 outputs) is at least ``_FLUSH_MIN`` and
    ``_FLUSH_GAIN`` times its input's (0 for a graph input; a node of several inputs, or
    one whose input the scan did not see, is not judged)."""
    stats = sites.get(site)
    if stats is None or stats.underflow_share < _FLUSH_MIN:
        return False
    live = _live(m, m.nodes[site])
    if len(live) != 1:  # several inputs: which one flushes is not known here
        return False
    up = m.producer.get(live[0])
    before = sites.get(names.get(id(up), "")) if up is not None else None
    if up is not None and before is None:
        return False
    return stats.underflow_share >= _FLUSH_GAIN * (before.underflow_share if before else 0.0)


def underflow_islands(m: OnnxModel, report, taken: set[str]) -> list[Island]:
    """One FP32 island per node of each underflow finding's chain (``taken``: sites
    already islands)."""
    out = []
    for f in report.findings:
        if f.mechanism != Mechanism.UNDERFLOW or f.site not in m.nodes:
            continue
        chain = _members(m, f.site, report.sites)
        why = (
            f"underflow: the {len(chain)} nodes from {chain[0]} to {m.nodes[f.site].op_type} "
            f"{f.site} run in FP32, so the values FP16 flushes to 0 and the eps it loses "
            "never reach it"
        )
        for s in chain:
            if s not in taken:
                taken.add(s)
                out.append(Island(module=s, in_scale=1.0, out_scale=1.0, reason=why))
                why = f"underflow: with {chain[0]}, in the FP32 chain to {f.site}"
    return out
