"""verify() with an FP32 ONNX file as the reference (run in ONNX Runtime): the parity a
PyTorch reference gives, and the verdict real FP16 gives.

Ground truth: real FP16 in torch (``copy.deepcopy(model).half()``, the ``seed`` fixture)
for the models the ONNX files were exported from.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import fp16lens  # noqa: E402
from fp16lens._core import VerifyError  # noqa: E402
from fp16lens.export import export  # noqa: E402

import models  # noqa: E402


def to_onnx(model, inputs, path, opset: int = 17) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, str(path), opset_version=opset, dynamo=False)
    return str(path)


@pytest.fixture(scope="module")
def clean_pair(tmp_path_factory):
    model, inputs = models.clean()
    folder = tmp_path_factory.mktemp("ref")
    path = to_onnx(model, inputs, folder / "clean.onnx", 13)
    return model, inputs, path, export(path, None, folder / "clean16.onnx").path


def test_onnx_reference_gives_the_parity_a_torch_reference_gives(clean_pair):
    model, inputs, path, fp16 = clean_pair
    by_torch = fp16lens.verify(model, fp16, inputs)
    by_onnx = fp16lens.verify(path, fp16, inputs)
    assert by_torch and by_onnx and by_onnx.backend == "onnx-fp16"
    (name,) = by_onnx.outputs  # named after the graph output
    assert name == onnx.load(path).graph.output[0].name
    assert by_onnx.cosine == pytest.approx(by_torch.cosine, abs=1e-7)
    assert by_onnx.max_abs == pytest.approx(by_torch.max_abs, rel=1e-3, abs=1e-6)
    assert by_onnx.first_divergence is None


def test_onnx_reference_fails_where_real_fp16_fails_and_names_the_node(seed, tmp_path):
    model, inputs, real, first_inf = seed
    assert not torch.isfinite(real).all() and first_inf[0] == "backbone.layer4.1.bn2"
    path = to_onnx(model, inputs, tmp_path / "seed.onnx")
    fp16 = export(path, None, tmp_path / "seed16.onnx").path
    result = fp16lens.verify(path, fp16, inputs)
    assert not result and result.nonfinite
    # the exporter folded bn2 into conv2: that conv's node computes bn2's output
    assert result.first_divergence == "/backbone/layer4/layer4.1/conv2/Conv"
    assert result.first_divergence_tensor == "/backbone/layer4/layer4.1/conv2/Conv_output_0"


def test_batches_by_input_name_or_as_numpy_arrays(clean_pair):
    _, inputs, path, fp16 = clean_pair
    name = onnx.load(path).graph.input[0].name
    x = inputs[0].numpy()
    by_tensor = fp16lens.verify(path, fp16, inputs)
    by_name = fp16lens.verify(path, fp16, [{name: x}, {name: x}])
    by_array = fp16lens.verify(path, fp16, (x,))
    assert by_name.batches == 2
    assert by_tensor.cosine == by_name.cosine == by_array.cosine
    with pytest.raises(VerifyError, match=f"no array for input.*{name}"):
        fp16lens.verify(path, fp16, [{"pixels": x}])
    with pytest.raises(VerifyError, match="takes 1 input"):
        fp16lens.verify(path, fp16, (x, x))


def test_reference_must_be_the_fp32_graph(clean_pair, tmp_path):
    _, inputs, _, fp16 = clean_pair
    with pytest.raises(VerifyError, match="not an FP32 graph"):
        fp16lens.verify(fp16, fp16, inputs)
    with pytest.raises(VerifyError, match="does not exist"):
        fp16lens.verify(tmp_path / "none.onnx", fp16, inputs)
    with pytest.raises(VerifyError, match=r"FP32 \.onnx file"):
        fp16lens.verify({"weights": 1}, fp16, inputs)


def test_int8_candidate_against_an_onnx_reference_picks_onnx_int8(clean_pair, tmp_path):
    _, inputs, path, _ = clean_pair
    batches = [(torch.rand(1, 3, 16, 16),) for _ in range(4)]
    int8 = export(path, None, tmp_path / "c8.onnx", precision="int8", calibration=batches).path
    result = fp16lens.verify(path, int8, inputs)
    assert result.backend == "onnx-int8" and result and 0.99 < result.cosine < 1.0
    assert np.isfinite(result.max_abs)


def _normed_convs(path) -> str:
    """x -> Conv 'stem' -> InstanceNormalization -> Relu -> Conv 'head', as another tool
    writes it (no module map): the norm makes the head's input range the same whatever the
    input's scale, so calibration on quiet inputs clips only the stem's input."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = {
        "w1": rng.normal(0, 0.3, (8, 3, 3, 3)),
        "w2": rng.normal(0, 0.3, (4, 8, 3, 3)),
        "s": np.ones(8),
        "b": np.zeros(8),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], name="stem", pads=[1] * 4),
            helper.make_node("InstanceNormalization", ["a", "s", "b"], ["n"], name="norm"),
            helper.make_node("Relu", ["n"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w2"], ["y"], name="head", pads=[1] * 4),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_a_failed_int8_check_of_an_onnx_source_advises_its_nodes_and_the_advice_passes(
    capsys, tmp_path
):
    """The INT8 advice for a model without modules names the nodes to keep out of INT8
    (``--fp32-nodes stem``: the conv reading the clipped input), which export takes for that
    source; exported so, the file passes the same check. Before, the advice stopped at
    "more calibration" for every ONNX source."""
    from fp16lens.cli import main

    src = _normed_convs(tmp_path / "src.onnx")
    torch.manual_seed(0)
    quiet = [(0.05 * torch.randn(1, 3, 8, 8),) for _ in range(4)]
    loud = [(2.0 * torch.randn(1, 3, 8, 8),) for _ in range(2)]
    q = export(src, None, tmp_path / "q.onnx", precision="int8", calibration=quiet).path
    result = fp16lens.verify(src, q, loud)
    assert not result.passed
    (advice,) = [a for a in result.advice if "keep them out of INT8" in a]
    assert "--fp32-nodes stem " in advice and "fp32_nodes=['stem']" in advice, advice
    torch.save(loud, tmp_path / "loud.pt")
    assert main(["verify", src, str(q), "--input", str(tmp_path / "loud.pt")]) == 1
    assert "--fp32-nodes stem" in " ".join(capsys.readouterr().out.split())
    kept = export(
        src, None, tmp_path / "k.onnx", precision="int8", calibration=quiet, fp32_nodes=["stem"]
    ).path
    assert fp16lens.verify(src, kept, loud).passed  # the head is still INT8
    heads = [n for n in onnx.load(str(kept)).graph.node if n.name == "head"]
    assert heads and heads[0].input[0].endswith("DequantizeLinear_Output")
