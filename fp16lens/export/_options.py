"""Export options: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from fp16lens._core import OptionError

PRECISIONS = ("fp32", "fp16", "int8")
IO_DTYPES = ("fp32", "fp16")
EXPORTERS = ("auto", "dynamo", "torchscript")
MIN_OPSET = 17
"""LayerNormalization is one node from opset 17 on (GroupNormalization from 18/21)."""


@dataclass(frozen=True)
class ExportOptions:
    """What ``export`` produces.

    ``fp32_modules`` are module qualified names that stay FP32 (the plan's islands);
    ``io_dtype`` is the dtype of float graph inputs/outputs in an FP16 export;
    ``exporter`` picks torch's dynamo exporter, the TorchScript one, or dynamo with a
    TorchScript fallback ("auto"); ``opset`` None keeps the exporter's default; ``dynamic``
    names the symbolic axes ("batch": dimension 0 of inputs and outputs, "sequence":
    dimension 1 of inputs of rank 2 or 3).
    """

    precision: str = "fp16"
    io_dtype: str = "fp32"
    fp32_modules: tuple[str, ...] = ()
    opset: int | None = None
    exporter: str = "auto"
    dynamic: tuple[str, ...] = ()

    def __post_init__(self):
        from fp16lens.export._io import check_dynamic

        object.__setattr__(self, "dynamic", check_dynamic(self.dynamic))
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("io_dtype", self.io_dtype, IO_DTYPES)
        _one_of("exporter", self.exporter, EXPORTERS)
        if self.opset is not None and (not isinstance(self.opset, int) or self.opset < MIN_OPSET):
            raise OptionError(
                f"opset must be an int >= {MIN_OPSET} (LayerNorm stays one node), got {self.opset!r}"
            )
        if isinstance(self.fp32_modules, str) or not all(
            isinstance(m, str) for m in self.fp32_modules
        ):
            raise OptionError(
                f"fp32_modules must be a list of module names, got {self.fp32_modules!r}"
            )
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise OptionError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
