"""The report: plain data about one watched model, with an exact JSON round trip.

Everything here is data. Rendering lives in ``_render`` (rich's ``__rich_console__``
protocol), persistence of the rendered view and the plot in their own modules.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp16lens._core import FP16_MAX, ReportError, headroom_bits
from fp16lens._core.sites import FindingKind, Mechanism

SCHEMA_VERSION = 4
"""The version of the report's JSON form that this release writes."""
READABLE_VERSIONS = (1, 2, 3, 4)
"""Version 1 has no weight fingerprint: such reports load, and patch cannot check them.
Version 2 has no ``meta.inputs``: patch's FP32 check then falls back to random floats of
the recorded float input shapes. Before version 4 a report has no ``advice`` (patch's plan
as data) and no ``Span.fix``: its fixes are then worded from the report alone."""
HIST_MIN_EXP = -26
"""``SiteStats.hist[0]`` counts non-zero |v| < 2**HIST_MIN_EXP (they round to 0 in FP16)."""
HIST_MAX_EXP = 16
"""``SiteStats.hist[-1]`` counts |v| >= 2**HIST_MAX_EXP (inf in FP16)."""
HIST_BINS = HIST_MAX_EXP - HIST_MIN_EXP + 2
"""Bins: [<2^-26], [2^-26, 2^-25), ..., [2^15, 2^16), [>=2^16]: one per binade."""

MECHANISMS = tuple(Mechanism)
""""note" findings are advice (e.g. FP32 masking constants) and do not make a report unclean."""
SATURATED = 1e30
"""|v| at or above this (or inf) is a saturating constant (masks), not an activation."""


def hist_bin_low(i: int) -> float:
    """Lower edge of histogram bin ``i`` (0 for the first bin)."""
    return 0.0 if i == 0 else 2.0 ** (HIST_MIN_EXP + i - 1)


@dataclass
class SiteStats:
    """What one site's outputs did over every call and batch.

    A site is a module (``layer4.1.bn2``) or a functional op inside a module's forward
    (``layer4.1:add``, ``layer4.1:add#2`` for the second add in one call).
    """

    name: str
    kind: str  # "module" (a built-in leaf module's op) | "op" (a functional op)
    op: str  # module class ("BatchNorm2d") or aten op ("add")
    module: str  # qualified name of the module whose forward ran it ("" = root)
    order: int  # index of first execution
    calls: int = 0
    absmax: float = 0.0
    absmax_batch: int = -1  # batch index of the worst value, for reproduction
    numel: int = 0
    zeros: int = 0
    nonfinite: int = 0  # inf/NaN already in FP32
    overflow: int = 0  # |v| > threshold
    subnormal: int = 0  # 0 < |v| < 2**-14
    underflow: int = 0  # 0 < |v| < 2**-24
    saturated: int = 0  # |v| >= 1e30 or inf: masking constants such as finfo(float32).min,
    # excluded from absmax and from spans (a .half() model picks finfo(float16).min instead)
    hist: list[int] = field(default_factory=lambda: [0] * HIST_BINS)
    shape: list[int] = field(default_factory=list)  # output shape of the first call

    @property
    def headroom(self) -> float:
        """log2(65504 / absmax): doublings left before FP16 overflow (negative: over)."""
        return headroom_bits(self.absmax)

    @property
    def subnormal_share(self) -> float:
        nz = self.numel - self.zeros
        return self.subnormal / nz if nz else 0.0

    @property
    def underflow_share(self) -> float:
        nz = self.numel - self.zeros
        return self.underflow / nz if nz else 0.0

    def quantile_low(self, share: float) -> float:
        """Lower edge of the binade below which ``share`` of the non-zero values lie."""
        total = sum(self.hist)
        if total == 0:
            return 0.0
        acc = 0
        for i, c in enumerate(self.hist):
            acc += c
            if acc >= share * total:
                return hist_bin_low(i)
        return hist_bin_low(len(self.hist) - 1)


@dataclass
class Span:
    """A connected region of the dataflow graph whose values leave FP16 range.

    ``start`` produced out-of-range values from in-range inputs; ``ends`` are the sites
    where out-of-range inputs give in-range outputs again. ``end`` is the first of them,
    or None when the out-of-range values reach the model output.
    """

    start: str
    end: str | None
    peak: float
    peak_site: str
    sites: list[str]  # start, the out-of-range sites inside, and the ends: execution order
    ends: list[str] = field(default_factory=list)
    reaches_output: bool = False
    batches: int = 0  # in how many forward calls it occurred
    first_batch: int = -1
    fused: bool = False  # only inside a conv/linear+BN TensorRT folds: never stored
    fix: str = ""  # what fp16lens.patch does for it, in words, from its plan ("" before version 4)


