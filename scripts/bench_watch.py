"""Overhead of watch() against a plain forward, side by side in one run.

Prints, per model: time of a watched forward / plain forward (median and interquartile
range of per-repetition ratios, each repetition timing every method back to back) for
fp16lens's op-level watch, the seed article's module hooks
(FInspect + fp16_check: module outputs only) and transformers' DebugUnderflowOverflow
(when transformers is installed), and the peak resident memory of each relative to a
plain forward (each measured in a fresh subprocess). Besides the steady state (forwards
inside an open context), a one-batch ratio times the whole ``with watch(m): m(x)`` block
(entering, one forward, leaving) against one plain forward.

On CUDA (``--device cuda``) every timing is bracketed by ``torch.cuda.synchronize()`` and
memory is the peak CUDA memory (``torch.cuda.max_memory_allocated``) relative to a plain
forward, measured in the same process after resetting the peak.

    python scripts/bench_watch.py                  # ResNet-50 (4x3x224x224) and a BERT-base-sized
                                                   # encoder (4x128 tokens); --batch 32 for b32
    python scripts/bench_watch.py --quick          # small inputs, for CI
    python scripts/bench_watch.py --device cuda    # the same ratios on a GPU
    python scripts/bench_watch.py --compile        # plus scan(compile=True): steady state,
                                                   # compile time, break-even, peak memory
                                                   # (scripts/bench_watch_compiled.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


# ---- models ------------------------------------------------------------------------------
def resnet50(quick: bool, batch: int = 4):
    from torchvision_compat import ensure_torchvision

    tv = ensure_torchvision()
    model = tv.models.resnet50().eval()
    side = 64 if quick else 224
    return model, (torch.randn(1 if quick else batch, 3, side, side),)


def bert_base(quick: bool, batch: int = 4):
    """BERT-base-sized encoder with random weights (transformers' BertModel if installed)."""
    layers, seq = (2, 32) if quick else (12, 128)
    batch = 1 if quick else batch
    try:
        from torchvision_compat import ensure_torchvision

        ensure_torchvision()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(
            num_hidden_layers=layers,
            hidden_size=768,
            num_attention_heads=12,
            intermediate_size=3072,
            attn_implementation="eager",
        )
        model = BertModel(cfg).eval()
        return model, (torch.randint(0, cfg.vocab_size, (batch, seq)),)
    except ImportError:
        enc = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True), layers
        ).eval()
        return enc, (torch.randn(batch, seq, 768),)


MODELS = {"resnet50": resnet50, "bert-base": bert_base}


# ---- the methods compared ----------------------------------------------------------------
@contextlib.contextmanager
def fp16lens_watch(model):
    import fp16lens

    with fp16lens.watch(model):
        yield


@contextlib.contextmanager
def fp16lens_watch_report(model):
    """watch, with its report read when the block ends: the report built and, for a model
    found clean, its verdict checked in real FP16 (one emulated FP16 run of each batch kept,
    up to 8; ``.half()`` on CUDA)."""
    import fp16lens

    with fp16lens.watch(model) as lens:
        yield
    assert lens.report is not None


