"""One report over torch.distributed ranks: gather every rank's report and merge."""

from __future__ import annotations

from fp16lens.report import Report
from fp16lens.report._merge import merge_reports


def enabled(setting: bool | str) -> bool:
    if setting is False:
        return False
    import torch.distributed as dist

    active = dist.is_available() and dist.is_initialized()
    return active if setting == "auto" else True


def merge_over_ranks(report: Report) -> Report:
    """Collective: every rank must call it; every rank gets the merged report."""
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report.to_dict())
    return merge_reports([Report.from_dict(d) for d in gathered])
