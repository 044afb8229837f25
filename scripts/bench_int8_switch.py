"""The INT8 search's switch graph (``export/_int8_search.switch_graph``), timed side by side
with the form it replaced, in one run.

    python scripts/bench_int8_switch.py [--models detector,classifier,onet,pnet] [--runs 5]

The search runs one graph for every trial: each unit's Q/DQ is switched on or off by an
input. It is switched by an If per unit input and per weight (a unit that is off computes
no Q/DQ, and the weight is handed over whole). The form before was a Where per input and
per weight, selecting element by element between the Q/DQ value, computed for every
tensor in every run, and the float one. This script rewrites each If back into that Where
and times both sessions on the same calibration items (ONNX Runtime, graph optimizations
off, as the search runs them), interleaved, the best of ``--runs``: with every unit off
(the reference runs), one unit on (a unit's cost alone, most of the search's runs) and
all on. It also checks that both give the same outputs to the bit. Items:
``tests/int8_zoo.py``.

``--search`` times the whole default search (``_int8_search.searcher`` on the 8
calibration items: ranges, corrections, each unit alone) instead, once with each form of
the switch (the Where form by rewriting every switch graph the search builds), and checks
that both make the same plan.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]


def as_where(model):
    """``model`` (a switch graph) with each If switch written as the Where it replaced: the
    on branch's nodes computed outside, then ``Where(cond, on value, off value)``."""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for node in out.graph.node:
        if node.op_type != "If":
            nodes.append(node)
            continue
        branches = {a.name: a.g for a in node.attribute}
        then, other = branches["then_branch"], branches["else_branch"]
        nodes.extend(then.node)
        off = other.node[0].input[0]  # the else branch: Identity of the float value
        nodes.append(
            helper.make_node("Where", [node.input[0], then.output[0].name, off], [node.output[0]])
        )
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def main(argv=None) -> int:
    import int8_zoo

    got = int8_zoo.bench_args(argv, __doc__, "detector,classifier,onet,pnet", 5)
    if got is None:
        return 2
    args, names = got

    import numpy as np
    import onnx

    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import find_units, name_nodes
    from fp16lens.export._int8_search import ON, SCALE, session, switch_graph

    if args.search:
        return _searches(names)
    print("| model | units | runs | Where (s) | If (s) | Where / If | the same to the bit |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        case = int8_zoo.MODELS[name](2, 2)
        proto = prepared(onnx.load(case.path))
        name_nodes(proto.graph)
        units = find_units(proto.graph, set(), True)
        tensors = list(dict.fromkeys(t for u in units for t in u.acts))
        graph = switch_graph(proto, units, tensors)
        sessions = {"if": session(graph), "where": session(as_where(graph))}
        outputs = [o.name for o in proto.graph.output]
        feeds = list(case.cal)[:2]
        scales = np.full(len(tensors), 0.05, np.float32)
        n = len(units)
        one = np.zeros(n, np.float32)
        one[n // 2] = 1
        for label, on in (
            ("all off", np.zeros(n, np.float32)),
            ("one on", one),
            ("all on", one * 0 + 1),
        ):
            extra = {ON: on, SCALE: scales}
            got = {k: [s.run(outputs, {**f, **extra}) for f in feeds] for k, s in sessions.items()}
            same = all(
                np.array_equal(a, b) for x, y in zip(got["if"], got["where"]) for a, b in zip(x, y)
            )
            best = {k: float("inf") for k in sessions}
            for _ in range(args.runs):
                for k, s in sessions.items():
                    t0 = time.perf_counter()
                    for f in feeds:
                        s.run(outputs, {**f, **extra})
                    best[k] = min(best[k], time.perf_counter() - t0)
            print(
                f"| {case.name} | {n} | {label} | {best['where']:.4f} | {best['if']:.4f} | "
                f"{best['where'] / best['if']:.2f} | {'yes' if same else 'NO'} |",
                flush=True,
            )
    return 0


def _searches(names: list[str]) -> int:
    """``--search``: the default search of each model with each form of the switch."""
    import int8_zoo
    import onnx

    from fp16lens.export import _int8_search
    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import name_nodes

    made = _int8_search.switch_graph

    def where_form(*a, **k):
        return as_where(made(*a, **k))

    print("| model | search, Where (s) | search, If (s) | Where / If | the same plan |")
    print("|---|---|---|---|---|")
    for name in names:
        case = int8_zoo.MODELS[name]()
        seconds, plans = {}, {}
        for form, graph in (("where", where_form), ("if", made)):
            proto = prepared(onnx.load(case.path))
            name_nodes(proto.graph)
            _int8_search.switch_graph = graph
            try:
                t0 = time.perf_counter()
                plan = _int8_search.searcher(proto, list(case.cal)).plan
                seconds[form] = time.perf_counter() - t0
            finally:
                _int8_search.switch_graph = made
            plans[form] = int8_zoo.plan_key(plan)
        print(
            f"| {case.name} | {seconds['where']:.1f} | {seconds['if']:.1f} | "
            f"{seconds['where'] / seconds['if']:.2f} | "
            f"{'yes' if plans['where'] == plans['if'] else 'NO'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
