"""A PyTorch model's INT8 file whose float parts fail in FP16 is made again from its
exported FP32 graph patched for FP16 first (``fp16lens/export/_int8_fp16_fix.py``; the
ONNX source's case, Silero VAD, is in ``test_loop_decoder_int8.py``).

The model is fp16lens's built-in demo text detector (its batch norms grown until FP16
overflows inside the backbone) on its rendered document pages: calibrated on four,
checked on two others. Ground truth without fp16lens: the model itself in real FP16
(``.half()`` on the CPU) loses its output; the file the user takes home is read back and
run in plain ONNX Runtime, as written and with every tensor a node writes stored in FP16.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def _session(graph):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(graph.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) or 1.0))


def test_a_pytorch_models_int8_file_failing_in_fp16_is_made_again_patched(tmp_path):
    from fp16lens.demo._build import build_demo_model, document_pages
    from fp16lens.export import export
    from fp16lens.export._engine_config import engine_config
    from fp16lens.export._onnx_meta import fp16_rest_holds
    from fp16lens.patch.onnx._fp16 import fp16_storage

    model, (x,) = build_demo_model()
    pages = document_pages(6)
    cal = [pages[i : i + 1] for i in range(4)]
    held = [pages[i : i + 1] for i in range(4, 6)]
    with torch.no_grad():
        want = [model(p).numpy() for p in held]
        half = [copy.deepcopy(model).half()(p.half()).float().numpy() for p in held]
    assert not all(np.isfinite(h).all() and _cosine(w, h) > 0.99 for w, h in zip(want, half))
    out = tmp_path / "demo_int8.onnx"
    art = export(
        model, (x,), out, "int8", calibration=cal, evaluation=held, target=0.997, max_fallback=0.6
    )
    (note,) = [w for w in art.warnings if w.startswith("with its float parts in FP16")]
    assert "that graph was patched for FP16 first" in note and "quantized again" in note, note
    assert art.path == out and art.parity.passed and art.int8["float_parts_fp16"]["passed"]
    written = onnx.load(out)
    assert fp16_rest_holds(written) is True
    assert engine_config("int8", "10.3.0", has_qdq=True, fp16_rest=True).fp16
    assert sum(n.op_type == "QuantizeLinear" for n in written.graph.node) >= 10
    for graph in (written, fp16_storage(written, initializers=False)[0]):
        sess = _session(graph)
        for p, w in zip(held, want):
            (got,) = sess.run(None, {sess.get_inputs()[0].name: p.numpy()})
            assert np.isfinite(got).all() and _cosine(w, got) >= 0.99
