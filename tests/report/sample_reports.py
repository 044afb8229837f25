"""Reports built by hand from the dataclasses, shaped like what fp16lens.watch produces.

Site names follow the watcher: module qualified names (``backbone.layer4.1.bn2``) and
functional ops as module plus aten op (``backbone.layer4.1:add``, ``:mul`` in the root).
"""

from __future__ import annotations

import itertools
import math

from fp16lens.report import Finding, Report, ReportMeta, SiteStats, Span


def site(name: str, op: str, order: int, absmax: float, **kw) -> SiteStats:
    kind = "op" if ":" in name else "module"
    module = name.split(":")[0] if kind == "op" else name
    return SiteStats(
        name=name,
        kind=kind,
        op=op,
        module=module,
        order=order,
        calls=kw.pop("calls", 1),
        absmax=absmax,
        absmax_batch=0,
        numel=kw.pop("numel", 1024),
        **kw,
    )


def _report(rows, spans=(), findings=(), edges=(), model_class="Net", batches=1) -> Report:
    sites = {}
    for i, (name, op, absmax, *extra) in enumerate(rows):
        sites[name] = site(name, op, i, absmax, **(extra[0] if extra else {}))
    meta = ReportMeta(
        model_class=model_class,
        batches=batches,
        torch_version="2.13.0",
        fp16lens_version="0.1.0",
        input_shapes=[[[1, 3, 64, 64]]] * batches,
    )
    return Report(
        sites=sites, spans=list(spans), findings=list(findings), edges=list(edges), meta=meta
    )


SEED_ROWS = [
    ("backbone.conv1", "Conv2d", 0.76),
    ("backbone.bn1", "BatchNorm2d", 0.76),
    ("backbone.relu", "ReLU", 0.56),
    ("backbone.maxpool", "MaxPool2d", 0.56),
    ("backbone.layer4.0.relu", "ReLU", 3.1),
    ("backbone.layer4.1.conv1", "Conv2d", 2.4),
    ("backbone.layer4.1.bn1", "BatchNorm2d", 1.9),
    ("backbone.layer4.1.relu", "ReLU", 271955.25),
    ("backbone.layer4.1.conv2", "Conv2d", 1.3),
    ("backbone.layer4.1.bn2", "BatchNorm2d", 271955.25),
    ("backbone.layer4.1:add", "add", 271955.25),
    ("neck.reduce_c5.0", "Conv2d", 83700.0),
    ("neck.reduce_c5.1", "BatchNorm2d", 4.8),
    ("neck:upsample_nearest2d", "upsample_nearest2d", 4.96),
    ("neck:add", "add", 49800.0),  # a near miss: 76% of the limit
    ("head.conv", "Conv2d", 2.2, {"subnormal": 100, "numel": 1000}),
]
SEED_EDGES = [
    ("backbone.conv1", "backbone.bn1"),
    ("backbone.bn1", "backbone.relu"),
    ("backbone.relu", "backbone.maxpool"),
    ("backbone.layer4.0.relu", "backbone.layer4.1.conv1"),
    ("backbone.layer4.0.relu", "backbone.layer4.1:add"),
    ("backbone.layer4.1.conv1", "backbone.layer4.1.bn1"),
    ("backbone.layer4.1.bn1", "backbone.layer4.1.relu"),
    ("backbone.layer4.1.relu", "backbone.layer4.1.conv2"),
    ("backbone.layer4.1.conv2", "backbone.layer4.1.bn2"),
    ("backbone.layer4.1.bn2", "backbone.layer4.1:add"),
    ("backbone.layer4.1:add", "backbone.layer4.1.relu"),
    ("backbone.layer4.1.relu", "neck.reduce_c5.0"),
    ("neck.reduce_c5.0", "neck.reduce_c5.1"),
    ("neck.reduce_c5.1", "neck:upsample_nearest2d"),
    ("neck:upsample_nearest2d", "neck:add"),
    ("neck:add", "head.conv"),
]
SEED_SPAN_SITES = [
    "backbone.layer4.1.bn2",
    "backbone.layer4.1:add",
    "backbone.layer4.1.relu",
    "neck.reduce_c5.0",
    "neck.reduce_c5.1",
]


def seed_span() -> Span:
    return Span(
        start="backbone.layer4.1.bn2",
        end="neck.reduce_c5.1",
        peak=271955.25,
        peak_site="backbone.layer4.1:add",
        sites=list(SEED_SPAN_SITES),
        ends=["neck.reduce_c5.1"],
        batches=1,
        first_batch=0,
    )


