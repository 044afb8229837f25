"""Underflow that breaks, in an ONNX graph: values FP16 flushes to 0 (a tiny product, an
eps FP16 cannot hold) that reach a node where 0 is singular: ``Log``, a ``Div``
denominator (``Sqrt`` before it included), ``Reciprocal``, ``Pow`` with a negative
exponent. (``LpNormalization`` is not one: ONNX Runtime returns 0 for a zero norm.)

Judged per batch by what real FP16 does there: the few nodes before each singular node
are replayed with FP16 storage (``_replay``), and a finding needs real non-finite values
(where FP32 is finite) at the singular node. The report names the node, the producer whose
outputs flushed (walking back through the guards: an Add/Sub of a constant, Max/Min/Clip
bounds, Sqrt, Abs, moves) and the constants FP16 makes 0."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens._core.underflow import (
    ONNX_GUARDS,
    ONNX_SINGULAR_ARG,
    ONNX_ZERO_KEEPING,
    SINGULAR_WHAT,
)
from fp16lens.report import Finding
from fp16lens.watch.onnx._replay import Replay, attr, to_fp16

# op type -> (the input slot where 0 is singular, what 0 gives there)
SINGULAR = {op: (slot, SINGULAR_WHAT[op.lower()]) for op, slot in ONNX_SINGULAR_ARG.items()}
_GUARDS = ONNX_GUARDS  # a constant that keeps values off 0
_PASS = ONNX_ZERO_KEEPING
_TRACE = 8  # nodes walked back to the producer


@dataclass
class Hit:
    """One singular node over the batches."""

    op: str
    numel: int = 0  # values reaching the singular slot
    zeroed: int = 0  # of them, 0 in FP16 and not in FP32
    nonfinite: int = 0  # outputs non-finite in FP16, finite in FP32
    batch: int = -1  # first batch with a non-finite output
    producer: str = ""  # the site whose outputs flushed
    produced: int = 0
    flushed: int = 0
    constants: list[tuple[str, float]] = field(default_factory=list)  # (guard site, value)


def _int_consts(proto) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    out = {}
    for t in proto.graph.initializer:
        if t.data_type in (6, 7):  # int32, int64
            out[t.name] = numpy_helper.to_array(t)
    for n in proto.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.t.data_type in (6, 7):
                    out[n.output[0]] = numpy_helper.to_array(a.t)
    return out


class _GraphView:
    """What the check needs of one graph, computed once."""

    def __init__(self, graph):
        self.graph = graph
        self.producer = {o: n for n in graph.proto.graph.node for o in n.output if o}
        self.site = {id(n): graph.sites[s].name for s, n in enumerate(graph.nodes)}
        self.ints = _int_consts(graph.proto)
        self.readers: dict[str, list] = {}
        for n in graph.proto.graph.node:
            for i in n.input:
                self.readers.setdefault(i, []).append(n)
        self.singular = [
            (self.site[id(n)], n) for n in graph.nodes if self._singular(n) and not self._masked(n)
        ]

    def _masked(self, node) -> bool:
        """A divide whose every reader is Where(Equal(den, 0), ..., ...): TensorFlow's
        div_no_nan, which replaces what a zero denominator gives."""
        if node.op_type != "Div":
            return False
        den = node.input[1]
        readers = self.readers.get(node.output[0], [])

        def guarded(w) -> bool:
            cond = self.producer.get(w.input[0])
            return (
                w.op_type == "Where"
                and cond is not None
                and cond.op_type == "Equal"
                and den in cond.input
                and w.input[0] != node.output[0]
            )

        return bool(readers) and all(guarded(w) for w in readers)

    def _singular(self, node) -> bool:
        spec = SINGULAR.get(node.op_type)
        if spec is None or len(node.input) <= spec[0]:
            return False
        if node.op_type != "Pow":
            return True
        e = self.graph.consts.get(node.input[1])
        e = self.ints.get(node.input[1]) if e is None else e
        return e is not None and e.size > 0 and bool((np.asarray(e) < 0).all())

    def trace(self, t: str) -> tuple[str | None, list[tuple[str, float]]]:
        """(the tensor of the producer whose values reach ``t`` through guards only, or
        None for a constant or graph input; the guards' constants FP16 makes 0)."""
        vanished: list[tuple[str, float]] = []
        for _ in range(_TRACE):
            if t in self.graph.consts:
                vanished += _flushed("", self.graph.consts[t])
                return None, vanished
            node = self.producer.get(t)
            if node is None or node.op_type == "Constant":
                return None, vanished
            if node.op_type in _PASS:
                t = node.input[0]
                continue
            live = [
                i for i in node.input if i and i not in self.graph.consts and i not in self.ints
            ]
            if node.op_type not in _GUARDS or len(live) != 1:
                return t, vanished
            where = self.site.get(id(node), node.name)
            for i in node.input:
                if i in self.graph.consts:
                    vanished += _flushed(where, self.graph.consts[i])
            if node.op_type == "Clip" and attr(node, "min") is not None:
                vanished += _flushed(where, np.array([attr(node, "min")], np.float32))
            t = live[0]
        return t, vanished


def _flushed(where: str, c: np.ndarray) -> list[tuple[str, float]]:
    c = np.asarray(c, dtype=np.float32).reshape(-1)
    gone = c[(c != 0) & (to_fp16(c) == 0)]
    return [(where, float(gone[0]))] if gone.size else []


def _fp16_output(node, x16: np.ndarray, replay: Replay) -> tuple[np.ndarray, np.ndarray]:
    """(the singular node's output from FP16 operands, where that output met a 0)."""
    op = node.op_type
    zero = x16 == 0
    with np.errstate(all="ignore"):
        if op == "Log":
            return np.log(x16), zero
        if op == "Reciprocal":
            return np.reciprocal(x16), zero
        if op == "Pow":
            exponent = replay(node.input[1], 0)
            assert exponent is not None  # a constant (_GraphView._singular)
            return np.power(x16, exponent), zero
        if op == "Div":
            num = replay(node.input[0], 0)
            assert num is not None  # a float tensor of the batch, as the denominator is
            out = np.divide(num, x16)
            return out, np.broadcast_to(zero, out.shape)
        raise AssertionError(op)  # SINGULAR lists the ops above


class UnderflowScan:
    """Collects ``Hit``s over the batches of one scan (any of its inlined graphs)."""

    def __init__(self):
        self.hits: dict[str, Hit] = {}
        self._views: dict[int, _GraphView] = {}

    def observe(self, graph, values: dict, index: int) -> None:
        view = self._views.get(id(graph))
        if view is None:
            view = self._views[id(graph)] = _GraphView(graph)
        if not view.singular:
            return
        replay = Replay(view.producer, graph.consts, view.ints, values)
        for site, node in view.singular:
            self._check(view, replay, site, node, values, index)

    def _check(self, view, replay: Replay, site: str, node, values: dict, index: int) -> None:
        operand = node.input[SINGULAR[node.op_type][0]]
        x32, x16 = replay.fp32(operand), replay(operand)
        out32 = values.get(node.output[0])
        if x32 is None or x16 is None or out32 is None:
            return
        hit = self.hits.setdefault(site, Hit(node.op_type))
        hit.numel += x32.size
        zeroed = (x16 == 0) & (x32 != 0)
        n_zero = int(np.count_nonzero(zeroed))
        if not n_zero:
            return
        out16, at_zero = _fp16_output(node, x16, replay)
        if out16.shape != np.shape(out32):
            return
        bad = int(np.count_nonzero(~np.isfinite(out16) & np.isfinite(out32) & at_zero))
        hit.zeroed += n_zero
        if not bad:
            return
        hit.nonfinite += bad
        hit.batch = index if hit.batch < 0 else hit.batch
        t, vanished = view.trace(operand)
        for c in vanished:
            if c not in hit.constants:
                hit.constants.append(c)
        if t is not None:
            p16, p32 = replay(t, 0), replay.fp32(t)
            if p16 is not None and p32 is not None:
                hit.producer = view.site.get(id(view.producer[t]), t)
                hit.produced += p32.size
                hit.flushed += int(np.count_nonzero((p16 == 0) & (p32 != 0)))

    def findings(self) -> list[Finding]:
        return [_finding(site, h) for site, h in self.hits.items() if h.nonfinite]

    def guards(self) -> dict[str, str]:
        """Guard site -> the singular site its vanished constant should have protected."""
        return {
            where: site
            for site, h in self.hits.items()
            if h.nonfinite
            for where, _ in h.constants
            if where
        }


def _share(n: int, total: int) -> str:
    return f"{n:,} of {total:,} ({100 * n / max(total, 1):.3g}%)"


def _finding(site: str, h: Hit) -> Finding:
    what = SINGULAR[h.op][1]
    parts = []
    if h.producer and h.flushed:
        parts.append(
            f"{_share(h.flushed, h.produced)} outputs of {h.producer} are below 2^-24 "
            "and become 0 in FP16"
        )
    for where, c in h.constants:
        at = f" at {where}" if where else ""
        parts.append(f"the constant {c:.3g}{at} is 0 in FP16 too")
    why = "; ".join(parts) or "the values reaching it flush to 0 in FP16"
    consts = ", ".join(f"{c:.3g}" for _, c in h.constants)
    tensor = h.producer if h.producer and h.flushed else (f"eps {consts}" if consts else "")
    start = h.producer or site
    return Finding(
        site=site,
        mechanism=Mechanism.UNDERFLOW,
        kind=FindingKind.FLUSH_SINGULAR,
        peak=h.zeroed / max(h.numel, 1),
        tensor=tensor,
        count=h.nonfinite,
        batch=h.batch,
        detail=(
            f"{h.op} {site}: {_share(h.zeroed, h.numel)} values reaching it are 0 in FP16 "
            f"({why}), so real FP16 gives {h.nonfinite:,} non-finite values there ({what})"
        ),
        fix=(
            f"keep {start} through {site} in FP32 (fp16lens.patch makes them one FP32 island), "
            "or use a guard FP16 holds (an eps of at least 6.1e-05)"
        ),
    )