@contextlib.contextmanager
def seed_hooks(model):
    """The seed article's FInspect.hook_all + fp16_check: a forward hook on every module
    comparing max |input| and max |output| with 65504 (module outputs only)."""
    found: list[str] = []

    def tensors(obj):
        if torch.is_tensor(obj):
            yield obj
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                yield from tensors(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                yield from tensors(o)

    def check(module, inputs, output):
        ins = [t.abs().max() for t in tensors(inputs) if t.is_floating_point() and t.numel()]
        outs = [t.abs().max() for t in tensors(output) if t.is_floating_point() and t.numel()]
        if ins and outs:
            i, o = max(ins), max(outs)
            if i < 65504 and o > 65504:
                found.append(f"from: {module}")
            if i > 65504 and o < 65504:
                found.append(f"to: {module}")

    handles = [m.register_forward_hook(check) for m in model.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def debug_underflow_overflow(model):
    from transformers.debug_utils import DebugUnderflowOverflow

    dbg = DebugUnderflowOverflow(model, max_frames_to_save=1)
    try:
        yield
    finally:  # it keeps no handles; remove its hooks the only way possible
        for m in model.modules():
            m._forward_hooks.clear()
        del dbg


@contextlib.contextmanager
def plain(model):
    yield


METHODS = {
    "plain": plain,
    "fp16lens.watch": fp16lens_watch,
    "fp16lens.watch + report": fp16lens_watch_report,
    "seed hooks": seed_hooks,
    "DebugUnderflowOverflow": debug_underflow_overflow,
}


def available(method: str) -> str | None:
    if method == "DebugUnderflowOverflow":
        try:
            import transformers.debug_utils  # noqa: F401
        except ImportError as exc:
            return f"not installed ({exc.name})"
    return None


def _sync(device: torch.device) -> None:
    """Wait for queued kernels, so a timer reads the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steady(model, inputs, method: str, calls: int, device: torch.device) -> float:
    """``calls`` forwards inside an open context, after one warm-up forward there."""
    with METHODS[method](model):
        model(*inputs)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            model(*inputs)
        _sync(device)
        return time.perf_counter() - t0


def _one_batch(model, inputs, method: str, calls: int, device: torch.device) -> float:
    """The whole ``with method(model): model(x)`` block: enter, one forward, leave."""
    _sync(device)
    t0 = time.perf_counter()
    with METHODS[method](model):
        model(*inputs)
    _sync(device)
    return time.perf_counter() - t0


def time_ratio_spread(
    model,
    inputs,
    methods: Sequence[str],
    reps: int,
    calls: int = 2,
    device: torch.device | None = None,
    timer=_steady,
) -> dict[str, tuple[float, float, float]]:
    """Per method: (lower quartile, median, upper quartile) over repetitions of
    (method time / plain time). Each repetition times every method back to back (by
    default ``calls`` forwards after one warm-up inside the method's context), so a ratio
    compares runs seconds apart: this machine's speed drifts by 10-20% over a minute."""
    device = device or torch.device("cpu")
    per_rep: dict[str, list[float]] = {m: [] for m in methods}
    with torch.no_grad():
        model(*inputs)  # warm-up outside any context (CUDA kernels, allocator)
        for _ in range(reps):
            times = {m: timer(model, inputs, m, calls, device) for m in methods}
            for m in methods:
                per_rep[m].append(times[m] / times["plain"])
    out = {}
    for m, r in per_rep.items():
        q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
        out[m] = (q[0], statistics.median(r), q[2])
    return out


def time_ratios(model, inputs, methods: Sequence[str], reps: int) -> dict[str, float]:
    """Median of (method time / plain time) over interleaved repetitions."""
    return {m: s[1] for m, s in time_ratio_spread(model, inputs, methods, reps).items()}


def peak_cuda_mb(model, inputs, method: str, device: torch.device) -> float:
    """Peak CUDA memory of 2 forwards with the method (allocated tensors, this process)."""
    with torch.no_grad():
        _sync(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        with METHODS[method](model):
            model(*inputs)
            model(*inputs)
        _sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def peak_rss_mb(model_name: str, method: str, quick: bool, batch: int) -> float:
    """Peak resident memory of a fresh process running 2 forwards with the method."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys, resource, torch; sys.path.insert(0, {here!r}); import bench_watch as b\n"
        f"model, inputs = b.MODELS[{model_name!r}]({quick!r}, {batch!r})\n"
        f"with torch.no_grad(), b.METHODS[{method!r}](model):\n"
        "    model(*inputs); model(*inputs)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small inputs and few repetitions (CI)"
    )
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument(
        "--methods",
        nargs="*",
        default=list(METHODS),
        choices=list(METHODS),
        help="the methods to time (plain always runs: the ratios' reference)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--reps", type=int, default=None, help="interleaved repetitions (default 15, quick 3)"
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the peak-memory measurements"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the models and inputs live (cuda: synchronized timings, peak CUDA memory)",
    )
    parser.add_argument(
        "--batch", type=int, default=4, help="batch size of both models (default 4)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="add a scan(compile=True) row per model (compile time, break-even)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    device = torch.device(args.device)
    reps = args.reps or (3 if args.quick else 15)
    rows = []
    for name in args.models:
        model, inputs = MODELS[name](args.quick, args.batch)
        model, inputs = model.to(device), tuple(x.to(device) for x in inputs)
        rows += _bench_model(name, model, inputs, reps, device, args)
        if args.compile:
            from bench_watch_compiled import compiled_row

            rows.append(compiled_row(name, model, inputs, reps, device, args))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    where = (
        f"{torch.get_num_threads()} threads"
        if device.type == "cpu"
        else torch.cuda.get_device_name()
    )
    table = Table(
        title=f"watch overhead vs a plain forward ({'quick' if args.quick else 'full'} mode, {where})"
    )
    memory = "peak CUDA memory / plain" if device.type == "cuda" else "peak memory / plain"
    for col in (
        "model",
        "method",
        "time / plain (median)",
        "interquartile range",
        "one batch / plain",
        memory,
        "note",
    ):
        table.add_column(col)
    for r in rows:
        iqr = r.get("time_iqr")
        table.add_row(
            r["model"],
            r["method"],
            _x(r["time"]),
            "-" if not iqr else f"{iqr[0]:.2f}-{iqr[1]:.2f}x",
            _x(r.get("one_batch")),
            _x(r["memory"]),
            r["note"],
        )
    Console(width=max(120, Console().width)).print(table)
    return 0


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _bench_model(name: str, model, inputs, reps: int, device: torch.device, args) -> list[dict]:
    chosen = [m for m in METHODS if m == "plain" or m in args.methods]
    methods = [m for m in chosen if available(m) is None]
    spread = time_ratio_spread(model, inputs, methods, reps, device=device)
    one = time_ratio_spread(model, inputs, methods, reps, device=device, timer=_one_batch)
    memory = {}
    if not args.no_memory:
        for m in methods:
            memory[m] = (
                peak_cuda_mb(model, inputs, m, device)
                if device.type == "cuda"
                else peak_rss_mb(name, m, args.quick, args.batch)
            )
    rows = []
    for m in chosen:
        why = available(m)
        if why:
            rows.append({"model": name, "method": m, "time": None, "memory": None, "note": why})
            continue
        lo, mid, hi = spread[m]
        rows.append(
            {
                "model": name,
                "method": m,
                "device": device.type,
                "time": mid,
                "time_iqr": [lo, hi],
                "one_batch": one[m][1],
                "one_batch_iqr": [one[m][0], one[m][2]],
                "memory": memory[m] / memory["plain"] if memory else None,
                "note": "",
            }
        )
        print(
            f"# {name} {m} ({device.type}): time {mid:.2f}x (IQR {lo:.2f}-{hi:.2f}), "
            f"one batch {one[m][1]:.2f}x (IQR {one[m][0]:.2f}-{one[m][2]:.2f})",
            file=sys.stderr,
            flush=True,
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
