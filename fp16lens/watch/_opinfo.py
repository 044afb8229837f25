"""What the recorder knows of an aten overload, worked out once per overload."""

from __future__ import annotations

from dataclasses import dataclass

from fp16lens._trace import FACTORY, MONOTONE, PASSTHROUGH, VALUE_PRESERVING, op_name


@dataclass(frozen=True)
class OpInfo:
    """What the recorder needs to know of an aten overload, worked out once."""

    name: str
    factory: bool
    passthrough: bool
    preserving: bool
    monotone: bool
    mutable: bool
    internal: bool
    fused: bool  # a fused kernel whose stored steps are recomputed (see _fused_kernels)
    single_source: bool  # a passthrough whose only float input is its first argument

    @classmethod
    def of(cls, func) -> OpInfo:
        from fp16lens.watch._fused_kernels import FUSED
        from fp16lens.watch._internal import CHECKS

        name = op_name(func)
        return cls(
            name=name,
            factory=name in FACTORY,
            passthrough=name in PASSTHROUGH,
            preserving=name in VALUE_PRESERVING,
            monotone=name in MONOTONE,
            mutable=bool(func._schema.is_mutable),
            internal=name in CHECKS,
            fused=name in FUSED,
            single_source=name in PASSTHROUGH and name != "copy",
        )
