"""Export options: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp16lens._core import OptionError

PRECISIONS = ("fp32", "fp16", "int8")
IO_DTYPES = ("fp32", "fp16")
FLOAT_PARTS = ("fp32", "fp16")
EXPORTERS = ("auto", "dynamo", "torchscript")
MIN_OPSET = 17
"""LayerNormalization is one node from opset 17 on (GroupNormalization from 18/21)."""


@dataclass(frozen=True)
class ExportOptions:
    """What ``export`` produces; pass ``options=ExportOptions(...)`` or the same fields as
    keywords of ``export``.

    ``precision``: "fp32", "fp16" (strongly typed) or "int8" (Q/DQ). ``io_dtype``: the dtype
    of float graph inputs/outputs in an FP16 export. ``fp32_modules``: module qualified
    names that stay FP32, besides the patch plan's islands; ``fp32_nodes``: node names that
    stay FP32 when the source is an ONNX file. ``opset``: None keeps the exporter's default.
    ``exporter``: torch's dynamo exporter, the TorchScript one, or dynamo with a TorchScript
    fallback ("auto"). ``dynamic``: the symbolic axes ("batch": dimension 0 of inputs and
    outputs, "sequence": dimension 1 of inputs of rank 2 or 3). ``calibration_cache``: where
    an INT8 export writes TensorRT's calibration cache (default: next to the file).
    ``target``: the INT8 parity target, a worst output cosine such as 0.999 or
    ``Int8Target(threshold, metric)``. ``max_fallback``: with a target, the share of the
    conv/gemm/matmul FLOPs the fallback may keep out of INT8 (default 0.1) before the
    export fails. ``float_parts``: in an INT8 file, the type of every tensor that is not
    INT8: "fp32" (a strongly typed TensorRT build computes them in FP32) or "fp16" (typed
    FP16 as ModelOpt's default writes them, opset 19 or later; checked like the file).
    """

    precision: str = "fp16"
    io_dtype: str = "fp32"
    fp32_modules: tuple[str, ...] = ()
    opset: int | None = None
    exporter: str = "auto"
    dynamic: tuple[str, ...] = ()
    fp32_nodes: tuple[str, ...] | None = None
    calibration_cache: str | Path | None = None
    target: object = None
    max_fallback: float | None = None
    float_parts: str = "fp32"

    def __post_init__(self):
        from fp16lens.export._io import check_dynamic

        object.__setattr__(self, "dynamic", check_dynamic(self.dynamic))
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("io_dtype", self.io_dtype, IO_DTYPES)
        _one_of("exporter", self.exporter, EXPORTERS)
        _one_of("float_parts", self.float_parts, FLOAT_PARTS)
        if self.float_parts != "fp32" and self.precision != "int8":
            raise OptionError(
                "float_parts= types the float parts of an INT8 file; give precision='int8' "
                "(precision='fp16' types the whole graph FP16)"
            )
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
        if self.max_fallback is not None:
            share = self.max_fallback
            if (
                isinstance(share, bool)
                or not isinstance(share, (int, float))
                or not 0 <= share <= 1
            ):
                raise OptionError(
                    f"max_fallback must be a share of the FLOPs in [0, 1] (0.25: a quarter "
                    f"may leave INT8), got {share!r}"
                )
        if self.fp32_nodes is not None:
            if isinstance(self.fp32_nodes, str) or not all(
                isinstance(n, str) for n in self.fp32_nodes
            ):
                raise OptionError(
                    f"fp32_nodes must be a list of node names, got {self.fp32_nodes!r}"
                )
            object.__setattr__(self, "fp32_nodes", tuple(self.fp32_nodes))


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise OptionError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
