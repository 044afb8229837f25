"""Patch's kinds of the rescaling algebra: a view of ``fp16lens._core.algebra`` (which the
report's advice reads too). See ``Kind`` there for what each kind can do."""

from __future__ import annotations

from fp16lens._core.algebra import (
    ABSORB_IN,
    ABSORB_OUT,
    PASSES,
    Kind,
    module_kind,
    norm_has_affine,
    op_kind,
)

LINEAR, BN, NORM, HOMOG = Kind.LINEAR, Kind.BN, Kind.NORM, Kind.HOMOG
JOIN, BLOCK, OPAQUE, POWER = Kind.JOIN, Kind.BLOCK, Kind.OPAQUE, Kind.POWER

__all__ = ["ABSORB_IN", "ABSORB_OUT", "BLOCK", "BN", "HOMOG", "JOIN", "LINEAR", "NORM",
           "OPAQUE", "PASSES", "POWER", "module_kind", "norm_has_affine", "op_kind"]  # fmt: skip
