"""The one call from watch up to patch: the report's advice is patch's plan.

A report with problems is planned by fp16lens.patch's planner (``patch/_advise.py``) with
the model it was made from, so that what the report advises is what ``fp16lens.patch``
does (issue "one plan"). patch imports watch's tracing at module level, so this import
waits until a report is built.
"""

from __future__ import annotations

from fp16lens.report import Report


def advised(model, report: Report, enabled: bool = True) -> Report:
    """``report`` with patch's plan stored in it (``fp16lens.patch.advise``)."""
    if not enabled:
        return report
    from fp16lens.patch import advise

    return advise(model, report)
