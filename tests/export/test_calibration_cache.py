"""TensorRT's calibration cache format, checked against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fp16lens.export import ExportError, read_calibration_cache, write_calibration_cache
from fp16lens.export._calib_cache import (
    format_calibration_cache,
    parse_calibration_cache,
    retag_cache,
    trt_version_number,
)


def _ieee754(bits: int) -> float:
    """A float32 from its bit pattern, by the IEEE 754 formula (normal numbers)."""
    sign = -1.0 if bits >> 31 else 1.0
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return sign * math.ldexp(1.0 + mantissa / 2**23, exponent - 127)


@pytest.mark.parametrize(
    ("version", "number"),
    [("7.2.2", 7202), ("8.6.1", 8601), ("8.5.10", 8510), ("10.3.0.26", 100300), ("10.12", 101200)],
)
def test_version_number_as_tensorrt_writes_it(version, number):
    assert trt_version_number(version) == number


def test_a_cache_written_by_tensorrt_parses():
    # the MNIST sample's cache as TensorRT 7.2 wrote it
    text = "TRT-7202-EntropyCalibration2\ndata: 3c008912\nconv1: 3c60dd38\n"
    scales = parse_calibration_cache(text)
    assert scales == {"data": _ieee754(0x3C008912), "conv1": _ieee754(0x3C60DD38)}
    assert scales["data"] == pytest.approx(1 / 127.5, rel=1e-3)  # amax 1.0 -> 1/127


def test_scales_round_trip_exactly(tmp_path):
    scales = {
        "x": 1.0,
        "y": 2.0,
        "conv/out:0": float(np.float32(0.0123)),
        "z": float(np.float32(6.25e-5)),
    }
    path = write_calibration_cache(tmp_path / "c.cache", scales, trt_version="10.3.0")
    lines = path.read_text().splitlines()
    assert lines[:3] == ["TRT-100300-EntropyCalibration2", "x: 3f800000", "y: 40000000"]
    assert read_calibration_cache(path) == scales


def test_retag_changes_only_the_header():
    text = format_calibration_cache({"a": 0.5}, "8.6.1")
    assert text.startswith("TRT-8601-EntropyCalibration2\n")
    retagged = retag_cache(text, "10.8.0")
    assert retagged.splitlines() == ["TRT-100800-EntropyCalibration2", "a: 3f000000"]


def test_retag_reads_the_header_as_parse_does():
    # a blank line before the header: parse reads the cache, so retag must too (it raised
    # AttributeError on None.group, found by mypy); a text that is no cache: the named error
    text = "\n" + format_calibration_cache({"a": 0.5}, "8.6.1")
    assert parse_calibration_cache(text) == {"a": 0.5}
    retagged = retag_cache(text, "10.8.0")
    assert retagged.splitlines() == ["TRT-100800-EntropyCalibration2", "a: 3f000000"]
    assert parse_calibration_cache(retagged) == {"a": 0.5}
    with pytest.raises(ExportError, match="not a TensorRT calibration cache"):
        retag_cache("a: 3f800000\n", "10.8.0")


@pytest.mark.parametrize("text", ["", "a: 3f800000\n", "TRT-8601-EntropyCalibration2\nnocolon\n"])
def test_malformed_caches_raise_a_named_error(text):
    with pytest.raises(ExportError, match="calibration cache"):
        parse_calibration_cache(text)