def seed_report() -> Report:
    """The seed article's case: a ResNet backbone's last block overflows into the FPN neck."""
    span = seed_span()
    findings = [
        Finding(
            site=span.start,
            mechanism="output",
            kind="overflow",
            peak=span.peak,
            batch=0,
            detail="values leave FP16 range at backbone.layer4.1.bn2 (peak 2.72e+05 at "
            "backbone.layer4.1:add, 4.2x the limit) and return at neck.reduce_c5.1",
        ),
        Finding(
            site="neck.reduce_c5.1",
            mechanism="parameter",
            kind="param-overflow",
            peak=1.43e9,
            tensor="running_var",
            count=32,
            detail="neck.reduce_c5.1.running_var: 32 of 32 values beyond FP16 (max 1.43e+09 "
            "> 65504); .half() makes them inf",
        ),
    ]
    return _report(SEED_ROWS, [span], findings, SEED_EDGES, model_class="TextDetector")


def clean_report() -> Report:
    rows = [
        ("features.0", "Conv2d", 1.4),
        ("features.1", "BatchNorm2d", 1.6),
        ("features.2", "ReLU", 1.6),
        ("pool", "AdaptiveAvgPool2d", 0.7),
        ("fc", "Linear", 2.5),
    ]
    edges = list(zip([r[0] for r in rows], [r[0] for r in rows[1:]]))
    return _report(rows, edges=edges, model_class="CleanNet", batches=2)


def _span(sites, peak, peak_site=None, ends=None, **kw) -> Span:
    ends = [sites[-1]] if ends is None else ends
    return Span(
        start=sites[0],
        end=None if kw.get("reaches_output") else (ends[0] if ends else None),
        peak=peak,
        peak_site=peak_site or sites[0],
        sites=list(sites),
        ends=list(ends),
        batches=kw.pop("batches", 1),
        first_batch=0,
        **kw,
    )


ALL_ROWS = [
    ("enc.fc1", "Linear", 76546.0),
    ("enc.act", "GELU", 76546.0),
    ("enc.fc2", "Linear", 231.0),
    ("enc.norm", "LayerNorm", 2.8),
    ("enc.gn", "GroupNorm", 3.0),
    ("enc.rms", "RMSNorm", 1.0),
    ("enc.conv", "Conv2d", 9.0e4),
    ("enc.bn", "BatchNorm2d", 1.1),
    ("enc.relu", "ReLU", 1.1),
    ("pool", "AdaptiveAvgPool2d", 20.0),
    ("enc:linalg_vector_norm", "linalg_vector_norm", 300.0),
    ("attn:exp", "exp", math.inf),
    ("attn:div", "div", 1.0),
    ("head.conv", "Conv2d", 1.5e5),
    ("head.bn", "BatchNorm2d", 1.5e5),
    (":log", "log", math.inf),
    ("out.fc", "Linear", 7.0e4),
]


def _all_spans() -> list[Span]:
    return [
        _span(["enc.fc1", "enc.act", "enc.fc2"], 76546.0),  # blocked by GELU: FP32 island
        _span(["enc.conv", "enc.bn"], 9.0e4, fused=True),  # only inside a conv+BN fusion
        _span(["head.conv", "head.bn", "out.fc"], 1.5e5, ends=[], reaches_output=True),
        _span([":log", "out.fc"], math.inf),  # inf already in FP32
    ]