@dataclass
class Finding:
    """One problem: ``mechanism`` is a ``Mechanism`` ("output", "internal", "parameter",
    "input", "note"), ``kind`` a ``FindingKind`` ("overflow", "norm-variance", ...); both
    are their strings, so a report read back from JSON compares equal."""

    site: str
    mechanism: str
    peak: float
    detail: str
    kind: str = ""  # finer than the mechanism: a FindingKind
    batch: int = -1
    tensor: str = ""  # parameters/buffers: "running_var"; internal: what overflows; input: its name
    count: int = 0
    fix: str = ""  # what fp16lens.patch does for it, in words, from its plan (``Report.advice``)


@dataclass
class ReportMeta:
    """How a report was made: the model's class, the batches, torch and fp16lens releases,
    the threshold, the inputs recorded and the weights' fingerprint (stale reports)."""

    model_class: str = ""
    batches: int = 0
    torch_version: str = ""
    fp16lens_version: str = ""
    threshold: float = FP16_MAX
    input_shapes: list[list[list[int]]] = field(default_factory=list)  # per batch, per tensor
    schema_version: int = SCHEMA_VERSION
    weights: dict[str, list[float]] = field(default_factory=dict)
    # the weights the ranges were measured with: tensor name -> [numel, Σv, Σ|v|, Σv·ramp]
    # (fp16lens._core.fingerprint); {} for reports made by hand or before version 2
    inputs: list[dict[str, Any]] = field(default_factory=list)
    # per model input (positional "0", "1", ... then keywords by name; ONNX: graph input
    # names): {"name", "dtype" ("float32", "int64", ..., "python" with "value", "object"),
    # "shape" (first forward), "min", "max" (over all forwards)}; [] before version 3


@dataclass
class Advice:
    """What ``fp16lens.patch`` plans for this report, as plain data: written by patch's own
    planner when the report is made (``fp16lens.patch.advise``, called by watch and scan),
    so that the advice is the plan. Each entry is the plan's dataclass as a dict
    (``fp16lens.patch.Region``, ``Island``, ``Reparam``, ``Unresolved``); ``error`` says why
    the planner could not plan (the fixes are then worded from the report alone)."""

    regions: list[dict[str, Any]] = field(
        default_factory=list
    )  # sites, entries, exits, factor, peak, reasons
    islands: list[dict[str, Any]] = field(
        default_factory=list
    )  # module, in_scale, out_scale, reason, site, ...
    reparametrized: list[dict[str, Any]] = field(
        default_factory=list
    )  # module, rule, s_in, s_out, detail
    unresolved: list[dict[str, Any]] = field(default_factory=list)  # site, reason, cause
    input_scales: dict[str, float] = field(
        default_factory=dict
    )  # input index -> 2^k the caller divides by
    widened: list[dict[str, Any]] = field(default_factory=list)  # spans kept FP32 end to end
    underflow_rules: list[dict[str, Any]] = field(
        default_factory=list
    )  # site, rule, exponent, folded, ...
    error: str = ""


