"""The fix of each problem, in words.

The advice is patch's plan: watch and scan ask fp16lens.patch's planner
(``fp16lens.patch.advise``) and store what it plans in the report (``Report.advice``,
``Span.fix``, ``Finding.fix``); ``suggest_fix`` reads that. A report without a plan (made
by hand, read from a file before schema version 4, or one the planner failed on) is worded
from the report alone (``words_fix``; spans in ``_spanfix``). Pure functions of the report:
nothing here touches a model.
"""

from __future__ import annotations

import math

from fp16lens._core.algebra import is_batch_norm
from fp16lens._core.sites import FindingKind, Mechanism, site_module
from fp16lens.report._fmt import value
from fp16lens.report._model import Finding, Report, Span
from fp16lens.report._spanfix import rescale_exponent, span_fix

PATCH_SAYS = "patch: "
"""How the words of a plan begin (``fp16lens.patch.advise``)."""


def _op(report: Report, site: str) -> str:
    stats = report.sites.get(site)
    return stats.op if stats else "?"


def _norm_fix(f: Finding) -> str:
    k = rescale_exponent(f.peak, power=2)
    scale = f"rescale its input by 2^-{k}" if k else "rescale its input"
    opset = {"LayerNorm": 17, "GroupNorm": 18}.get(f.tensor)
    if opset:
        return (
            f"keep {f.tensor} as one node (opset ≥ {opset}) or {scale} "
            "(norms are scale-invariant, eps becomes eps/4^k)"
        )
    return f"compute {f.site} in FP32 (an FP32 island) or {scale} ((x-mean)^2 drops by 4^k)"


def _internal_fix(f: Finding) -> str:
    if f.kind == FindingKind.NORM_VARIANCE:
        return _norm_fix(f)
    if f.kind == FindingKind.RMS_SQUARE:
        k = rescale_exponent(f.peak, power=2)
        return (
            f"keep RMSNorm as one node (opset ≥ 23) or rescale its input by 2^-{k} "
            "(norms are scale-invariant)"
        )
    if f.kind == FindingKind.ATTENTION_SCORES:
        return (
            "keep the attention fused (one kernel that holds the scores in FP32: export "
            "scaled_dot_product_attention whole) or run QK^T and the softmax as an FP32 "
            "island; rescaling Q or K would change the softmax, so it is not exact"
        )
    k = rescale_exponent(f.peak)
    if f.kind == FindingKind.SUM_BEFORE_MEAN:
        return (
            f"rescale the input by 2^-{k} (the mean scales with it, undone by 2^{k} at the "
            f"next conv/linear) or keep the pool in FP32"
        )
    if f.kind == FindingKind.SUM_OF_SQUARES:
        return f"rescale the input by 2^-{k} and the norm back by 2^{k}, or keep it in FP32"
    return f"keep {f.site} in FP32 (an FP32 island)"


def param_name(f: Finding) -> str:
    """``module.tensor`` of a parameter finding; the bare tensor name in the root module."""
    return ".".join(p for p in (f.site, f.tensor) if p) or "(the model)"


def _param_fix(report: Report, f: Finding) -> str:
    name = param_name(f)
    owner = f.site or "the root module's own ops"
    if f.kind == FindingKind.PARAM_OVERFLOW:
        if not math.isfinite(f.peak):
            return f"reload the checkpoint: {name} holds inf/NaN already in FP32"
        if is_batch_norm(_op(report, f.site)) or f.tensor.startswith("running_"):
            return (
                f"exact affine re-parametrization of {f.site}: fold it into "
                "scale = weight/sqrt(running_var+eps) and shift = bias - running_mean·scale "
                "in FP32 (then running_mean = 0, running_var = 1 - eps, eps kept), before "
                ".half()"
            )
        k = rescale_exponent(f.peak)
        return (
            f"rescale {name} by 2^-{k} and undo it by 2^{k} at the next conv/linear (exact), "
            f"or keep {owner} in FP32"
        )
    step = "become 0" if f.kind == FindingKind.PARAM_UNDERFLOW else "keep fewer significant bits"
    err = (
        f"; the smallest ({value(f.peak)}) is lost"
        if f.kind == FindingKind.PARAM_UNDERFLOW
        else (
            f"; the smallest ({value(f.peak)}) is rounded to a step of 2^-24 "
            f"(relative error up to {value(2.0**-25 / f.peak) if f.peak > 0 else 'inf'})"
        )
    )
    return (
        f"{f.count} values of {name} {step} in FP16{err}. The loss is visible at the FP16 "
        f"precision of the values {name} joins: scale {name} up by 2^k and the output down "
        f"by 2^-k (exact), or keep {owner} in FP32"
    )


def _output_fix(report: Report, f: Finding) -> str:
    if f.kind == FindingKind.SOFTMAX_EXP:
        return f"subtract the row max before exp (torch.softmax does), or keep {f.site} in FP32"
    span = next((s for s in report.spans if s.start == f.site), None)
    if span is not None:
        return span_fix(report, span)
    if f.kind == FindingKind.NONFINITE or not math.isfinite(f.peak):
        return f"fix the model at {f.site} first: it produces inf/NaN already in FP32"
    return f"keep {f.site} in FP32 (an FP32 island)"


