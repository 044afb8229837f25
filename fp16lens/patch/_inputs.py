"""Inputs beyond FP16: the caller divides input k by 2^k, the first layers that read it
hold the factor in their weights (a conv/linear's weight, an RNN's ``weight_ih_l0``).

W (x / 2^k) 2^k = W x: exact, the layers' outputs and everything after them unchanged.
2^k is the report's advice (``_core/algebra rescale_exponent``: the input's peak lands near
2^13). The fold is impossible where an op that reads the input cannot hold the factor
(an activation, a functional op, weights that would pass FP16 times 2^k) or where the
report cannot tell which ops read which input (several float inputs): the plan says so,
as an unresolved entry naming the input.
"""

from __future__ import annotations

import math

import torch

from fp16lens._core import FP16_MAX
from fp16lens._core.algebra import rescale_exponent
from fp16lens._core.sites import INPUT_WORDS, FindingKind, Mechanism, input_label
from fp16lens.patch._apply import input_weights
from fp16lens.patch._plan import Plan, Reparam, Unresolved


def fold_inputs(graph, report, plan: Plan, onnx: bool = False) -> None:
    """Reparams of rule "input" and ``plan.input_scales`` for each input finding; an
    unresolved entry where the fold is impossible."""
    for f in report.findings:
        if (
            f.mechanism != Mechanism.INPUT
            or f.kind != FindingKind.OVERFLOW
            or not math.isfinite(f.peak)
        ):
            continue
        k, index = rescale_exponent(f.peak), _index(f.site)
        label = input_label(index, f.tensor)
        assert k is not None  # the peak is finite
        p = 2.0**k
        readers = [s for s in report.sites if not graph.producers[s] and s not in graph.frozen]
        why = _why_not(graph, report, readers, p, onnx)
        if why is None:
            plan.input_scales[index] = p
            for s in readers:
                names = " and ".join(input_weights(graph.modules[s]))
                plan.reparametrized.append(
                    Reparam(
                        s,
                        "input",
                        p,
                        1.0,
                        f"{names} x {p:g}: input {index} arrives divided by {p:g}",
                    )
                )
            plan.notes.append(
                f"input {label} (values up to {f.peak:.3g}) must be divided by {p:g} (2^{k}) by the caller "
                f"before the patched model runs: {', '.join(readers)} hold the factor "
                f"(plan.scale_inputs(*inputs) does it)"
            )
        else:
            plan.unresolved.append(
                Unresolved(
                    f.site,
                    (
                        f"{INPUT_WORDS}{label} holds values up to {f.peak:.3g}, beyond FP16; no fold: {why}; "
                        f"divide it by {p:g} (2^{k}) before the model and scale what reads it by hand"
                    ),
                )
            )


def _index(site: str) -> int:
    return int(site[site.index("[") + 1 : site.index("]")]) if "[" in site else 0


def _why_not(graph, report, readers: list[str], p: float, onnx: bool) -> str | None:
    if onnx:
        return "an ONNX graph's input is folded by re-exporting the model (not done by patch)"
    shapes = report.meta.input_shapes[0] if report.meta.input_shapes else []
    if len(shapes) > 1:
        return f"the model takes {len(shapes)} float inputs and the report does not say which ops read which"
    if not readers:
        return "no op of the report reads it"
    for s in readers:
        mod = graph.modules.get(s)
        names = (
            input_weights(mod)
            if isinstance(mod, torch.nn.Module) and report.sites[s].kind == "module"
            else []
        )
        if not names:
            return f"{s} ({report.sites[s].op}) reads it and has no weight to hold the factor"
        peak = max(float(getattr(mod, n).detach().abs().max()) for n in names)
        if peak * p > FP16_MAX:
            return f"{s}'s weights x {p:g} would pass FP16 ({peak * p:.3g})"
    return None
