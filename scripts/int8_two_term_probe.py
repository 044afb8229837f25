"""A conv computed as two INT8 convs and summed: what docs/int8.md says of it ("A conv
computed as two INT8 convs"), measured in one run. Nothing here is used by fp16lens.

    python scripts/int8_two_term_probe.py [--models detector,onet,v5-recognizer] [--top 8]

Per model, the bench's search (``tests/int8_zoo.py``: 8 calibration items, 24 evaluation
items, 2 probe batches) all in INT8, its Q/DQ graph as written, then edited by hand:
- per unit, for the ``--top`` costliest weighted units one at a time: the weight in FP32
  (the bound of what a finer weight can give), and the weight as two INT8 terms,
  ``W ~ DQ(q1) + DQ(q2)``: ``q1`` the plan's codes, ``q2`` their rounding residual at its
  own per-channel scale, the conv run twice (both in INT8) and summed;
- cumulative (``--cumulative``), over the ``--top`` costliest convs: each one's input as
  two INT8 terms, ``x ~ DQ(Q(x, s)) + DQ(Q(x - DQ(Q(x, s)), s / 254))``, against the same
  convs kept out of INT8.
Each line gives the task metric of the evaluation items against FP32 (``case.metric``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import int8_zoo  # noqa: E402


def _insert_after(graph, node, new: list) -> None:
    nodes = list(graph.node)
    k = nodes.index(node)
    nodes[k + 1 : k + 1] = new
    del graph.node[:]
    graph.node.extend(nodes)


def _twice(graph, node, first_input: str, weight: str, tag: str) -> list:
    """``node`` again on (``first_input``, ``weight``), no bias, summed into its output."""
    from onnx import helper

    out = node.output[0]
    node.output[0] = f"{out}_{tag}_main"
    again = helper.make_node(
        node.op_type, [first_input, weight], [f"{out}_{tag}"], name=f"{node.name}_{tag}"
    )
    again.attribute.extend(node.attribute)
    add = helper.make_node(
        "Add", [f"{out}_{tag}_main", f"{out}_{tag}"], [out], name=f"{node.name}_{tag}_sum"
    )
    return [again, add]


def weight_variant(qdq, source, plan, unit, how: str):
    """The written graph with ``unit``'s weight in FP32 (``exact``) or as two INT8 terms."""
    import onnx
    from onnx import helper, numpy_helper

    from fp16lens.export._int8_search import quantize_weight

    m = onnx.ModelProto()
    m.CopyFrom(qdq)
    g, w = m.graph, unit.weight
    init = next(i for i in source.graph.initializer if i.name == w)
    weight = numpy_helper.to_array(init).astype(np.float32)
    node = next(n for n in g.node if n.name == unit.node)
    if how == "exact":
        g.initializer.append(numpy_helper.from_array(weight, f"{w}_exact"))
        node.input[1] = f"{w}_exact"
        return m
    q1, s1 = quantize_weight(weight, unit.axis, plan.rounded.get(w))
    shape = [-1 if i == unit.axis else 1 for i in range(weight.ndim)]
    q2, s2 = quantize_weight(weight - q1.astype(np.float32) * s1.reshape(shape), unit.axis)
    names = (f"{w}_lo_quantized", f"{w}_lo_scale", f"{w}_lo_zero_point")
    g.initializer.extend(
        [
            numpy_helper.from_array(q2, names[0]),
            numpy_helper.from_array(s2, names[1]),
            numpy_helper.from_array(np.zeros(s2.shape, np.int8), names[2]),
        ]
    )
    dq = helper.make_node(
        "DequantizeLinear", list(names), [f"{w}_lo"], name=f"{w}_lo_DQ", axis=unit.axis
    )
    _insert_after(g, node, [dq, *_twice(g, node, node.input[0], f"{w}_lo", "wlo")])
    return m


