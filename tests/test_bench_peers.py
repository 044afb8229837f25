"""scripts/bench_peers.py's Fixing and Exactness tables, in reduced mode.

The Fixing table on the seed case: fp16lens keeps every Conv FLOP in FP16 and passes
onnx-fp16 parity, while the unfixed all-FP16 graph written by onnxconverter-common fails
it exactly where real FP16 (.half() on the CPU) overflows -- so the backend sees the
Casts other tools write. A peer that cannot be imported stays in the table as an error
row. FLOP counting is checked against hand-computed FLOPs of a hand-built graph.
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
bench_peers = importlib.import_module("bench_peers")
fixing = importlib.import_module("peers.fixing")
flops = importlib.import_module("peers.flops")

import models  # noqa: E402

COLUMNS = [
    "model",
    "tool",
    "FP16 FLOPs %",
    "parity",
    "cosine",
    "non-finite",
    "extra nodes",
    "FP32 nodes",
    "note",
]
TOOLS = list(fixing.tool_table(quick=True))


@pytest.fixture(scope="module")
def seed_result() -> dict:
    out = _run_main(["--quick", "--json", "--tables", "fixing,exactness", "--models", "seed_case"])
    return json.loads(out)


def _run_main(argv: list[str]) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bench_peers.main(argv) == 0
    return buf.getvalue()


def _row(rows: list[dict], tool: str) -> dict:
    (row,) = [r for r in rows if r["tool"] == tool]
    return row


def test_fixing_table_has_every_tool_as_a_row(seed_result):
    assert set(seed_result) == {"fixing", "exactness"}
    rows = seed_result["fixing"]
    assert [r["tool"] for r in rows] == TOOLS
    for r in rows:
        assert list(r) == COLUMNS
        measured = isinstance(r["FP16 FLOPs %"], float)
        assert measured or r["note"].startswith("error: "), r


def test_fp16lens_keeps_all_flops_in_fp16_and_passes_on_the_seed_case(seed_result):
    row = _row(seed_result["fixing"], "fp16lens patch")
    assert row["FP16 FLOPs %"] == 100.0
    assert row["parity"] == "pass" and row["non-finite"] is False
    assert row["cosine"] > 0.999


def test_unfixed_fp16_fails_where_real_fp16_overflows(seed_result):
    model, inputs = models.seed_case()
    with torch.no_grad():
        real = copy.deepcopy(model).half()(*(t.half() for t in inputs))
    assert not torch.isfinite(real).all()  # ground truth: real FP16 overflows
    row = _row(seed_result["fixing"], "no fix (all FP16)")
    if row["note"].startswith("error: "):
        pytest.skip(f"onnxconverter-common unavailable: {row['note']}")
    assert row["FP16 FLOPs %"] == 100.0
    assert row["parity"] == "FAIL" and row["non-finite"] is True


def test_exactness_rows_show_the_fold_never_worse_than_warp_conv(seed_result):
    rows = seed_result["exactness"]
    assert [r["p"] for r in rows] == ["8", "32", "256", "4096"]
    # at small p both errors are FP32 rounding, whose order depends on the CPU's BLAS (the
    # span form at p=8: 1.19e-07 against 1.04e-07 on one CPU); one FP32 ulp of slack, as
    # tests/patch/test_patch_baselines.py allows
    ulp = 2**-24
    for r in rows:
        assert float(r["conv fold"]) <= float(r["warp_conv"]) + ulp
        assert float(r["bn fold"]) <= float(r["warp_bn"]) + ulp
        assert float(r["span fold"]) <= float(r["span formula"]) + ulp
    assert float(rows[-1]["warp_conv"]) > 10 * float(rows[0]["warp_conv"])


def test_a_peer_that_cannot_be_imported_is_an_error_row(monkeypatch):
    for name in (
        "modelopt",
        "modelopt.onnx",
        "modelopt.onnx.autocast",
        "onnxconverter_common",
        "onnxconverter_common.float16",
    ):
        monkeypatch.setitem(sys.modules, name, None)
    rows = fixing.fixing_rows(["gelu_span"], quick=True)
    assert [r["tool"] for r in rows] == TOOLS
    peers = [r for r in rows if r["tool"] != "fp16lens patch"]
    for r in peers:
        assert r["note"].startswith("error: not installed"), r
        assert r["parity"] == "-"
    ours = _row(rows, "fp16lens patch")
    assert ours["parity"] == "pass" and ours["FP16 FLOPs %"] == 100.0


def _graph(fp16_gemm: bool):
    """x[1,3,8,8] -Conv(4,3,3,3 pad 1)-> [1,4,8,8] -Flatten-> [1,256] -Gemm(256->10)-> [1,10]
    -MatMul([10,5])-> [1,5]; the Gemm's inputs are FP16 when asked (Casts around it)."""
    h, tp = onnx.helper, onnx.TensorProto
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.random((4, 3, 3, 3), dtype=np.float32), "w"),
        onnx.numpy_helper.from_array(rng.random((10, 256), dtype=np.float32), "g"),
        onnx.numpy_helper.from_array(rng.random((10, 5), dtype=np.float32), "m"),
    ]
    nodes = [
        h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        h.make_node("Flatten", ["c"], ["f"], name="flat"),
    ]
    if fp16_gemm:
        nodes += [
            h.make_node("Cast", ["f"], ["f16"], to=tp.FLOAT16, name="c1"),
            h.make_node("Cast", ["g"], ["g16"], to=tp.FLOAT16, name="c2"),
            h.make_node("Gemm", ["f16", "g16"], ["y16"], transB=1, name="gemm"),
            h.make_node("Cast", ["y16"], ["y"], to=tp.FLOAT, name="c3"),
        ]
    else:
        nodes.append(h.make_node("Gemm", ["f", "g"], ["y"], transB=1, name="gemm"))
    nodes.append(h.make_node("MatMul", ["y", "m"], ["z"], name="mm"))
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", tp.FLOAT, [1, 3, 8, 8])],
        [h.make_tensor_value_info("z", tp.FLOAT, [1, 5])],
        inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


def test_flops_match_hand_counts_and_fp16_share():
    conv, gemm, mm = 2 * (4 * 8 * 8) * (3 * 3 * 3), 2 * 10 * 256, 2 * 5 * 10
    rows = flops.heavy_nodes(_graph(fp16_gemm=True))
    assert [(r.name, r.flops, r.fp16) for r in rows] == [
        ("conv", conv, False),
        ("gemm", gemm, True),
        ("mm", mm, False),
    ]
    assert flops.fp16_share(_graph(True)) == pytest.approx(gemm / (conv + gemm + mm))
    assert flops.fp16_share(_graph(False)) == 0.0
    assert flops.fp32_nodes(_graph(True)) == 3  # conv, flatten, matmul
