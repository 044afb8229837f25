"""Machine-readable summaries (``--json``) of reports and results: plain dicts."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fp16lens.report import Report


def report_summary(report: Report, full: bool = False) -> dict[str, Any]:
    """Verdict, spans and findings (``full``: every site too, the whole saved report)."""
    if full:
        return {"clean": report.clean, **report.to_dict()}
    worst = report.worst_headroom
    return {
        "model": report.meta.model_class,
        "batches": report.meta.batches,
        "clean": report.clean,
        "sites": len(report.sites),
        "worst_headroom_bits": worst if math.isfinite(worst) else None,
        "spans": [dataclasses.asdict(s) for s in report.spans],
        "findings": [dataclasses.asdict(f) for f in report.findings],
    }


PARITY_FIELDS = ("cosine", "max_abs", "max_rel", "sqnr_db", "first_divergence", "nonfinite")


def parity_summary(result: Any) -> dict[str, Any]:
    """A verify() result as a dict: ``passed`` plus its metrics (missing ones are None)."""
    if hasattr(result, "to_dict"):
        return {**result.to_dict(), "passed": bool(result)}
    out: dict[str, Any] = {"passed": bool(result)}
    for name in PARITY_FIELDS:
        out[name] = getattr(result, name, None)
    return out


def to_plain(obj: Any) -> Any:
    """A result object as plain data: its to_dict(), its dataclass fields, or its str()."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return str(obj)
