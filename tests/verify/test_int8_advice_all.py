"""verify's INT8 failure advice measures every activation quantizer (PP-OCRv4's detector,
as ONNX Runtime quantizes it, has 331: the advice used to stop at the first 64)."""

from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import int8_zoo  # noqa: E402
from zoo_real import Missing  # noqa: E402


@pytest.mark.slow
def test_int8_advice_ranks_every_quantizer(tmp_path):
    import torch

    from fp16lens.export._int8 import _quantize_ort, prepared
    from fp16lens.verify import verify
    from fp16lens.verify._int8_advice import _activation_pairs, _cosine, sensitivities
    from fp16lens.verify._onnx import OnnxInt8

    try:
        case = int8_zoo.detector(2, 1)
    except Missing as exc:
        pytest.skip(str(exc))
    path = tmp_path / "det_int8.onnx"
    onnx.save(_quantize_ort(prepared(onnx.load(case.path)), list(case.cal), []), str(path))
    runner = OnnxInt8(path)
    ((_, x),) = case.eval[0].items()
    batch = (torch.from_numpy(x),)
    (ref,) = int8_zoo.run_outputs(case.path, case.eval)
    reference = [("out", torch.from_numpy(ref[0]))]
    pairs = _activation_pairs(runner.proto.graph)
    costs = sensitivities(runner, [(batch, reference)])
    assert len(costs) == len(pairs) > 64
    assert [c.cosine for c in costs] == sorted(c.cosine for c in costs)
    # the switch graph's cost of the worst pair is that pair alone, computed as written
    worst = costs[0]
    alone = _cosine(runner, _only(runner.proto, worst.tensor), [(batch, reference)])
    assert alone == pytest.approx(worst.cosine, abs=1e-4)
    result = verify(case.path, str(path), [batch], backend="onnx-int8")
    assert not result.passed and any("cost most" in a for a in result.advice)


def _only(proto, keep: str):
    """A copy where every activation Q/DQ pair but the one dequantizing to ``keep`` passes
    its FP32 input on (an Identity)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    inits = {i.name for i in model.graph.initializer}
    made = {n.output[0]: n for n in model.graph.node if n.op_type == "QuantizeLinear"}
    for node in model.graph.node:
        q = made.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if q is None or q.input[0] in inits or node.output[0] == keep:
            continue
        node.op_type = "Identity"
        del node.input[:]
        node.input.append(q.input[0])
        del node.attribute[:]
    return model
