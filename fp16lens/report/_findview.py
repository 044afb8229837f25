"""The findings of one mechanism (input, internal, parameter, note), each with its fix."""

from __future__ import annotations

import math
import re

from rich.console import RenderableType
from rich.text import Text

from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.report._advice import suggest_fix
from fp16lens.report._blocks import ViewOptions, fix_line, heading, indent, more, peak_key
from fp16lens.report._model import Finding, Report
from fp16lens.report._triage import trt_consequence

PARAM_LABELS: dict[str, str] = {  # by Finding.kind (a str)
    FindingKind.PARAM_OVERFLOW: "beyond 65504",
    FindingKind.PARAM_SUBNORMAL: "subnormal",
    FindingKind.PARAM_UNDERFLOW: "flushed to zero",
}


def _finding_block(report: Report, group: list[Finding]) -> list[RenderableType]:
    """One finding, or several that read the same but for a layer's number in their site
    (each layer of a transformer masks its attention the same way): one block, the site
    written once with the numbers that vary (``encoder.layer.{0-5}.attention:where``)."""
    f = group[0]
    site = sites_pattern([g.site for g in group]) if len(group) > 1 else f.site
    label = _label(f).replace(f.site, site) if f.site else _label(f)
    head = Text.assemble(("• ", "bold"), (label, "bold yellow"), " ", f.detail)
    out: list[RenderableType] = [indent(head, 2)]
    consequence = trt_consequence(f)
    if consequence:
        out.append(indent(Text(consequence, "italic")))
    return [*out, fix_line(report, f, site)]


_DIGITS = re.compile(r"(\d+)")


def _same_but_numbers(report: Report, f: Finding) -> tuple:
    """What must be equal for two findings to share a block: all they say, with the site
    taken out, and the site with its numbers taken out."""
    if not f.site:
        return (id(f),)
    words = [_label(f), f.detail, suggest_fix(report, f)]
    return (
        f.mechanism,
        f.kind,
        _DIGITS.sub("#", f.site),
        *(w.replace(f.site, "\0") for w in words),
    )


def sites_pattern(names: list[str]) -> str:
    """Names that differ only in their numbers, written once: ``layer.{0-5}.attn``
    (a run of consecutive numbers) or ``layer.{0,2,7}.attn``."""
    parts = [_DIGITS.split(n) for n in names]
    out = []
    for i, first in enumerate(parts[0]):
        values = list(dict.fromkeys(p[i] for p in parts))
        if len(values) == 1 or i % 2 == 0:
            out.append(first)
            continue
        nums = sorted(int(v) for v in values)
        run = nums == list(range(nums[0], nums[0] + len(nums))) and len(nums) > 2
        out.append(f"{{{nums[0]}-{nums[-1]}}}" if run else "{" + ",".join(map(str, nums)) + "}")
    return "".join(out)


def findings(report: Report, view: ViewOptions, mechanism: str) -> list[RenderableType]:
    items = report.findings_by(mechanism)
    if not items:
        return []
    noun, note = _TITLES[mechanism]
    groups: dict[tuple, list[Finding]] = {}
    for f in items:
        groups.setdefault(_same_but_numbers(report, f), []).append(f)
    blocks = list(groups.values())
    if not view.full:
        blocks = sorted(blocks, key=lambda g: -peak_key(g[0].peak))[: view.top]
    out: list[RenderableType] = [heading(f"{noun[0].upper()}{noun[1:]}s ({len(items)})", note)]
    for group in blocks:
        out += _finding_block(report, group)
    shown = sum(len(g) for g in blocks)
    return out + more(shown, len(items), noun, view.full_hint)


_TITLES = {  # by mechanism: the noun (singular), a note under the heading
    "input": ("input problem", "in the data, not in the model"),
    "internal": ("internal risk", "inside an op, invisible at its output"),
    "underflow": (
        "underflow problem",
        "values FP16 makes 0 reach a log, a divide or an rsqrt: inf/NaN",
    ),
    "parameter": ("parameter problem", "weights and buffers FP16 cannot hold"),
    "output": ("other output problem", ""),
    "note": ("note", "not overflow today, but worth knowing before TensorRT"),
}


def _label(f: Finding) -> str:
    if f.mechanism == Mechanism.PARAMETER and not math.isfinite(f.peak):
        return f"[inf/NaN ×{f.count}]"
    if f.mechanism == Mechanism.PARAMETER:
        return f"[{PARAM_LABELS.get(f.kind, f.kind)} ×{f.count}]"
    if f.mechanism == Mechanism.NOTE and f.kind in PARAM_LABELS:
        return f"[{PARAM_LABELS[f.kind]} ×{f.count} · harmless]"
    if f.mechanism == Mechanism.UNDERFLOW:
        return f"[{f.site} · {f.count} inf/NaN · {100 * f.peak:.3g}% flushed]"
    what = f.kind if f.mechanism in (Mechanism.INTERNAL, Mechanism.NOTE) else f.kind or f.mechanism
    return f"[{f.site} · {what}]" if f.site else f"[{what}]"  # a note on the whole graph: no site


def orphan_outputs(report: Report, view: ViewOptions) -> list[RenderableType]:
    """Output findings that no span stands for (softmax-exp without a span, ...)."""
    starts = {s.start for s in report.spans}
    orphans = [f for f in report.findings_by(Mechanism.OUTPUT) if f.site not in starts]
    if not orphans:
        return []
    sub = Report(sites=report.sites, findings=orphans, spans=report.spans, meta=report.meta)
    return findings(sub, view, "output")