def _input_fix(f: Finding) -> str:
    if f.kind == FindingKind.NONFINITE or not math.isfinite(f.peak):
        batch = f" (batch {f.batch})" if f.batch >= 0 else ""
        return (
            f"drop or repair the samples holding inf/NaN{batch}: the data is broken, not the model"
        )
    k = rescale_exponent(f.peak)
    return f"normalise the input into FP16 range: divide it by 2^{k} and fold 2^{k} into the first layer's weights"


def headline(fix: str) -> str:
    """The first clause of a fix (before ": ", "; " or " (k = " outside parentheses), for
    one-line summaries; a plan's words keep their "patch: " and their first step, with
    its parenthesis whole ("Pow_5 re-parametrized (norm: eps / 4096)")."""
    if fix.startswith(PATCH_SAYS):
        return PATCH_SAYS + headline(fix[len(PATCH_SAYS) :])
    by_hand = fix.find("; by hand: ")
    if fix.startswith("patch ") and by_hand > 0:  # patch does nothing: the step by hand
        return "by hand: " + headline(fix[by_hand + len("; by hand: ") :])
    depth = 0
    for i, c in enumerate(fix):
        if depth == 0 and i > 0 and fix.startswith((": ", "; ", " (k = "), i):
            return fix[:i]
        depth += (c == "(") - (c == ")")
    return fix


def suggest_fix(report: Report, item: Span | Finding) -> str:
    """One sentence: what to do about ``item``: what patch's plan does for it where the
    report holds the plan (``item.fix``), else worded from the report alone."""
    return item.fix or words_fix(report, item)


def words_fix(report: Report, item: Span | Finding) -> str:
    """What to do about ``item``, from the report alone (no plan: no model to plan on)."""
    if isinstance(item, Span):
        return span_fix(report, item)
    if item.mechanism == Mechanism.INTERNAL:
        return _internal_fix(item)
    if item.mechanism == Mechanism.PARAMETER:
        return _param_fix(report, item)
    if item.mechanism == Mechanism.INPUT:
        return _input_fix(item)
    if item.mechanism == Mechanism.UNDERFLOW:
        return item.fix or (
            f"run the block that feeds {item.site} in FP32 (patch makes it an FP32 "
            "island), or keep its eps/clip bound at 1e-7 or more"
        )
    if item.mechanism == Mechanism.NOTE:
        return _note_fix(item)
    if item.kind == FindingKind.FP16_RUN:
        where = f"{item.site} and the nodes the detail names" if item.site else "the graph"
        return (
            f"keep {where} in FP32 (export(..., fp32_nodes=[...])); or scale the values up "
            "by 2^k before them and down after, then check parity with "
            "fp16lens.verify(..., backend='onnx-fp16'); or run the graph in FP32"
        )
    return _output_fix(report, item)


def _note_fix(f: Finding) -> str:
    if f.kind == FindingKind.MASK_CONSTANT:
        return (
            f"write the mask constant of {f.site} as torch.finfo(x.dtype).min (it follows the "
            "dtype) or -65504, so an FP16 graph holds a finite value"
        )
    if f.kind == FindingKind.FP32_UPCAST:
        module = site_module(f.site)
        if not module:
            return (
                "none for a .half() model; in an FP16 ONNX/TensorRT graph these ops must stay "
                "FP32: move them into a submodule and export(..., fp32_modules=[it])"
            )
        return (
            f"none for a .half() model; for an FP16 ONNX/TensorRT graph keep {module} in FP32: "
            f"export(..., fp32_modules=[{module!r}])"
        )
    if f.kind == FindingKind.UNSCANNED:
        return (
            "for ground truth inside those bodies run verify(..., backend='onnx-fp16'), or export "
            "the model with the branch taken (no If/Loop) and scan that file"
        )
    if f.kind == FindingKind.UNCHECKED:
        return (
            "check it yourself: run the model's .half() copy on your inputs against FP32, or "
            "fp16lens.verify(model, batches) (backend='torch-fp16')"
        )
    if f.kind == FindingKind.FP16_FILE:
        return (
            "none for the scan; fp16lens patch reads the same FP32 twin and writes an FP32 "
            "graph: turn that into FP16 with fp16lens export --precision fp16, which checks it"
        )
    if f.kind == FindingKind.FP16_INSIDE:
        return (
            "watch the forward with those sites in FP32 (take torch.autocast or the .half() "
            "out of forward while watching): fp16lens then shows from the FP32 values where "
            "FP16 overflows"
        )
    if f.kind == FindingKind.CONVERTER_CLAMP:
        return (
            "scan the FP32 file it was converted from (the scan names what FP16 cannot hold "
            "there), and convert it again keeping the nodes that read those constants FP32 "
            "(onnxconverter-common: node_block_list=[...])"
        )
    if f.kind == FindingKind.INLINED:
        return "none: the report names those branches' nodes '<If>/<branch>/<node>'"
    if f.kind == FindingKind.COMPILE_FALLBACK:
        return (
            "none for the report (those batches were watched eagerly); to compile them, keep "
            "forward free of values read into Python (.item(), `if tensor:`) and of value-made shapes"
        )
    if f.kind in (FindingKind.PARAM_UNDERFLOW, FindingKind.PARAM_SUBNORMAL):
        return (
            f"none: what {param_name(f)} loses in FP16 is below the FP16 precision of the values it "
            "joins, so the output does not change"
        )
    return "no action needed for FP16 range; see the note"
