"""The report: plain data (JSON round trip) and its rich rendering."""

from fp16lens.report._model import (
    SCHEMA_VERSION,
    Finding,
    Report,
    ReportMeta,
    SiteStats,
    Span,
)

__all__ = ["SCHEMA_VERSION", "Finding", "Report", "ReportMeta", "SiteStats", "Span"]