def input_twice(model, plan, unit) -> None:
    """``unit``'s input as two INT8 terms, in place."""
    from onnx import helper, numpy_helper

    g = model.graph
    node = next(n for n in g.node if n.name == unit.node)
    t, quantized = unit.acts[0], node.input[0]
    tag = f"{node.name}_xlo"
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array(plan.scales[t] / 254.0, np.float32), f"{tag}_s"),
            numpy_helper.from_array(np.array(0, np.int8), f"{tag}_zp"),
        ]
    )
    q = [f"{tag}_s", f"{tag}_zp"]
    new = [
        helper.make_node("Sub", [t, quantized], [f"{tag}_r"], name=f"{tag}_sub"),
        helper.make_node("QuantizeLinear", [f"{tag}_r", *q], [f"{tag}_q"], name=f"{tag}_Q"),
        helper.make_node("DequantizeLinear", [f"{tag}_q", *q], [f"{tag}_dq"], name=f"{tag}_DQ"),
    ]
    _insert_after(g, node, new + _twice(g, node, f"{tag}_dq", node.input[1], "xlo"))


def _shown(metric: dict, keys: list[str]) -> str:
    return ", ".join(f"{k} {metric[k]:.4f}" for k in keys)


def probe(name: str, top: int, cumulative: bool) -> None:
    import onnx

    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import name_nodes
    from fp16lens.export._int8_search import searcher, write_qdq

    case = int8_zoo.MODELS[name](8, 24)
    proto = prepared(onnx.load(case.path))
    name_nodes(proto.graph)
    plan = searcher(proto, list(case.cal), search_batches=2).plan
    source = plan.graph if plan.graph is not None else proto
    refs = int8_zoo.run_outputs(case.path, case.eval)
    qdq = write_qdq(proto, plan)
    base = case.metric(refs, int8_zoo.run_outputs(qdq, case.eval))
    keys = [k for k, v in base.items() if isinstance(v, float)][:3]
    print(f"== {case.name}, all in INT8: {_shown(base, keys)}", flush=True)
    order = sorted(range(len(plan.units)), key=lambda i: -plan.costs[i])
    weighted = [plan.units[i] for i in order if plan.units[i].weight is not None]
    if not cumulative:
        for u in weighted[:top]:
            got = {
                how: case.metric(
                    refs, int8_zoo.run_outputs(weight_variant(qdq, source, plan, u, how), case.eval)
                )
                for how in ("exact", "two-term")
            }
            print(
                f"{u.node} ({u.op}): FP32 weight {_shown(got['exact'], keys)}; "
                f"two-term weight {_shown(got['two-term'], keys)}",
                flush=True,
            )
        return
    model, out = onnx.ModelProto(), set()
    model.CopyFrom(qdq)
    for k, u in enumerate([u for u in weighted if u.op == "Conv"][:top]):
        input_twice(model, plan, u)
        out.add(u.node)
        twice = case.metric(refs, int8_zoo.run_outputs(model, case.eval))
        floated = dataclasses.replace(plan, on=[x.node not in out for x in plan.units])
        kept_out = case.metric(refs, int8_zoo.run_outputs(write_qdq(proto, floated), case.eval))
        print(
            f"{k + 1} costliest (to {u.node}): inputs as two INT8 terms {_shown(twice, keys)}; "
            f"kept out of INT8 {_shown(kept_out, keys)}",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="detector,onet,v5-recognizer")
    p.add_argument("--top", type=int, default=8, help="costliest units measured (default 8)")
    p.add_argument("--cumulative", action="store_true", help="inputs as two terms, cumulative")
    args = p.parse_args()
    for name in args.models.split(","):
        if name not in int8_zoo.MODELS:
            print(f"unknown model {name!r}: one of {', '.join(int8_zoo.MODELS)}", file=sys.stderr)
            raise SystemExit(2)
    for name in args.models.split(","):
        probe(name, args.top, args.cumulative)


if __name__ == "__main__":
    main()
