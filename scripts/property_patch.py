"""The big run of the patch property on random dataflow graphs.

Runs tests/patch/test_patch_graph_property.py's property (FP32-equivalent to 1e-6; real
FP16 finite where the plan resolves every span) on many random graphs and prints what
the examples covered. Exit status 1 (with hypothesis's shrunk example) on a failure.

    python scripts/property_patch.py --examples 500
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..", "tests", "patch")]

import test_patch_graph_property as prop  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (reproduce a run)")
    args = parser.parse_args(argv)
    seen: collections.Counter = collections.Counter()

    @settings(
        max_examples=args.examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(**{**prop.GRAPHS, "boost": st.sampled_from([1.0, 3.0e3, 1.0e5, 3.0e6])})
    def run(**example):
        out = prop.check_graph(**example)
        seen["examples"] += 1
        seen["with spans"] += bool(out["spans"])
        seen["with islands"] += bool(out["islands"])
        seen["with multiplies"] += bool(out["multiplies"])
        seen["with unresolved"] += bool(out["unresolved"])
        seen["fp16 finite checked"] += out["fp16_checked"]

    if args.seed is not None:
        from hypothesis import seed

        run = seed(args.seed)(run)
    start = time.perf_counter()
    try:
        run()
    finally:
        took = time.perf_counter() - start
        print(
            f"{seen['examples']} examples in {took:.0f} s: "
            + ", ".join(f"{k} {v}" for k, v in seen.items() if k != "examples")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
