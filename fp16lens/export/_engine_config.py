"""What a TensorRT build needs, decided from our options and the installed version (pure).

TensorRT >= 10.12 builds a strongly typed network from the typed ONNX (FP16 tensors and
Casts, or explicit Q/DQ); TensorRT 11 has no other way. Older versions are weakly typed:
FP16/INT8 builder flags, FP32 islands pinned per layer with OBEY_PRECISION_CONSTRAINTS,
and the calibration cache when the graph has no Q/DQ.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fp16lens._core import ExportError, OptionError
from fp16lens.export._calib_cache import parse_version

STRONGLY_TYPED_SINCE = (10, 12)
FLAGS_REMOVED_IN = 11


@dataclass(frozen=True)
class EngineConfig:
    """A TensorRT build, described without TensorRT."""

    strongly_typed: bool
    fp16: bool = False
    int8: bool = False
    precision_constraints: str | None = None  # "obey" when layers are pinned to FP32
    fp32_layers: tuple[str, ...] = ()  # ONNX node names whose layers stay FP32
    calibration_cache: Path | None = None


def engine_config(
    precision: str,
    trt_version: str,
    fp32_nodes: Iterable[str] = (),
    calibration_cache: str | Path | None = None,
    has_qdq: bool = False,
    strongly_typed: bool | None = None,
    fp16_rest: bool | None = None,
) -> EngineConfig:
    """The build for ``precision`` ("fp32" | "fp16" | "int8") on TensorRT ``trt_version``.
    ``fp16_rest`` False (an INT8 file whose check with its float parts in FP16 failed at
    export): a weakly typed INT8 build leaves FP16 off, so the float parts stay FP32 as
    the file was checked."""
    if precision not in ("fp32", "fp16", "int8"):
        raise OptionError(f"precision must be one of fp32, fp16, int8; got {precision!r}")
    version = parse_version(trt_version)
    typed = version >= STRONGLY_TYPED_SINCE if strongly_typed is None else strongly_typed
    if not typed and version[0] >= FLAGS_REMOVED_IN:
        raise ExportError(
            f"TensorRT {trt_version} builds strongly typed networks only; drop strongly_typed=False "
            "and build from the typed ONNX of export(precision='fp16' or 'int8')"
        )
    if typed:
        if precision == "int8" and not has_qdq:
            raise ExportError(
                "a strongly typed INT8 engine needs explicit Q/DQ nodes: build from the file "
                "written by export(..., precision='int8')"
            )
        return EngineConfig(strongly_typed=True)
    return _weakly_typed(precision, tuple(fp32_nodes), calibration_cache, has_qdq, fp16_rest)


def _weakly_typed(precision, fp32_nodes, cache, has_qdq, fp16_rest=None) -> EngineConfig:
    if precision == "int8" and not has_qdq and cache is None:
        raise ExportError(
            "INT8 from a graph without Q/DQ needs a calibration cache: pass "
            "calibration_cache=art.calibration_cache from export(..., precision='int8')"
        )
    reduced = precision in ("fp16", "int8")
    return EngineConfig(
        strongly_typed=False,
        fp16=reduced and not (precision == "int8" and fp16_rest is False),
        int8=precision == "int8",
        precision_constraints="obey" if fp32_nodes and reduced else None,
        fp32_layers=fp32_nodes if reduced else (),
        calibration_cache=Path(cache) if cache is not None and precision == "int8" else None,
    )


def layers_to_pin(layer_names: Iterable[str], fp32_nodes: Iterable[str]) -> list[str]:
    """TensorRT layers of the FP32 nodes: the ONNX parser names a node's layers after it
    (``node``, ``node_1``, ``node_output`` ...)."""
    nodes = set(fp32_nodes)
    pinned = []
    for name in layer_names:
        if name in nodes or any(
            name.startswith(f"{n}_") or name.startswith(f"{n} ") for n in nodes
        ):
            pinned.append(name)
    return pinned
