"""An ONNX plan's FP16 FLOP share counts the graph's own conv arithmetic (it said 100% for
every ONNX plan, even with convs kept FP32). Checked against FLOPs computed from ONNX's
shape inference, independently of the report."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import fp16lens
from fp16lens.demo import build_demo_model
from fp16lens.patch import PatchOptions
from fp16lens.patch.onnx import patch_onnx


def _conv_flops(proto) -> dict[str, float]:
    """Per Conv node: 2 x output elements x multiply-adds per output (shape inference)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(proto)
    shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*inferred.graph.value_info, *inferred.graph.output]
    }
    weights = {t.name: list(t.dims) for t in proto.graph.initializer}
    out = {}
    for node in proto.graph.node:
        if node.op_type == "Conv":
            w = weights[node.input[1]]
            out[node.name] = 2.0 * np.prod(shapes[node.output[0]]) * np.prod(w) / w[0]
    return out


def test_an_onnx_plan_counts_the_flops_it_keeps_fp32(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    model, (x,) = build_demo_model()
    raw = (x - x.min()) / (x.max() - x.min()) * 255  # the span whose convs stay FP32
    fp16lens.export(model, (x,), tmp_path / "m.onnx", "fp32")
    proto = onnx.load(str(tmp_path / "m.onnx"))
    feeds = [{proto.graph.input[0].name: raw.numpy()}]
    report = fp16lens.scan(str(tmp_path / "m.onnx"), feeds, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, plan = patch_onnx(str(tmp_path / "m.onnx"), report, PatchOptions(), batches=feeds)
    flops = _conv_flops(proto)
    kept = [n for n in plan.fp32_modules if n in flops]
    assert kept  # the span's convs run FP32
    want = 1 - sum(flops[n] for n in kept) / sum(flops.values())
    assert plan.fp16_flop_share == pytest.approx(want, rel=1e-9)
    assert 0 < plan.fp16_flop_share < 1
