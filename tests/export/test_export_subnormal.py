"""The export's subnormal warning says whether the loss matters, by the rule watch applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp16lens.export._ranges import MAY_CHANGE, harmless, range_issues, subnormal_summary

import models


def _conv_weight(tiny_channel: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (8, 4, 3, 3)).astype(np.float32)
    w[:, :, 0, 0] = 2e-6  # a few subnormal entries in every channel beside ~0.05 ones
    if tiny_channel:
        w[3] = 1e-8  # a whole output channel FP16 flushes to 0
    return w


def test_scattered_subnormal_weights_are_harmless_a_flushed_channel_is_not():
    scattered = range_issues(_conv_weight(False))
    assert scattered.subnormal == 32 and scattered.lost_rel <= 2.0**-11
    assert harmless(scattered, additive=False)
    flushed = range_issues(_conv_weight(True))
    assert flushed.zeroed == 36 and flushed.lost_rel == pytest.approx(1.0)
    assert not harmless(flushed, additive=False)
    bias = range_issues(np.full(8, 1e-8, np.float32))  # all of it lost, but < 2^-25 per value
    assert bias.zeroed == 8 and harmless(bias, additive=True)


def test_summary_says_harmless_or_names_where_it_matters():
    ok = [
        ("a.weight", 288, range_issues(_conv_weight(False)), False),
        ("a.bias", 8, range_issues(np.full(8, 1e-8, np.float32)), True),
    ]
    text = subnormal_summary(ok)
    assert text.startswith("2 weight(s) hold 40 value(s) that are subnormal") and "harmless" in text
    assert "may change the output" not in text
    bad = [*ok, ("b.weight", 288, range_issues(_conv_weight(True)), False)]
    text = subnormal_summary(bad)
    assert "In 1 of them an output channel loses up to 100% of its weight magnitude" in text
    assert "b.weight (" in text.split("In 1 of them")[1].split(";")[0]
    assert "fp32_modules" in text and "the other 2 lose less than" in text
    assert subnormal_summary([("c", 4, range_issues(np.ones(4, np.float32)), False)]) is None


@pytest.mark.slow
def test_fp16_export_judges_mobilenet_harmless_and_a_flushed_layer_scale_not(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    from fp16lens.export import export

    model, inputs, _ = models.mobilenet_v2_tiny_params()
    art = export(model, inputs, tmp_path / "m.onnx", "fp16", exporter="torchscript")
    (warning,) = [w for w in art.warnings if "subnormal" in w]
    assert "harmless" in warning and "may change the output" not in warning
    scaled, inputs = models.layer_scale_readout(gamma=1e-8)
    art = export(scaled, inputs, tmp_path / "s.onnx", "fp16", exporter="torchscript")
    (warning,) = [w for w in art.warnings if "subnormal" in w]
    assert "may change the output" in warning and "): gamma (" in warning
    # ground truth: the FP16 graph holds γ as zeros (real FP16 then drops the branch,
    # tests/watch/test_watch_params_harm.py)
    graph = onnx.load(str(art.path)).graph
    gamma = next(numpy_helper.to_array(i) for i in graph.initializer if i.name == "gamma")
    assert gamma.dtype == np.float16 and not gamma.any()


class _Normalized(torch.nn.Module):
    """A sentence-transformers head: relu(lin(x)), L2-normed by F.normalize (eps 1e-12,
    0 in FP16), or with ``eps`` FP16 holds."""

    def __init__(self, eps: float = 1e-12):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.eps = eps

    def forward(self, x):
        return torch.nn.functional.normalize(torch.relu(self.lin(x)), dim=-1, eps=self.eps)


@pytest.mark.parametrize("eps", [1e-12, 1e-4])
def test_an_eps_fp16_makes_0_is_named_by_its_node_and_an_input_it_guarded_gives_nan(tmp_path, eps):
    """F.normalize's eps 1e-12 is 0 in FP16: the exported file is fine on most inputs, and
    0/0 = NaN on one whose vector is 0 (ground truth: ONNX Runtime on the FP16 file, no
    fp16lens). The export says so, naming the Clip that reads it (not "an output channel
    loses 100% of its weight" of module ''); with an eps FP16 holds, no such warning and
    a finite 0."""
    import onnxruntime as ort

    from fp16lens.export import export

    torch.manual_seed(0)
    model = _Normalized(eps).eval()
    with torch.no_grad():
        model.lin.bias.fill_(-100.0)  # relu makes every value 0
    x = torch.randn(2, 4)
    art = export(model, (x,), tmp_path / "m.onnx", "fp16")
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]  # FP32 io, FP16 inside
    with torch.no_grad():
        assert bool((model(x) == 0).all())  # FP32: a zero vector stays 0
    guards = [w for w in art.warnings if "eps or clip bound" in w]
    if eps < 2.0**-25:
        assert np.isnan(got).all()
        (text,) = guards
        assert "(read by Clip '" in text and "1e-12, 0 in FP16" in text
        assert "output channel" not in text and "of ''" not in " ".join(art.warnings)
    else:
        assert guards == [] and bool((got == 0).all())


def _onnx_conv_file(path, weight: np.ndarray) -> str:
    """An ONNX file as another tool writes it (no fp16lens module map): x -> Conv -> Relu."""
    from onnx import TensorProto, helper, numpy_helper, save

    c_out, c_in = weight.shape[:2]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["y"], name="stem_conv", pads=[1] * 4),
            helper.make_node("Relu", ["y"], ["z"], name="stem_relu"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c_in, 8, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, c_out, 8, 8])],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(np.full(c_out, 0.1, np.float32), "b"),
        ],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_an_onnx_source_is_advised_its_nodes_and_the_advice_takes(capsys, tmp_path):
    """An ONNX file without fp16lens's module map has no modules to keep: the overflow
    refusal and the subnormal warning name the node that reads the weight and
    ``fp32_nodes`` (``--fp32-nodes stem_conv`` in a terminal, which that command takes),
    not ``fp32_modules`` (refused for such a file). Following the advice clears both."""
    from fp16lens.cli import main
    from fp16lens.export import ExportError, export

    huge = _conv_weight(False)
    huge[0, 0, 1, 1] = 1e6  # beyond FP16
    src = _onnx_conv_file(tmp_path / "huge.onnx", huge)
    with pytest.raises(ExportError, match=r"of 'stem_conv'.*fp32_nodes=\['stem_conv'\]"):
        export(src, None, tmp_path / "a.onnx")
    assert main(["export", src, "-o", str(tmp_path / "a.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith("--fp32-nodes stem_conv."), err
    assert "fp32_modules" not in err and "--fp32-modules" not in err
    kept = export(src, None, tmp_path / "k.onnx", fp32_nodes=["stem_conv"])
    assert "stem_conv" in kept.fp32_nodes

    flushed = _onnx_conv_file(tmp_path / "flushed.onnx", _conv_weight(True))
    art = export(flushed, None, tmp_path / "f.onnx")
    (text,) = [w for w in art.warnings if "subnormal" in w]
    assert MAY_CHANGE in text and "w (read by Conv 'stem_conv')" in text, text
    assert "fp32_nodes=[...]" in text and "fp32_modules" not in text, text
    assert main(["export", flushed, "-o", str(tmp_path / "f2.onnx")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--fp32-nodes NAME,..." in out and "--fp32-modules" not in out, out
    kept = export(flushed, None, tmp_path / "fk.onnx", fp32_nodes=["stem_conv"])
    assert not [w for w in kept.warnings if "subnormal" in w]
