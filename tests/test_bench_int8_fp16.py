"""scripts/bench_int8.py ``--float-parts fp16``: the rows whose files type everything that
is not INT8 FP16 (``export(..., float_parts="fp16")``, ModelOpt's default), as TensorRT
computes them with FP16 beside INT8.

Ground truth without fp16lens: the file the row scores, read back, its FP16 tensors
computed in FP32 and rounded to FP16 after every node (``onnx_runs.rounded_twin``). ONNX
Runtime's CPU provider alone runs FP16 nodes in FP32 and drops the Casts between them, so
the file run as it is would hide FP16's rounding: the bench must not score it that way.
ModelOpt is not installed in CI; its FP16 rows are checked where it imports.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
bench = importlib.import_module("bench_int8")

import int8_zoo  # noqa: E402
from onnx_runs import rounded_twin  # noqa: E402


def test_a_typed_row_is_scored_as_its_file_rounds_in_fp16(tmp_path):
    """MTCNN PNet (trained, its first conv's input on the INT8 grid): the row's file types
    its float parts FP16, and the bench reads it as the rounded twin does, to the bit,
    where ONNX Runtime on the file as it is reads other values."""
    case = int8_zoo.MODELS["pnet"](4, 8)
    proto, note, _ = bench._fp16lens(case, fp16_parts=True)
    inferred = onnx.shape_inference.infer_shapes(proto)
    kinds = {v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    assert onnx.TensorProto.FLOAT16 in kinds and "bias corrected" in note
    path = str(tmp_path / "typed.onnx")
    onnx.save(proto, path)
    got = bench.as_typed(proto, case.eval)
    twin = int8_zoo.run_outputs(rounded_twin(path), case.eval)
    as_is = int8_zoo.run_outputs(proto, case.eval)
    hidden = 0
    for g, t, a in zip(got, twin, as_is):
        for x, y, z in zip(g, t, a):
            np.testing.assert_array_equal(x, y)
            hidden += int(np.sum(x != np.asarray(z, np.float32)))
    assert hidden > 0  # FP16's rounding, which the file run as it is leaves out


def test_the_fp16_mode_writes_fp16lens_rows_typed_and_beside_the_fp32_parts(tmp_path, capsys):
    """``--quick --models pnet --float-parts fp16``: fp16lens's all-INT8 row with FP32
    float parts first, then the same plan typed FP16, its target rows and the strictest
    target within 10%, each a typed file; the FP16 rows' INT8 FLOPs are counted on the
    typed file (its tensors FP16) as on the FP32 one."""
    out = tmp_path / "rows.json"
    args = ["--quick", "--models", "pnet", "--float-parts", "fp16", "--no-modelopt"]
    assert bench.main([*args, "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    fp16 = [m for m in rows if m.endswith(bench.FP16)]
    assert next(iter(rows)) == "fp16lens" and "fp16lens" + bench.FP16 in fp16
    assert any("strictest" in m for m in fp16) and any("+ target" in m for m in fp16)
    plain, typed = rows["fp16lens"], rows["fp16lens" + bench.FP16]
    assert typed["int8 flops"] == plain["int8 flops"] == 1.0
    assert typed["activation Q"] == plain["activation Q"]
    assert typed["cosine"] != plain["cosine"]  # FP16's rounding reaches the outputs


def test_modelopts_default_is_typed_fp16_and_scored_as_its_file_rounds(tmp_path):
    """ModelOpt's default (``high_precision_dtype`` left FP16), where nvidia-modelopt
    imports: the file types its float parts FP16, and the bench reads it as its rounded
    twin does (PNet, max calibration)."""
    if bench.modelopt_status():
        pytest.skip(bench.modelopt_status())
    case = int8_zoo.MODELS["pnet"](4, 8)
    proto, _ = bench._modelopt(case, "max", "fp16")
    inferred = onnx.shape_inference.infer_shapes(proto)
    kinds = {v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    assert onnx.TensorProto.FLOAT16 in kinds
    path = str(tmp_path / "modelopt.onnx")
    onnx.save(proto, path)
    got = bench.as_typed(proto, case.eval)
    twin = int8_zoo.run_outputs(rounded_twin(path), case.eval)
    for g, t in zip(got, twin):
        for x, y in zip(g, t):
            np.testing.assert_array_equal(x, y)
