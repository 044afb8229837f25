"""First site where a candidate's trace departs from its FP32 reference (pure)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fp16lens.verify._metrics import site_departs


def occurrences(
    records: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[tuple[str, int], torch.Tensor]]:
    """Each record keyed by (site, k): the k-th output of that site (a module called twice)."""
    seen: dict[str, int] = {}
    keyed = []
    for site, tensor in records:
        seen[site] = seen.get(site, 0) + 1
        keyed.append(((site, seen[site]), tensor))
    return keyed


def first_departure(reference, candidate, site_rel: float) -> str | None:
    """The first site (candidate's execution order) whose output departs from the
    reference's same site; sites missing in either trace, or of another shape, are skipped."""
    ref = dict(occurrences(reference))
    for key, tensor in occurrences(candidate):
        expected = ref.get(key)
        if expected is None or expected.shape != tensor.shape:
            continue
        if site_departs(expected, tensor, site_rel):
            return key[0]
    return None