def _all_findings() -> list[Finding]:
    f = Finding
    return [
        f("enc.fc1", "output", 76546.0, "values leave FP16 range at enc.fc1", "overflow", 0),
        f(
            "attn:exp",
            "output",
            math.inf,
            "exp overflows FP16 for arguments above 11.09",
            "softmax-exp",
            0,
        ),
        f(":log", "output", math.inf, ":log produces inf/NaN already in FP32", "nonfinite", 0),
        f(
            "enc.norm",
            "internal",
            2.53e6,
            "LayerNorm exported below opset 17 computes (x-mean)^2 "
            "in FP16 when decomposed: 2.53e+06 > 65504",
            "norm-variance",
            0,
            "LayerNorm",
        ),
        f(
            "enc.gn",
            "internal",
            1.0e5,
            "GroupNorm exported below opset 18 computes (x-mean)^2 in "
            "FP16 when decomposed: 1e+05 > 65504",
            "norm-variance",
            0,
            "GroupNorm",
        ),
        f(
            "enc.rms",
            "internal",
            9.0e4,
            "RMSNorm squares its input: x^2 up to 9e+04 > 65504",
            "rms-square",
            0,
            "RMSNorm",
        ),
        f(
            "pool",
            "internal",
            81981.3,
            "mean sums 4096 values before dividing: |sum| up to "
            "8.2e+04 > 65504, though the mean (20) fits",
            "sum-before-mean",
            0,
            "mean",
        ),
        f(
            "enc:linalg_vector_norm",
            "internal",
            9.0e4,
            "the vector norm sums x^2 before the square root: up to 9e+04 > 65504",
            "sum-of-squares",
            0,
            "vector norm",
        ),
        f(
            "enc.bn",
            "parameter",
            1.0e7,
            "enc.bn.running_var: 8 of 8 values beyond FP16 (max "
            "1e+07 > 65504); .half() makes them inf",
            "param-overflow",
            -1,
            "running_var",
            8,
        ),
        f(
            "enc.conv",
            "parameter",
            7.0e4,
            "enc.conv.weight: 3 of 216 values beyond FP16 (max "
            "7e+04 > 65504); .half() makes them inf",
            "param-overflow",
            -1,
            "weight",
            3,
        ),
        f(
            "head.conv",
            "parameter",
            math.nan,
            "head.conv.bias: 1 of 8 values beyond FP16 (max nan > 65504); .half() makes them inf",
            "param-overflow",
            -1,
            "bias",
            1,
        ),
        f(
            "enc.fc2",
            "parameter",
            1.0e-5,
            "enc.fc2.weight: 200 of 256 non-zero values are "
            "subnormal in FP16 (< 2^-14) and lose precision",
            "param-subnormal",
            -1,
            "weight",
            200,
        ),
        f(
            "enc.fc1",
            "parameter",
            1.0e-9,
            "enc.fc1.bias: 5 of 32 non-zero values are below 2^-24 and become 0 in FP16",
            "param-underflow",
            -1,
            "bias",
            5,
        ),
        f(
            "input[0]",
            "input",
            math.nan,
            "model input 0 holds inf/NaN (batch 1): a problem of "
            "the data, not of the model; FP16 inputs cannot carry it",
            "nonfinite",
            1,
            "",
            3,
        ),
        f(
            "input[1]",
            "input",
            2.0e5,
            "model input 1 holds values up to 2e+05 (batch 0): a "
            "problem of the data, not of the model; FP16 inputs cannot carry it",
            "overflow",
            0,
        ),
    ]


def all_kinds_report() -> Report:
    """Every mechanism and finding kind, inf and NaN peaks included."""
    edges = [(a[0], b[0]) for a, b in itertools.pairwise(ALL_ROWS)]
    return _report(
        ALL_ROWS, _all_spans(), _all_findings(), edges, model_class="Everything", batches=2
    )


def long_span_report(n: int = 20) -> Report:
    """One span through ``n`` conv/relu pairs, entering at a conv, leaving at a BN."""
    rows = [("stem", "Conv2d", 1e5)]
    for i in range(n):
        rows += [(f"blocks.{i}.relu", "ReLU", 1e5), (f"blocks.{i}.conv", "Conv2d", 1e5)]
    rows.append(("exit", "BatchNorm2d", 3.0))
    names = [r[0] for r in rows]
    span = _span(names, 1e5)
    return _report(rows, [span], edges=list(itertools.pairwise(names)), model_class="Deep")


def big_report(n: int = 10_000, spans: int = 40) -> Report:
    """A generated report with ``n`` sites: conv/BN/ReLU blocks, some spans through them."""
    ops = ("Conv2d", "BatchNorm2d", "ReLU")
    rows = []
    for i in range(n):
        absmax = 2.0 ** (((i * 7919) % 400) / 20.0 - 6.0)  # 2^-6 .. 2^14, deterministic
        rows.append(
            (f"stages.{i // 300}.blocks.{i % 300 // 3}.{ops[i % 3].lower()}", ops[i % 3], absmax)
        )
    out = []
    for j in range(spans):
        start = (j * n) // spans - (j * n // spans) % 3  # a conv
        names = [rows[start + d][0] for d in range(4)]  # conv, bn, relu, conv
        for d in range(3):
            rows[start + d] = (*rows[start + d][:2], 1.0e5 + j)
        out.append(_span(names, 1.0e5 + j))
    names = [r[0] for r in rows]
    return _report(rows, out, edges=list(itertools.pairwise(names)), model_class="Huge")


def long_names(report: Report) -> Report:
    """The report with transformer-long site names (the page must still fit them)."""
    import dataclasses

    new = {
        name: f"model.encoder.layers.{i}.self_attention.output_projection.{name}"
        for i, name in enumerate(report.sites)
    }

    def renamed(obj):
        changes = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, str) and v in new:
                changes[f.name] = new[v]
            elif isinstance(v, list) and v and all(isinstance(x, str) for x in v):
                changes[f.name] = [new.get(x, x) for x in v]
        return dataclasses.replace(obj, **changes)

    report.sites = {new[n]: dataclasses.replace(s, name=new[n]) for n, s in report.sites.items()}
    report.spans = [renamed(span) for span in report.spans]
    report.findings = [renamed(f) for f in report.findings]
    report.edges = [(new.get(a, a), new.get(b, b)) for a, b in report.edges]
    return report
