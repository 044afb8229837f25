"""Draw docs/img/patch_rescaling.svg: what patch's exact rescaling does, on the built-in demo.

The demo's text detector overflows FP16 at ``backbone.layer4.1.bn2``. The figure shows, for
the sites around that span in execution order, the largest |value| watch recorded (log2)
before and after ``fp16lens.patch``, the FP16 limit, the regions patch found (their entries
absorb 1/p, their exits p), and what real FP16 gives (``copy.deepcopy(model).half()(x.half())``
on the CPU, without fp16lens). Needs matplotlib (the ``plot`` extra); about 20 s on a 2-core CPU.

    python scripts/make_patch_figure.py [--out docs/img/patch_rescaling.svg]
"""

from __future__ import annotations

import argparse
import copy
import math
from pathlib import Path

import torch

import fp16lens
from fp16lens.demo import build_demo_model

ROOT = Path(__file__).resolve().parents[1]
BEFORE, AFTER = 4, 3  # sites shown before the region's first site and after its last


def real_fp16_nonfinite(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(non-finite outputs, outputs) of the model run in real FP16 on the CPU."""
    with torch.no_grad():
        out = copy.deepcopy(model).half()(x.half())
    return int((~torch.isfinite(out)).sum()), out.numel()


def measure() -> dict:
    model, (x,) = build_demo_model()
    report = fp16lens.scan(model, [x])
    patched = fp16lens.patch(model, report, batches=[x])
    after = fp16lens.scan(patched, [x])
    regions = fp16lens.get_plan(patched).regions
    in_regions = {s for r in regions for s in r.sites}
    order = sorted(report.sites.values(), key=lambda s: s.order)
    names = [s.name for s in order]
    first = min(names.index(s) for s in in_regions)
    last = max(names.index(s) for s in in_regions)
    shown = names[max(0, first - BEFORE) : last + AFTER + 1]
    return {
        "sites": shown,
        "before": [report.sites[n].absmax for n in shown],
        "after": [after.sites[n].absmax if n in after.sites else math.nan for n in shown],
        "regions": regions,
        "fp16_before": real_fp16_nonfinite(model, x),
        "fp16_after": real_fp16_nonfinite(patched, x),
    }


def draw(m: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: small, searchable, no fonts
    regions, sites = m["regions"], m["sites"]
    in_regions = {s for r in regions for s in r.sites}
    xs = range(len(sites))
    fig, ax = plt.subplots(figsize=(10, 5))
    for j, i in enumerate(i for i, s in enumerate(sites) if s in in_regions):
        label = "a site of a region (its values ÷ p)" if j == 0 else None
        ax.axvspan(i - 0.5, i + 0.5, color="#cfe3f7", lw=0, label=label)
    ax.axhline(math.log2(65504), color="#c62828", ls="--", lw=1, label="FP16 max 65504")
    ax.plot(xs, [math.log2(v) for v in m["before"]], "o-", color="#c62828", label="before")
    ax.plot(xs, [math.log2(v) for v in m["after"]], "s-", color="#1565c0", label="after patch")
    ks = sorted({round(math.log2(r.factor)) for r in regions})
    for names, marker, label in (
        ({s for r in regions for s in r.entries}, "v", "entry: its weights absorb 1/p"),
        ({s for r in regions for s in r.exits}, "^", "exit: its weights absorb p"),
    ):
        at = [i for i, s in enumerate(sites) if s in names]
        y = [math.log2(m["after"][i]) + (-1.4 if marker == "v" else 1.4) for i in at]
        ax.scatter(at, y, marker=marker, s=60, color="#2e7d32", label=label, zorder=3)
    bad, total = m["fp16_before"]
    bad_after, _ = m["fp16_after"]
    ax.set_title(
        f"demo model: {len(regions)} regions, p = {', '.join(f'2^{k}' for k in ks)}; real FP16 output non-finite: {bad} of {total} before, "
        f"{bad_after} after",
        fontsize=10,
    )
    ax.set_xticks(list(xs), sites, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("log2 of the largest |value|")
    ax.legend(fontsize=8, loc="upper left", framealpha=0.95)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Date": None})  # no timestamp: the same run, the same file
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs/img/patch_rescaling.svg")
    args = parser.parse_args()
    m = measure()
    draw(m, args.out)
    for r in m["regions"]:
        print(f"region {r.entries} -> {r.exits}, p = {r.factor:g}, peak {r.peak:.3g}")
    print(f"real FP16 non-finite: {m['fp16_before']} before, {m['fp16_after']} after")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
