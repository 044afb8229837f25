"""The Exactness table: folding a power of two into the parameters versus the seed
article's runtime forms (warp_conv, warp_bn, the span formula), FP32 error against a
float64 truth for each factor p -- scripts/bench_patch.py's measurements, as rows."""

from __future__ import annotations

import bench_patch

COLUMNS = ("conv fold", "warp_conv", "bn fold", "warp_bn", "span fold", "span formula")


def exactness_rows() -> list[dict]:
    """One row per factor p: max|error| / max|truth| of each form."""
    rows = []
    for p in bench_patch.P_VALUES:
        errors = (
            *bench_patch.conv_errors(p),
            *bench_patch.bn_errors(p),
            *bench_patch.span_errors(p),
        )
        rows.append({"p": f"{p:g}", **{c: f"{e:.2e}" for c, e in zip(COLUMNS, errors)}})
    return rows
