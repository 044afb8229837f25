"""The ONNX backends. Ground truth: real FP16 in torch, and explicit FP16 computations."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fp16lens._core.compat import TORCH_VERSION  # noqa: E402
from fp16lens.export import export  # noqa: E402
from fp16lens.verify import verify  # noqa: E402
from fp16lens.verify._onnx import OnnxRunner  # noqa: E402

from models import clean  # noqa: E402


def plain_ort(path, feed):
    """The artifact in ONNX Runtime as anybody would run it (CPU, default options)."""
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.fixture(scope="module")
def seed_fp16(tmp_path_factory, seed):
    model, inputs = seed[0], seed[1]
    path = tmp_path_factory.mktemp("verify") / "seed_fp16.onnx"
    export(model, inputs, path, precision="fp16")
    return model, inputs, path, verify(model, path, inputs)  # onnx-fp16: the default for a path


DYNAMO_NAMES = pytest.mark.skipif(
    TORCH_VERSION < (2, 5),
    reason="names as the dynamo exporter writes them; torch 2.4 exports through TorchScript, "
    "which folds bn2 into a conv named for conv2 and its weight onnx::Conv_N",
)


def test_plain_onnxruntime_hides_the_overflow_the_backend_shows(seed_fp16, seed):
    _, inputs, path, result = seed_fp16
    real, first_inf = seed[2], seed[3]
    assert not torch.isfinite(real).all()  # real FP16 storage overflows
    (plain,) = plain_ort(path, {"x": inputs[0].numpy()})
    assert np.isfinite(plain).all()  # ORT CPU computes in FP32 and hides it
    assert result.backend == "onnx-fp16"
    assert not result and result.nonfinite
    assert first_inf[0] == "backbone.layer4.1.bn2"
    # TorchScript (torch 2.4) folds bn2 into the conv and names the node for conv2
    named = ("backbone.layer4.1.bn2",) + (
        ("backbone.layer4.1.conv2",) if TORCH_VERSION < (2, 5) else ()
    )
    assert result.first_divergence in named


@DYNAMO_NAMES
def test_first_divergence_tensor_is_the_folded_conv_output(seed_fp16):
    _, _, path, result = seed_fp16
    graph = onnx.load(str(path)).graph
    node = next(n for n in graph.node if result.first_divergence_tensor in n.output)
    # The exporter folded bn2 into the conv: the conv computes bn2's output.
    assert node.op_type == "Conv" and node.input[1] == "backbone.layer4.1.conv2.weight"


def test_clean_model_passes_on_onnx_fp16(tmp_path):
    model, inputs = clean()
    path = tmp_path / "clean.onnx"
    export(model, inputs, path, precision="fp16")
    result = verify(model, path, inputs)
    with torch.no_grad():
        real = copy.deepcopy(model).half()(inputs[0].half()).float()
    assert result and result.first_divergence is None
    # Storage-rounded ONNX is as close to FP32 as real FP16 is.
    assert result.max_abs <= 4 * float((real - model(*inputs).detach()).abs().max()) + 1e-3


def decomposed_layernorm(path, width: int):
    """LayerNorm as an opset<17 export writes it, all in FP16: ReduceMean, Sub, Pow(2),
    ReduceMean, Add(eps), Sqrt, Div."""
    h = helper
    nodes = [
        h.make_node("ReduceMean", ["x"], ["mean"], axes=[-1], name="mean"),
        h.make_node("Sub", ["x", "mean"], ["d"], name="sub"),
        h.make_node("Pow", ["d", "two"], ["sq"], name="pow"),
        h.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], name="var"),
        h.make_node("Add", ["var", "eps"], ["ve"], name="add"),
        h.make_node("Sqrt", ["ve"], ["std"], name="sqrt"),
        h.make_node("Div", ["d", "std"], ["y"], name="div"),
    ]
    consts = [
        numpy_helper.from_array(np.array(2.0, np.float16), "two"),
        numpy_helper.from_array(np.array(1e-5, np.float16), "eps"),
    ]
    f16 = TensorProto.FLOAT16
    graph = h.make_graph(
        nodes,
        "ln",
        [h.make_tensor_value_info("x", f16, [2, width])],
        [h.make_tensor_value_info("y", f16, [2, width])],
        consts,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)], ir_version=8)
    model.ir_version = 8
    onnx.save(model, str(path))


def test_decomposed_layernorm_overflows_inside_like_explicit_fp16(tmp_path):
    path = tmp_path / "ln.onnx"
    decomposed_layernorm(path, 8)
    x = torch.tensor([[0.0] * 4 + [600.0] * 4, [0.0] * 4 + [100.0] * 4])
    # Explicit FP16 computation: |x - mean| = 300 > 255.9, so the square overflows.
    h = x.half()
    d = h - h.mean(-1, keepdim=True)
    truth = d / (d.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert not torch.isfinite(d.pow(2)).all() and torch.isfinite(d.pow(2)[1]).all()
    (plain,) = plain_ort(path, {"x": x.numpy().astype(np.float16)})
    assert np.isfinite(plain).all()  # hidden by FP32 compute inside ORT
    runner = OnnxRunner(path)
    (out,) = runner.run((x,))
    assert torch.equal(torch.isfinite(out), torch.isfinite(truth.float()))
    torch.testing.assert_close(out[1], truth[1].float(), rtol=2e-3, atol=1e-3)
    site, tensor = runner.locate((x,), site_rel=0.05)
    assert site == tensor == "sq"  # no module metadata: the ONNX tensor names the site


def test_onnx_int8_backend_computes_the_qdq_graph_as_written(tmp_path):
    """onnx-int8 is the Q/DQ graph's own arithmetic (ONNX Runtime's fused INT8 kernels off):
    the same numbers as the graph run with every optimization disabled, and a clean model
    passes the default 0.99 cosine (TensorRT's int8 products with int32 sums are exact)."""
    model, inputs = clean()
    path = tmp_path / "clean_int8.onnx"
    export(model, inputs, path, precision="int8", calibration=[inputs, (inputs[0] * 0.9,)])
    result = verify(model, path, inputs, backend="onnx-int8")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    feed = {i.name: inputs[0].numpy() for i in onnx.load(str(path)).graph.input}
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (as_written,) = sess.run(None, feed)
    expected = float(
        torch.nn.functional.cosine_similarity(
            torch.from_numpy(as_written).double().flatten(),
            model(*inputs).detach().double().flatten(),
            dim=0,
        )
    )
    assert result.cosine == pytest.approx(expected, abs=1e-6)
    assert result.tolerance.min_cosine == 0.99
    assert result, result


@pytest.mark.slow
def test_patched_seed_case_passes_on_onnx_fp16(seed, tmp_path):
    """watch -> patch -> FP16 ONNX -> verify: the whole journey, on the runtime that shows overflow."""
    import fp16lens
    from fp16lens.patch import patch

    model, inputs, _, _ = seed
    with fp16lens.watch(model) as lens:
        model(*inputs)
    patched = patch(model, lens.report)
    path = tmp_path / "seed_patched.onnx"
    export(patched, inputs, path, precision="fp16")
    result = verify(model, path, inputs)
    assert result, result.failures()
    assert result.cosine >= 0.9999 and result.first_divergence is None


def _kept_above(path, threshold: float, length: str = "n"):
    """x (1, 8) -> the values above ``threshold``, (1, N): an output whose length the graph
    leaves to the data, as a decoder's steps (SLANet-plus's Loop) or an NMS's boxes."""
    t = numpy_helper.from_array(np.array(threshold, np.float32), "t")
    graph = helper.make_graph(
        [
            helper.make_node("Greater", ["x", "t"], ["mask"]),
            helper.make_node("Squeeze", ["mask", "zero"], ["flat"]),
            helper.make_node("Compress", ["x", "flat"], ["y"], axis=1),
        ],
        "kept",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, length])],
        [t, numpy_helper.from_array(np.array([0], np.int64), "zero")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return str(path)


def test_an_output_of_data_dependent_length_that_changes_fails_on_its_length(tmp_path):
    """A candidate that moves one value across a threshold returns one more element on the
    axis the graph leaves to the data: verify compares the two zero-padded and fails it,
    naming the change, instead of refusing the candidate as another model's (what the INT8
    check of SLANet-plus's Loop decoder raised); where no value moves it passes, and a
    fixed axis that differs is still the wrong candidate."""
    from fp16lens._core import VerifyError

    ref = _kept_above(tmp_path / "ref.onnx", 0.5)
    cand = _kept_above(tmp_path / "cand.onnx", 0.45)
    moved = torch.tensor([[0.9, 0.1, 0.47, 0.6, 0.2, 0.8, 0.0, 0.3]])
    result = verify(ref, cand, [(moved,)], backend="onnx-fp16")
    assert not result.passed
    (why,) = [w for w in result.failures() if "length" in w]
    assert "reference (1, 3), candidate (1, 4)" in why, result.failures()
    m = next(iter(result.outputs.values()))
    assert m.shape_change and m.cosine < 0.99  # the extra 0.47 counted against zeros
    assert result.to_dict()["outputs"]["y"]["shape_change"] == m.shape_change  # JSON
    # export's check of a written INT8 file says so in its one line
    from fp16lens.export._export import _why

    assert "the length of y (reference (1, 3), candidate (1, 4)) changes" in _why(result)
    still = torch.tensor([[0.9, 0.1, 0.4, 0.6, 0.2, 0.8, 0.0, 0.3]])
    assert verify(ref, cand, [(still,)], backend="onnx-fp16").passed
    fixed = _kept_above(tmp_path / "fixed.onnx", 0.45, length=4)  # declared 4: not free
    with pytest.raises(VerifyError, match="output shapes differ"):
        verify(ref, fixed, [(moved,)], backend="onnx-fp16")
