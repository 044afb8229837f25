"""An ONNX plan's FP16 FLOP share counts the graph's own conv arithmetic (it said 100% for
every ONNX plan, even with convs kept FP32). Checked against FLOPs computed from the conv
outputs ONNX Runtime produces, independently of the report."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import fp16lens
from fp16lens.demo import build_demo_model
from fp16lens.patch import PatchOptions
from fp16lens.patch.onnx import patch_onnx


def _conv_flops(proto, feeds) -> dict[str, float]:
    """Per Conv node: 2 x output elements x multiply-adds per output, the output sizes from
    running the graph with every conv output made a graph output (ONNX Runtime)."""
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    convs = [n for n in probe.graph.node if n.op_type == "Conv"]
    probe.graph.output.extend(onnx.ValueInfoProto(name=n.output[0]) for n in convs)
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [n.output[0] for n in convs]
    sizes = dict(zip(names, (a.size for a in sess.run(names, feeds[0]))))
    weights = {t.name: list(t.dims) for t in proto.graph.initializer}
    return {
        n.name: 2.0 * sizes[n.output[0]] * np.prod(weights[n.input[1]]) / weights[n.input[1]][0]
        for n in convs
    }


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
    flops = _conv_flops(proto, feeds)
    kept = [n for n in plan.fp32_modules if n in flops]
    assert kept  # the span's convs run FP32
    want = 1 - sum(flops[n] for n in kept) / sum(flops.values())
    assert plan.fp16_flop_share == pytest.approx(want, rel=1e-9)
    assert 0 < plan.fp16_flop_share < 1