@dataclass
class Report:
    """What watch() learned about one model; plain data, JSON round trip, rich rendering."""

    sites: dict[str, SiteStats] = field(default_factory=dict)  # execution order
    spans: list[Span] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    edges: list[tuple[str, str]] = field(
        default_factory=list
    )  # site dataflow: (producer, consumer)
    meta: ReportMeta = field(default_factory=ReportMeta)
    advice: Advice | None = None  # patch's plan for it (None: not planned, e.g. before version 4)

    def __eq__(self, other: object) -> bool:
        """Equal when the JSON forms are equal (NaN peaks compare equal, unlike floats)."""
        if not isinstance(other, Report):
            return NotImplemented
        return self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]  # mutable data: Python's way to unhash a class

    # ---- queries -------------------------------------------------------------------
    @property
    def clean(self) -> bool:
        """Nothing real FP16 breaks on: no span and no finding but notes, leaving aside what a
        ``threshold`` below 65504 highlights where the values still fit FP16 (``margin``)."""
        return not self.failing_spans() and all(
            f.mechanism == Mechanism.NOTE or self.margin_finding(f) for f in self.findings
        )

    def stored_in_range(self) -> bool:
        """Clean but for risks inside ops (``Mechanism.INTERNAL``: a sum before a mean, a
        variance, attention scores; invisible at their outputs), a clean report included:
        where the verdict's FP16 check runs (every stored tensor in FP16, each op's inside
        in FP32), since FP16 may still lose what no such risk explains (a raw 0-255
        input's precision through a deep network)."""
        return not self.failing_spans() and all(
            f.mechanism in (Mechanism.NOTE, Mechanism.INTERNAL) or self.margin_finding(f)
            for f in self.findings
        )

    def margin(self, peak: float) -> bool:
        """Whether ``peak`` passes only a ``threshold`` set below 65504: a value FP16 holds,
        highlighted as a margin, never counted as an overflow of real FP16."""
        return self.meta.threshold < FP16_MAX and math.isfinite(peak) and abs(peak) <= FP16_MAX

    def margin_finding(self, f: Finding) -> bool:
        overflow = f.mechanism in (Mechanism.OUTPUT, Mechanism.INPUT, Mechanism.INTERNAL) or (
            f.kind == FindingKind.PARAM_OVERFLOW
        )
        return overflow and self.margin(f.peak)

    def failing_spans(self) -> list[Span]:
        """The spans whose values pass 65504 (all of them unless a lower threshold was set)."""
        return [s for s in self.spans if not self.margin(s.peak)]

    def findings_by(self, mechanism: str) -> list[Finding]:
        return [f for f in self.findings if f.mechanism == mechanism]

    def hottest(self, k: int = 10) -> list[SiteStats]:
        return sorted(self.sites.values(), key=lambda s: -s.absmax)[:k]

    @property
    def worst_headroom(self) -> float:
        return min((s.headroom for s in self.sites.values()), default=math.inf)

    def consumers(self, site: str) -> list[str]:
        return [c for p, c in self.edges if p == site]

    def producers(self, site: str) -> list[str]:
        return [p for p, c in self.edges if c == site]

    # ---- persistence ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "meta": dataclasses.asdict(self.meta),
            "sites": [dataclasses.asdict(s) for s in self.sites.values()],
            "spans": [dataclasses.asdict(s) for s in self.spans],
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "edges": [list(e) for e in self.edges],
            "advice": None if self.advice is None else dataclasses.asdict(self.advice),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        if (
            isinstance(data, dict)
            and "schema_version" not in data
            and {"clean", "spans"} <= set(data)
        ):
            raise ReportError(
                "this is the summary `fp16lens scan --json` prints, not a report; save the report "
                "itself with `fp16lens scan MODEL --save report.json` (or report.save(path))"
            )
        if not isinstance(data, dict) or "schema_version" not in data:
            raise ReportError(
                "not an fp16lens report (no 'schema_version'); create one with "
                "fp16lens.watch(model) or `fp16lens scan` and save it with report.save()"
            )
        version = data["schema_version"]
        if version not in READABLE_VERSIONS:
            raise ReportError(
                f"report schema version {version} is not supported by this fp16lens "
                f"(it reads versions {', '.join(map(str, READABLE_VERSIONS))}); re-create "
                "the report with this version's `fp16lens scan`"
            )
        try:
            meta = ReportMeta(**{**data["meta"], "schema_version": SCHEMA_VERSION})
            sites = {}
            for s in data["sites"]:
                st = SiteStats(**s)
                sites[st.name] = st
            spans = [Span(**s) for s in data["spans"]]
            findings = [Finding(**f) for f in data["findings"]]
            edges = [(str(a), str(b)) for a, b in data["edges"]]
            advice = _advice(data.get("advice"))
            _check_fields(meta, sites, spans, findings, edges)
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportError(
                f"report is damaged or hand-edited ({type(exc).__name__}: {exc}); "
                "re-create it with `fp16lens scan`"
            ) from exc
        return cls(
            sites=sites, spans=spans, findings=findings, edges=edges, meta=meta, advice=advice
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=True)

    @classmethod
    def load(cls, path: str | Path) -> Report:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ReportError(
                f"cannot read report {path}: {exc.strerror}; check the path, or create a "
                "report with `fp16lens scan` (or fp16lens.watch) and report.save()"
            ) from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ReportError(
                f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); the file is "
                "truncated or was edited by hand: re-create it with `fp16lens scan`"
            ) from exc
        return cls.from_dict(data)

    def save(self, path: str | Path, **render_options: Any) -> Path:
        """Save as .json (data, exact round trip) or .html/.svg/.txt (the rendered view)."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix == ".json":
            text = self.to_json()
        elif suffix in (".html", ".svg", ".txt"):
            from fp16lens.report._render import export_text

            text = export_text(self, suffix[1:], **render_options)
        else:
            raise ReportError(
                f"cannot save a report as {suffix or 'a file without suffix'!r}; "
                "use .json, .html, .svg or .txt (or report.plot('x.png') for the plot)"
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # as export, patch and demo do
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise ReportError(
                f"cannot write {path}: {exc.strerror}; choose a writable location"
            ) from exc
        return path

    # ---- display ---------------------------------------------------------------------
    def __rich_console__(self, console, options):
        from fp16lens.report._render import render

        yield from render(self, console, options)

    def print(self, **render_options: Any) -> None:
        from fp16lens.report._render import print_report

        print_report(self, **render_options)

    def plot(self, path: str | Path | None = None, **options: Any):
        from fp16lens.report._plot import plot

        return plot(self, path, **options)

    def _repr_mimebundle_(self, include=None, exclude=None):
        from fp16lens.report._render import mimebundle

        return mimebundle(self)

    def __repr__(self) -> str:
        return (
            f"Report({self.meta.model_class or 'model'}: {len(self.sites)} sites, "
            f"{len(self.spans)} spans, {len(self.findings)} findings, "
            f"{self.meta.batches} batches)"
        )


# ---- validation of a loaded report (a hand-edited file fails here, not later) ----------

_NUMBERS = {
    SiteStats: (
        "order",
        "calls",
        "absmax",
        "absmax_batch",
        "numel",
        "zeros",
        "nonfinite",
        "overflow",
        "subnormal",
        "underflow",
        "saturated",
    ),
    Span: ("peak", "batches", "first_batch"),
    Finding: ("peak", "batch", "count"),
    ReportMeta: ("batches", "threshold"),
}
_TEXTS = {
    SiteStats: ("name", "kind", "op", "module"),
    Span: ("start", "peak_site", "fix"),
    Finding: ("site", "mechanism", "detail", "kind", "tensor", "fix"),
    ReportMeta: ("model_class",),
}
_LISTS = {SiteStats: ("hist", "shape"), Span: ("sites", "ends"), ReportMeta: ("input_shapes",)}
_DICTS = {ReportMeta: ("weights",)}


def _advice(data: Any) -> Advice | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"advice must be a mapping, got {data!r}")
    advice = Advice(**data)
    for name in (
        "regions",
        "islands",
        "reparametrized",
        "unresolved",
        "widened",
        "underflow_rules",
    ):
        rows = getattr(advice, name)
        if not (isinstance(rows, list) and all(isinstance(r, dict) for r in rows)):
            raise ValueError(f"advice.{name} must be a list of mappings, got {rows!r}")
    if not isinstance(advice.input_scales, dict) or not isinstance(advice.error, str):
        raise ValueError("advice.input_scales must be a mapping and advice.error a string")
    return advice


def _check_types(obj: Any) -> None:
    cls = type(obj)
    for f in _NUMBERS.get(cls, ()):
        v = getattr(obj, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{cls.__name__}.{f} must be a number, got {v!r}")
    for f in _TEXTS.get(cls, ()):
        if not isinstance(getattr(obj, f), str):
            raise ValueError(f"{cls.__name__}.{f} must be a string, got {getattr(obj, f)!r}")
    for f in _LISTS.get(cls, ()):
        if not isinstance(getattr(obj, f), list):
            raise ValueError(f"{cls.__name__}.{f} must be a list, got {getattr(obj, f)!r}")
    for f in _DICTS.get(cls, ()):
        if not isinstance(getattr(obj, f), dict):
            raise ValueError(f"{cls.__name__}.{f} must be a mapping, got {getattr(obj, f)!r}")


def _check_fields(meta, sites: dict, spans: list, findings: list, edges: list) -> None:
    """Types of every field, and spans and edges naming sites the report has."""
    for obj in (meta, *sites.values(), *spans, *findings):
        _check_types(obj)
    for name, row in meta.weights.items():
        if not (
            isinstance(row, list)
            and len(row) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row)
        ):
            raise ValueError(f"meta.weights[{name!r}] must be 4 numbers, got {row!r}")
    for span in spans:
        named = [
            span.start,
            span.peak_site,
            *span.sites,
            *span.ends,
            *([span.end] if span.end else []),
        ]
        unknown = [n for n in named if n not in sites]
        if unknown:
            raise ValueError(
                f"span at {span.start!r} names site {unknown[0]!r}, which the report lacks"
            )
    for a, b in edges:
        if a not in sites or b not in sites:
            raise ValueError(f"edge ({a!r}, {b!r}) names a site the report lacks")
