"""Why MTCNN's INT8 stands where it does: the measurements behind docs/int8.md's MTCNN
reading that are not bench rows, in one run (about a minute on 2 cores).

    python scripts/int8_mtcnn_probe.py [--models onet,rnet,pnet]

On the bench's items (``tests/int8_zoo.py``, 8 calibration and 24 evaluation items), per
model:
- FP16 as a reference: ``copy.deepcopy(model).half()(x.half())`` on the CPU, without
  fp16lens, scored by the same task metric against FP32;
- fp16lens's ranges ("chosen": the default search) and max ranges (ModelOpt max's
  calibration), each with nothing, the box head, or every Gemm kept out of INT8 (the
  Gemms are what ModelOpt leaves in FP32 on ONet), scored on the evaluation and on the
  calibration items;
- each unit alone kept out of INT8 (the default ranges), on the evaluation items;
- ONet: the box error per evaluation face with the box head out, and what the fallback
  keeps for box cosine 0.9998 on the calibration items within 10% of the FLOPs;
- PNet: the evaluation cells near its 0.6 threshold.

``--draws 17,27,...``: ONet's calibration items drawn again with those seeds (the same
kind of items, other faces and windows; the evaluation items unchanged), and for each
draw the bench's rows that depend on it: fp16lens with the strictest target within 10%,
and ModelOpt max and entropy when ModelOpt imports. Which method is ahead on the box
offsets is then read over draws, not from one.

Nothing here chooses anything for the bench: it reads what the bench's choices do.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import int8_zoo  # noqa: E402

STAGE = {"onet": "ONet", "rnet": "RNet", "pnet": "PNet"}
KEY = {"onet": "box cosine", "rnet": "box cosine", "pnet": "face cell IoU"}
HEAD = {"onet": "node_linear_2", "rnet": "node_linear_2", "pnet": "node_conv2d_4"}


def _fp16(name: str, case) -> dict:
    import torch

    model = int8_zoo.z._mtcnn(STAGE[name])
    half = copy.deepcopy(model).half()
    refs, outs = [], []
    with torch.no_grad():
        for feed in case.eval:
            x = torch.from_numpy(next(iter(feed.values())))
            refs.append([t.numpy() for t in model(x)])
            outs.append([t.float().numpy() for t in half(x.half())])
    return case.metric(refs, outs)


def _short(m: dict) -> str:
    keep = ("box cosine", "box px", "landmark px", "face cell IoU", "face cell IoU worst", "cosine")
    return ", ".join(f"{k} {m[k]:.5f}" for k in keep if k in m)


def probe(name: str) -> None:
    import onnx

    from fp16lens.export import ExportError, Int8Target
    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import name_nodes
    from fp16lens.export._int8_search import searcher, write_qdq

    case = int8_zoo.MODELS[name](8, 24)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    cal_refs = int8_zoo.run_outputs(case.path, case.cal)
    proto = prepared(onnx.load(case.path))
    name_nodes(proto.graph)
    print(f"== {case.name}")
    print(f"FP16 (torch .half() on the CPU): {_short(_fp16(name, case))}")
    if name == "pnet":
        p = np.concatenate([r[1][0, 1].ravel() for r in refs])
        near = [int((abs(p - int8_zoo.PNET_THRESH) < d).sum()) for d in (0.05, 0.01)]
        print(f"evaluation cells: {p.size}, face cells {int((p > int8_zoo.PNET_THRESH).sum())}, ")
        print(f"  within 0.05 of the threshold {near[0]}, within 0.01 {near[1]}")

    def scored(plan, out: set[str]):
        plan = dataclasses.replace(plan, on=[u.node not in out for u in plan.units])
        q = write_qdq(proto, plan)
        ev = case.metric(refs, int8_zoo.run_outputs(q, case.eval))
        cal = case.metric(cal_refs, int8_zoo.run_outputs(q, case.cal))
        return q, ev, cal

    searchers = {
        "chosen": searcher(proto, list(case.cal), search_batches=2),
        "max": searcher(
            proto,
            list(case.cal),
            search_batches=2,
            choose=False,
            correct_bias=False,
            equalize=False,
        ),
    }
    for label, s in searchers.items():
        plan = s.plan
        total = sum(u.flops for u in plan.units)
        print(f"{label} ranges: {plan.method_counts()}")
        gemms = {u.node for u in plan.units if u.op == "Gemm"}
        for what, out in (("none", set()), ("box head", {HEAD[name]}), ("Gemms", gemms)):
            if not out and what != "none":
                continue
            q, ev, cal = scored(plan, out)
            share = 1 - sum(u.flops for u in plan.units if u.node in out) / total
            print(f"  {what} out ({share:.1%} INT8): evaluation {_short(ev)}")
            print(f"  {' ' * len(what)}                  calibration {_short(cal)}")
    plan = searchers["chosen"].plan
    total = sum(u.flops for u in plan.units)
    print("each unit alone out of INT8 (chosen ranges), evaluation:")
    for u in plan.units:
        ev = scored(plan, {u.node})[1]
        print(
            f"  {u.node} ({u.op}, {u.flops / total:.1%} of the FLOPs): {KEY[name]} {ev[KEY[name]]:.4f}"
        )
    if name == "onet":
        q = scored(plan, {HEAD[name]})[0]
        outs = int8_zoo.run_outputs(q, case.eval)
        print("box head out: mean |box offset error| in pixels per evaluation face")
        for i, (r, o) in enumerate(zip(refs, outs)):
            if float(r[2][0, 1]) > int8_zoo.ONET_THRESH:
                worst = float(np.abs(r[0]).max())
                err = float(np.abs(r[0] - o[0]).mean() * int8_zoo.ONET_SIZE)
                print(f"  item {i}: largest offset {worst:.3f} of the box, error {err:.3f} px")
        target = Int8Target(0.9998, lambda r, o: case.metric(r, o)["box cosine"], "box cosine")
        try:
            kept = searchers["chosen"].fallback(target, max_fallback=0.1).kept
            print(f"box cosine 0.9998 on calibration within 10%: kept {[k.node for k in kept]}")
        except ExportError as exc:
            print(f"box cosine 0.9998 on calibration within 10%: {str(exc)[:260]}")


def _quiet(fn, *args):
    """``fn(*args)`` with its progress bars (ModelOpt's, on stderr) left out."""
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()):
        return fn(*args)


