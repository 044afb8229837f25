"""The rescaling algebra's op classes as the report reads them: a view of
``fp16lens._core.algebra``, which patch reads too, so what the report suggests is what
patch can do. ``SiteStats.op`` is a module class ("Conv2d", "ReLU") or an aten op ("add").
"""

from __future__ import annotations

from fp16lens._core.algebra import JOINS, Kind, OpClass, is_join, module_name_kind, op_class

ABSORBING, HOMOGENEOUS, INVARIANT, BLOCKING = (
    OpClass.ABSORBING,
    OpClass.HOMOGENEOUS,
    OpClass.INVARIANT,
    OpClass.BLOCKING,
)

__all__ = ["ABSORBING", "BLOCKING", "HOMOGENEOUS", "INVARIANT", "JOINS", "is_batch_norm",
           "is_join", "op_class"]  # fmt: skip


def is_batch_norm(op: str) -> bool:
    """A batch norm module's class name, or the functional ``batch_norm``."""
    return op.lower() == "batch_norm" or module_name_kind(op) is Kind.BN
