"""The report: plain data (JSON round trip) and its rich rendering."""

from fp16lens.report._advice import PATCH_SAYS, words_fix
from fp16lens.report._merge import merge_reports
from fp16lens.report._model import (
    HIST_BINS,
    HIST_MIN_EXP,
    MECHANISMS,
    SATURATED,
    SCHEMA_VERSION,
    Advice,
    Finding,
    Report,
    ReportMeta,
    SiteStats,
    Span,
)

__all__ = [
    "HIST_BINS",
    "HIST_MIN_EXP",
    "MECHANISMS",
    "PATCH_SAYS",
    "SATURATED",
    "SCHEMA_VERSION",
    "Advice",
    "Finding",
    "Report",
    "ReportMeta",
    "SiteStats",
    "Span",
    "merge_reports",
    "words_fix",
]
