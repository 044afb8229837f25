"""TensorRT's calibration cache: ``TRT-<version>-EntropyCalibration2`` then ``name: <hex>``.

Each line holds the tensor's INT8 scale (amax / 127) as the big-endian hex of its float32
bits, e.g. ``input: 3c010204``. TensorRT rejects a cache whose header names another
version (it then tries to recalibrate), so ``retag_cache`` rewrites the header for the
installed TensorRT before a build.
"""

from __future__ import annotations

import importlib.metadata
import re
import struct
from pathlib import Path

from fp16lens._core import ExportError

DEFAULT_TRT_VERSION = "10.0.0"
_HEADER = re.compile(r"^TRT-(\d+)-(\w+)$")
_NOT_A_CACHE = (
    "not a TensorRT calibration cache: the first line must read "
    "'TRT-<version>-<Calibrator>'. Regenerate it with export(..., precision='int8')."
)


def parse_version(version: str) -> tuple[int, int, int]:
    """``"10.12.0.36"`` -> (10, 12, 0); missing parts are 0."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:3]]
    if not parts:
        raise ValueError(f"not a TensorRT version: {version!r}")
    major, minor, patch = [*parts, 0, 0][:3]
    return major, minor, patch


def trt_version_number(version: str) -> int:
    """TensorRT's NV_TENSORRT_VERSION: major*1000+minor*100+patch before 10, major*10000+... from 10."""
    major, minor, patch = parse_version(version)
    return major * (10000 if major >= 10 else 1000) + minor * 100 + patch


def installed_trt_version() -> str | None:
    """The installed TensorRT's version, read from package metadata (nothing is imported)."""
    for dist in ("tensorrt", "tensorrt-cu12", "tensorrt-cu11", "tensorrt-cu13"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cache_header(version: str, algorithm: str = "EntropyCalibration2") -> str:
    return f"TRT-{trt_version_number(version)}-{algorithm}"


def format_calibration_cache(scales: dict[str, float], version: str) -> str:
    """The cache text for per-tensor ``scales`` (amax / 127)."""
    lines = [cache_header(version)]
    lines += [f"{name}: {struct.pack('>f', float(s)).hex()}" for name, s in scales.items()]
    return "\n".join(lines) + "\n"


def parse_calibration_cache(text: str) -> dict[str, float]:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines or not _HEADER.match(lines[0]):
        raise ExportError(_NOT_A_CACHE)
    scales = {}
    for line in lines[1:]:
        name, sep, value = line.rpartition(":")
        if not sep:
            raise ExportError(f"calibration cache line {line!r} is not 'tensor: <hex>'")
        scales[name.strip()] = struct.unpack(">f", bytes.fromhex(value.strip()))[0]
    return scales


def write_calibration_cache(
    path: str | Path, scales: dict[str, float], trt_version: str | None = None
) -> Path:
    """Write ``scales`` as a TensorRT cache for ``trt_version`` (default: installed, else 10.0)."""
    version = trt_version or installed_trt_version() or DEFAULT_TRT_VERSION
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # the ONNX file beside it makes it too
    path.write_text(format_calibration_cache(scales, version), encoding="utf-8")
    return path


def read_calibration_cache(path: str | Path) -> dict[str, float]:
    """Tensor name -> INT8 scale from a TensorRT calibration cache file."""
    return parse_calibration_cache(Path(path).read_text(encoding="utf-8"))


def retag_cache(text: str, version: str) -> str:
    """The same cache with its header naming TensorRT ``version``."""
    first, _, rest = text.lstrip().partition("\n")  # blank lines before the header: as parsed
    match = _HEADER.match(first.strip())
    if match is None:
        raise ExportError(_NOT_A_CACHE)
    return f"TRT-{trt_version_number(version)}-{match.group(2)}\n{rest}"
