"""Peak memory of the INT8 weight-rounding fit as the search runs it
(``export/_int8_round.folds``), side by side with what holding every layer's moments at once
would take.

    python scripts/mem_int8_round.py [--model craft] [--calibration 8]

The fit sums, per conv/Gemm/MatMul, three float64 products of its input patches
(``X Xᵀ``, ``X̂ Xᵀ``, ``X̂ X̂ᵀ``: K x K per group) on each quarter of the calibration
batches (``folds``: the codes of each half and of all, from one pass). It makes them in
passes of at most ``BUDGET`` bytes and solves each pass before the next (``moments`` is a
generator). Prints, in one run: the bytes every layer's moments come to,
the pass budget, and the resident memory the fit added at its peak (sampled every 50 ms),
with their ratio. Items: ``tests/int8_zoo.py``; ranges: each tensor's calibration max.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="craft", help="an int8_zoo model (default craft)")
    parser.add_argument("--calibration", type=int, default=8, help="calibration items")
    args = parser.parse_args(argv)

    import int8_zoo
    import onnx
    import psutil

    from fp16lens.export import _int8_round
    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import find_units, name_nodes
    from fp16lens.export._int8_search import QMAX, collect

    case = int8_zoo.MODELS[args.model](args.calibration, 1)
    proto = prepared(onnx.load(case.path))
    name_nodes(proto.graph)
    units = find_units(proto.graph, set())
    hists, _ = collect(proto, units, case.cal)
    scales = {t: hists[t].candidates()["max"] / QMAX for t in hists}

    inits = {i.name: tuple(i.dims) for i in proto.graph.initializer}
    nodes = {n.name: n for n in proto.graph.node}
    sizes = [
        _int8_round.moment_bytes(u, inits[u.weight], nodes[u.node], 4)
        for u in _int8_round.fittable(proto, units, scales)
    ]
    every = sum(b for b in sizes if b is not None)

    proc = psutil.Process()
    start = proc.memory_info().rss
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.05)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    codes = _int8_round.folds(proto, units, list(case.cal), scales)[-1]
    seconds = time.perf_counter() - t0
    done.set()
    watcher.join()
    added = peak[0] - start
    gib = 2**30
    print(f"{case.name}: {len(codes)} weights fitted in {seconds:.0f} s")
    print(f"  every layer's moments at once: {every / gib:.2f} GiB")
    print(f"  pass budget (BUDGET):          {_int8_round.BUDGET / gib:.2f} GiB")
    print(f"  memory the fit added at peak:  {added / gib:.2f} GiB (from {start / gib:.2f})")
    print(f"  ratio, added / every layer's:  {added / every:.2f}" if every else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
