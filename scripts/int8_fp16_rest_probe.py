"""The INT8 file with its float parts in FP16: what docs/int8.md says of it ("The float
parts in FP16"), measured in one run. Nothing here is used by fp16lens.

    python scripts/int8_fp16_rest_probe.py [--models detector,pnet,onet,classifier]

The Q/DQ file ``export(..., precision="int8")`` writes keeps every tensor that is not INT8
in FP32: a strongly typed TensorRT build (10.12 and later) computes them so. A weakly
typed build (``build_engine`` on an older TensorRT sets the FP16 flag beside INT8) may
compute any of them in FP16, and ModelOpt's default (``high_precision_dtype="fp16"``)
writes them so. Per model, the bench's search (``tests/int8_zoo.py``: 8 calibration items,
24 evaluation items) all in INT8, its Q/DQ graph as written, then computed on the CPU
with FP16 storage (``fp16lens.patch.onnx._fp16.fp16_storage``: every float tensor a node
writes rounded to FP16, as a GPU stores it):
- ``activations FP16``: the initializers left FP32, as TensorRT's ONNX parser folds a
  BatchNormalization into one FP32 scale and shift before any precision is chosen;
- ``activations and initializers FP16``: the initializers rounded too, as a converter
  that casts the ONNX file's float initializers writes it;
- ``FP16 alone``: the FP32 graph with FP16 storage, no INT8.
Each line gives the task metric of the evaluation items against FP32 (``case.metric``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import int8_zoo  # noqa: E402

MODELS = ("detector", "pnet", "onet", "classifier")


def _stored(proto, initializers: bool):
    """``proto`` with FP16 storage; with ``initializers`` False its initializers as they were."""
    import onnx

    from fp16lens.patch.onnx._fp16 import fp16_storage

    made = fp16_storage(proto)
    made = made[0] if isinstance(made, tuple) else made
    if initializers:
        return made
    kept = onnx.ModelProto()
    kept.CopyFrom(made)
    original = {i.name: i for i in proto.graph.initializer}
    for init in kept.graph.initializer:
        if init.name in original:
            init.CopyFrom(original[init.name])
    return kept


def _shown(metrics: dict) -> str:
    return ", ".join(
        f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in int8_zoo.MODELS]
    if unknown:
        print(
            f"unknown model(s) {', '.join(unknown)}; pick from {', '.join(int8_zoo.MODELS)}",
            file=sys.stderr,
        )
        return 2
    import onnx

    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import name_nodes
    from fp16lens.export._int8_search import searcher, write_qdq

    print("| model | float parts | task metric (24 evaluation items) |")
    print("|---|---|---|")
    for name in names:
        started = time.perf_counter()
        try:
            case = int8_zoo.MODELS[name](8, 24)
        except int8_zoo.Missing as exc:
            print(f"| {name} | not run: {exc} | |")
            continue
        proto = prepared(onnx.load(case.path))
        name_nodes(proto.graph)
        qdq = write_qdq(proto, searcher(proto, list(case.cal), search_batches=2).plan)
        refs = int8_zoo.run_outputs(case.path, case.eval)
        rows = (
            ("INT8, the rest FP32 (as written)", qdq),
            ("INT8, activations FP16", _stored(qdq, False)),
            ("INT8, activations and initializers FP16", _stored(qdq, True)),
            ("FP16 alone (no INT8)", _stored(prepared(onnx.load(case.path)), True)),
        )
        for label, graph in rows:
            got = case.metric(refs, int8_zoo.run_outputs(graph, case.eval))
            print(f"| {name} | {label} | {_shown(got)} |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - started:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
