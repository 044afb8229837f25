"""Wall time of each CPU verify backend relative to a plain FP32 forward, on the seed case.

    python scripts/bench_verify.py [--repeat 3]

Measured in one run on this machine: each backend's ``run`` of one batch (the candidate
forward that verify() does per batch), its ``locate`` (the per-site comparison done once,
for the first failing batch) and a whole ``verify()`` call, each as the best of
``--repeat`` timings divided by the best FP32 forward. ONNX export time is reported apart.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fp16lens.export import export
from fp16lens.verify import verify
from fp16lens.verify._onnx import OnnxRunner
from fp16lens.verify._torch import TorchEmulated, TorchFp16

from models import seed_case


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    model, inputs = seed_case()
    with torch.no_grad():
        base = best(lambda: model(*inputs), args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seed_fp16.onnx"
        export_s = best(lambda: export(model, inputs, path, precision="fp16"), 1)
        runners = {
            "torch-fp16": (TorchFp16(model), model),
            "torch-emulated": (TorchEmulated(model), model),
            "torch-emulated (fusions)": (TorchEmulated(model, fusions=True), model),
            "onnx-fp16": (OnnxRunner(path, model), path),
        }
        table = Table(
            title=f"verify backends on seed_case (FP32 forward = {base * 1e3:.1f} ms, x1.0)"
        )
        for col in ("backend", "run / FP32", "locate / FP32", "verify() / FP32"):
            table.add_column(col, justify="left" if col == "backend" else "right")
        for name, (runner, candidate) in runners.items():
            runner.run(inputs)  # warm up (ONNX Runtime session creation)
            run = best(lambda r=runner: r.run(inputs), args.repeat)
            locate = best(lambda r=runner: r.locate(inputs, 0.05), args.repeat)
            backend = name.split(" ")[0]
            fusions = "fusions" in name
            whole = best(
                lambda c=candidate, b=backend, f=fusions: verify(
                    model, c, inputs, backend=b, fusions=f
                ),
                1,
            )
            table.add_row(name, f"{run / base:.1f}", f"{locate / base:.1f}", f"{whole / base:.1f}")
    console = Console()
    console.print(table)
    console.print(
        f"ONNX export (fp16): {export_s:.2f} s = x{export_s / base:.0f} FP32 forward; "
        f"torch threads: {torch.get_num_threads()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
