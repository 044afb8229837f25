"""What each model input was: its name, dtype, shape and value range over all forwards,
kept in ``ReportMeta.inputs`` so that patch can check a model without the caller's
batches on inputs like them (token ids stay integers within the vocabulary)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

_SCALARS = (bool, int, float, str, type(None))


def _entry(name: str, v: Any) -> dict | None:
    if isinstance(v, np.ndarray):
        v = torch.from_numpy(v)
    if torch.is_tensor(v):
        lo = hi = 0.0
        if v.numel() and v.device.type != "meta":
            with torch.no_grad():
                w = v.detach()
                w = w.int() if w.dtype == torch.bool else w
                w = w.float() if w.is_complex() else w
                if w.is_floating_point():
                    w = torch.nan_to_num(w.float(), posinf=3.4e38, neginf=-3.4e38)
                lo, hi = (float(e) for e in torch.aminmax(w))  # one pass, one host sync
        return {
            "name": name,
            "dtype": str(v.dtype).removeprefix("torch."),
            "shape": list(v.shape),
            "min": lo,
            "max": hi,
        }
    if isinstance(v, _SCALARS):
        return {"name": name, "dtype": "python", "shape": [], "min": 0.0, "max": 0.0, "value": v}
    return {"name": name, "dtype": "object", "shape": [], "min": 0.0, "max": 0.0}


def describe_inputs(args, kwargs) -> list[dict]:
    """One entry per top-level positional input ("0", "1", ...) and keyword input."""
    out = [_entry(str(i), a) for i, a in enumerate(args or ())]
    out += [_entry(str(k), v) for k, v in (kwargs or {}).items()]
    return [e for e in out if e is not None]


def merge_inputs(seen: list[dict], new: list[dict]) -> list[dict]:
    """``seen`` with the ranges of ``new`` folded in (the first forward's shapes kept)."""
    if not seen:
        return [dict(e) for e in new]
    by_name = {e["name"]: e for e in seen}
    for e in new:
        old = by_name.get(e["name"])
        if old is None:
            seen.append(dict(e))
        elif old["dtype"] == e["dtype"]:
            old["min"] = min(old["min"], e["min"]) if math.isfinite(e["min"]) else old["min"]
            old["max"] = max(old["max"], e["max"]) if math.isfinite(e["max"]) else old["max"]
    return seen
