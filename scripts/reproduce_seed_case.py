"""The seed article's story end to end, with numbers, on the built-in demo model.

    python scripts/reproduce_seed_case.py

The article (AllentDan, "FP16 debugging lessons", MMDeploy/PANet): a text detector that is
fine in FP32 loses most of its accuracy in TensorRT FP16. Per-layer rescaling
(warp_conv/warp_bn) helped only partly; a breakpoint hunt found the overflow starting at the
backbone's last batch norm and ending after a batch norm in the neck; a hand-written
span-wide rescaling fixed it. Here every step is one call, and each claim is measured.
"""

from __future__ import annotations

import copy
import sys

import torch
from rich.console import Console
from rich.table import Table

from fp16lens.demo import build_demo_model
from fp16lens.patch import get_plan, patch
from fp16lens.verify import verify
from fp16lens.watch import watch

FACTORS = (2, 8, 32, 128, 1024)


def first_nonfinite_module(model: torch.nn.Module, x: torch.Tensor) -> str | None:
    """Plain forward hooks, as in the article: the first leaf module whose output is inf/NaN."""
    names = {m: n for n, m in model.named_modules()}
    found: list[str] = []

    def hook(module, args, out):
        if not found and torch.is_tensor(out) and not torch.isfinite(out).all():
            found.append(names[module])

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def bn_input(model: torch.nn.Module, x: torch.Tensor, bn: torch.nn.Module) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = bn.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return seen[0]


def bn_affine(bn: torch.nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return scale, bn.bias - bn.running_mean * scale


def warp_bn(x: torch.Tensor, bn: torch.nn.BatchNorm2d, factor: float) -> torch.Tensor:
    """The article's warp_bn: p*bn(x/p) - (p-1)*b, exact only in exact arithmetic."""
    _, bias = bn_affine(bn)
    return bn(x / factor) * factor - (factor - 1) * bias.view(1, -1, 1, 1)


def folded_bn(x: torch.Tensor, bn: torch.nn.BatchNorm2d, factor: float) -> torch.Tensor:
    """fp16lens's fold: weight/p and bias/p in the parameters, the output stays divided by p."""
    scaled = copy.deepcopy(bn)
    with torch.no_grad():
        scaled.weight.div_(factor)
        scaled.bias.div_(factor)
    return scaled(x)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


def fold_vs_warp(model, x, console: Console) -> None:
    bn = model.backbone.layer4[1].bn2
    xin = bn_input(model, x, bn)
    table = Table(
        title="layer4.1.bn2 rescaled by p: error vs bn(x), FP32 (relative to max |bn(x)|)"
    )
    for col in ("p", "article's warp_bn", "fold: weight/p, bias/p", "warp_bn finite in FP16"):
        table.add_column(col)
    with torch.no_grad():
        ref = bn(xin)
        half_bn = copy.deepcopy(bn).half()
        for p in FACTORS:
            warp16 = warp_bn(xin.half(), half_bn, p)
            table.add_row(
                str(p),
                f"{rel_err(warp_bn(xin, bn, p), ref):.2e}",
                f"{rel_err(folded_bn(xin, bn, p) * p, ref):.2e}",
                "yes" if torch.isfinite(warp16).all() else "no",
            )
    console.print(table)
    console.print(
        "warp_bn subtracts two large numbers, so its error grows with p (the article saw it "
        "grow with the factor); the fold multiplies by a power of two, which is exact. And a "
        "per-layer warp restores the large values right away: in FP16 they overflow again. "
        "The scale has to stay on until the values are back in range: a span-wide rescaling."
    )


def parity_line(name: str, result) -> str:
    cos = "nan" if result.cosine is None else f"{result.cosine:.6f}"
    verdict = "PASSED" if result else "FAILED"
    return f"{name:<28} cosine {cos:<10} inf/NaN {result.nonfinite!s:<6} {verdict}"


def main() -> int:
    console = Console()
    model, (x,) = build_demo_model()
    console.rule("1. the model is fine in FP32")
    with torch.no_grad():
        y32 = model(x)
    console.print(
        f"output {tuple(y32.shape)}, finite: {bool(torch.isfinite(y32).all())}, "
        f"range [{y32.min():.3g}, {y32.max():.3g}]"
    )

    console.rule("2. FP16 breaks")
    half = copy.deepcopy(model).half()
    with torch.no_grad():
        y16 = half(x.half())
    bad = int((~torch.isfinite(y16)).sum())
    console.print(f"real FP16 (.half() on the CPU): {bad} of {y16.numel()} outputs are inf/NaN")
    console.print(
        f"first module with inf (plain forward hooks): {first_nonfinite_module(half, x.half())}"
    )

    console.rule("3. watch finds where the span starts and where it ends")
    with watch(model) as lens, torch.no_grad():
        model(x)
    report = lens.report
    for span in report.spans:
        console.print(f"span {span.start} -> {span.end}, peak {span.peak:.3g} at {span.peak_site}")
        console.print("  through " + " -> ".join(span.sites))

    console.rule("4. the article's per-layer rescaling vs fp16lens's fold")
    fold_vs_warp(model, x, console)

    console.rule("5. patch the span, prove parity")
    patched = patch(model, report)
    for region in get_plan(patched).regions:
        console.print(
            f"region x 1/{region.factor:g}: peak {region.peak:.3g} -> "
            f"{region.peak / region.factor:.3g}, exits {', '.join(region.exits)}"
        )
    with torch.no_grad():
        fp32_change = rel_err(patched(x), y32)
    console.print(f"patched vs original in FP32: relative change {fp32_change:.2e}")
    before = verify(model, model, (x,), backend="torch-fp16")
    after = verify(model, patched, (x,), backend="torch-fp16")
    console.print(parity_line("FP32 vs FP16, before", before))
    console.print(parity_line("FP32 vs FP16, after patch", after))
    with watch(patched) as lens, torch.no_grad():
        patched(x)
    console.print(f"spans after the patch: {len(lens.report.spans)}")
    return 0 if after and not before and not lens.report.spans else 1


if __name__ == "__main__":
    sys.exit(main())