def draws(seeds: list[int]) -> None:
    """ONet's bench rows that depend on the calibration items, per calibration draw."""
    import bench_int8

    keys = ("box cosine", "box px", "landmark px", "cosine")
    methods = {"fp16lens strictest within 10%": lambda c: bench_int8._strictest(c, "onet")}
    if bench_int8.modelopt_status() is None:
        for how in ("max", "entropy"):
            methods[f"ModelOpt {how}"] = lambda c, how=how: _quiet(bench_int8._modelopt, c, how)
    print("== MTCNN ONet, calibration draws (evaluation items unchanged)")
    table: dict[str, list] = {m: [] for m in methods}
    for seed in seeds:
        case = int8_zoo.onet(8, 24, cal_seed=seed)
        refs = int8_zoo.run_outputs(case.path, case.eval)
        bench_int8._SEARCHED.clear()  # a search belongs to its calibration items
        for label, make in methods.items():
            proto = make(case)[0]
            m = case.metric(refs, int8_zoo.run_outputs(proto, case.eval))
            share = int8_zoo.flop_share(proto, case.eval[0])
            table[label].append([m[k] for k in keys] + [share])
            print(f"  seed {seed} {label}: {_short(m)}, INT8 FLOPs {share:.1%}", flush=True)
    for label, rows in table.items():
        mean = np.mean(rows, axis=0)
        shown = ", ".join(f"{k} {v:.5f}" for k, v in zip(keys, mean))
        print(f"  mean over {len(rows)} draws, {label}: {shown}, INT8 FLOPs {mean[-1]:.1%}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="onet,rnet,pnet")
    p.add_argument("--draws", help="ONet calibration seeds, comma-separated (the bench's is 7)")
    args = p.parse_args(argv)
    if args.draws:
        draws([int(s) for s in args.draws.split(",")])
        return 0
    for name in args.models.split(","):
        probe(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
