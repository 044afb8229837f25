"""The compiled scan's numbers for ``scripts/bench_watch.py --compile``.

Per model: the steady state of ``scan(model, batches, compile=True)`` (one compiled batch,
reduced into the report's accumulator) against a plain forward, side by side with the
eager watch's steady state and the compiled graph alone (no accumulation) in the same
repetitions; the one-off costs (the first, eager
batch; the capture; Inductor's compile with the first compiled run); the number of
batches from which the compiled scan takes less time in all than the eager one; and the
peak memory (CUDA: allocated, in this process; CPU: resident, a fresh process scanning
4 batches, compile included).
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def break_even(one_off: float, eager: float, compiled: float) -> int | None:
    """Batches N from which one_off + N * compiled <= N * eager (None: never)."""
    if compiled >= eager:
        return None
    return max(1, math.ceil(one_off / (eager - compiled)))


def compiled_numbers(model, inputs: tuple, reps: int, device: torch.device) -> dict:
    import fp16lens
    from fp16lens.watch import WatchOptions
    from fp16lens.watch._compiled import run_compiled
    from fp16lens.watch._compiled_scan import CompiledScan

    with torch.no_grad():
        model(*inputs)  # warm-up outside any context
        run = CompiledScan(model, WatchOptions())
        first = _timed(lambda: run.step(0, inputs), device)  # eager, learns the .half() dtypes
        capture = _timed(lambda: run.step(0, inputs), device)
        compile_s = _timed(lambda: run.step(0, inputs), device)
        if run.timings.fallbacks:
            return {"fallback": run.timings.fallbacks[0], "compile_s": compile_s}
        cap = next(iter(run.graphs.values()))
        plain, eager, compiled, graph = [], [], [], []
        for _ in range(reps):  # each repetition times the four back to back
            p = _timed(lambda: model(*inputs), device)
            with fp16lens.watch(model):
                model(*inputs)  # the block's first forward (its meta trace) is not steady state
                w = _timed(lambda: model(*inputs), device)
            c = _timed(lambda: run.step(0, inputs), device)
            g = _timed(lambda: run_compiled(cap, inputs, 0), device)  # no accumulation
            plain.append(p)
            eager.append(w / p)
            compiled.append(c / p)
            graph.append(g / p)
        memory = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            run.step(0, inputs)
            _sync(device)
            peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            model(*inputs)
            _sync(device)
            memory = peak / torch.cuda.max_memory_allocated(device)
    p = statistics.median(plain)
    e, c = statistics.median(eager), statistics.median(compiled)
    one_off = first + capture + compile_s - 3 * c * p
    return {
        "time": c,
        "time_iqr": _iqr(compiled),
        "eager_time": e,
        "graph_time": statistics.median(graph),
        "plain_s": p,
        "first_s": first,
        "capture_s": capture,
        "compile_s": compile_s,
        "break_even": break_even(one_off, e * p, c * p),
        "memory": memory,
    }


def _iqr(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def peak_rss_ratio(model_name: str, quick: bool, batch: int) -> float:
    """Peak resident memory of a fresh process scanning 4 batches compiled (compile
    included), over one running 2 plain forwards."""
    here = os.path.dirname(os.path.abspath(__file__))

    def rss(body: str) -> float:
        code = (
            f"import sys, resource, torch; sys.path.insert(0, {here!r}); import bench_watch as b\n"
            f"model, inputs = b.MODELS[{model_name!r}]({quick!r}, {batch!r})\n"
            f"{body}\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        return float(out.stdout.strip().splitlines()[-1])

    plain = rss("with torch.no_grad():\n    model(*inputs); model(*inputs)")
    scanned = rss(
        "import fp16lens\nfp16lens.scan(model, [inputs] * 4, progress=False, compile=True)"
    )
    return scanned / plain


def compiled_row(name: str, model, inputs: tuple, reps: int, device: torch.device, args) -> dict:
    """The row bench_watch.py prints for ``fp16lens.scan(compile=True)``."""
    n = compiled_numbers(model, inputs, reps, device)
    row = {
        "model": name,
        "method": "fp16lens.scan(compile=True)",
        "device": device.type,
        "time": n.get("time"),
        "time_iqr": n.get("time_iqr"),
        "one_batch": None,
        "memory": n.get("memory"),
        **{k: v for k, v in n.items() if k not in ("time", "time_iqr")},
    }
    if "fallback" in n:
        row["note"] = f"fell back to eager: {n['fallback']}"
        return row
    if device.type == "cpu" and not args.no_memory:
        row["memory"] = peak_rss_ratio(name, args.quick, args.batch)
    even = "never" if n["break_even"] is None else f"{n['break_even']} batches"
    row["note"] = (
        f"compile {n['compile_s']:.0f}s, capture {n['capture_s']:.1f}s; the graph alone "
        f"{n['graph_time']:.2f}x; eager watch {n['eager_time']:.2f}x here; breaks even at {even}"
    )
    print(
        f"# {name} compiled ({device.type}): time {n['time']:.2f}x, {row['note']}",
        file=sys.stderr,
        flush=True,
    )
    return row
