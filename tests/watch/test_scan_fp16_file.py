"""scan() and patch() of an ONNX file that already computes in float16.

A user often has only the FP16 file (onnxconverter-common's ``convert_float_to_float16``,
or an export of a ``.half()`` model). Read as it is, its values are FP16's own: what
overflowed is already inf, no stored value passes 65504, and the scan once called a file
whose real FP16 output is all NaN "FP16-safe". fp16lens reads it as its FP32 twin.

Ground truth, made without fp16lens: ONNX's reference evaluator runs the FP16 file in
numpy's float16 (every node's output stored in FP16, as the file says; ONNX Runtime's CPU
provider would run the FP16 chain in FP32 and hide the overflow), against ONNX Runtime on
the FP32 file the FP16 one was converted from.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fp16lens
from fp16lens._core.sites import FindingKind
from fp16lens.cli import main
from fp16lens.report._advice import suggest_fix

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
float16 = pytest.importorskip("onnxconverter_common.float16")
from onnx_reference import run_reference  # noqa: E402  (it imports onnx)


class Loud(nn.Module):
    """conv2's output reaches about 1.8e5 (its weights are ``gain`` times a plain init, all
    below 65504) and two multiplies by ``gain ** -0.5`` bring it back before conv3: FP32 is
    fine, FP16 stores inf from conv2 to the first multiply."""

    def __init__(self, gain: float):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 2, 1)
        self.back = gain**-0.5
        with torch.no_grad():
            self.conv2.weight.mul_(gain)
            self.conv2.bias.mul_(gain)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return torch.sigmoid(self.conv3(y * self.back * self.back))


def _files(tmp_path, gain: float, **convert) -> tuple[str, str, np.ndarray]:
    torch.manual_seed(0)
    model = Loud(gain).eval()
    x = torch.rand(1, 3, 16, 16) * 4
    fp32 = str(tmp_path / "m32.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), fp32, opset_version=17, dynamo=False, input_names=["x"])
        half = float16.convert_float_to_float16(onnx.load(fp32), **convert)
    fp16 = str(tmp_path / "m16.onnx")
    onnx.save(half, fp16)
    return fp32, fp16, x.numpy()


def _fp32_out(path: str, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.astype(np.float32)})[0]


def _fp16_out(proto_or_path, x: np.ndarray) -> np.ndarray:
    """The file in real FP16 storage: ONNX's reference evaluator, numpy float16."""
    proto = onnx.load(proto_or_path) if isinstance(proto_or_path, str) else proto_or_path
    ins = {i.name: i for i in proto.graph.input}
    feed = x.astype(np.float16 if ins["x"].type.tensor_type.elem_type == 10 else np.float32)
    return run_reference(proto, {"x": feed})[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_an_fp16_file_that_overflows_is_found_and_patched(tmp_path, capsys):
    fp32, fp16, x = _files(tmp_path, 2.0**18)
    ref = _fp32_out(fp32, x)
    assert np.isfinite(ref).all()
    assert not np.isfinite(_fp16_out(fp16, x)).all()  # ground truth: the file is NaN in FP16

    x16 = x.astype(np.float16)
    report = fp16lens.scan(fp16, [x16], progress=False)
    assert not report.clean
    (span,) = report.spans
    assert span.start.endswith("conv2/Conv") and span.peak > 65504
    assert any(f.kind == FindingKind.FP16_FILE for f in report.findings)

    # patch reads the same FP32 twin (the report's fingerprint matches it) and proves the
    # fix; the file it writes, converted to FP16 as the user converted the original, is
    # finite in real FP16 and agrees with FP32
    out = tmp_path / "patched.onnx"
    fp16lens.patch(fp16, report, batches=[x16], out=str(out))
    patched = onnx.load(str(out))
    assert patched.graph.input[0].type.tensor_type.elem_type == 1  # an FP32 graph
    again = float16.convert_float_to_float16(patched)
    got = _fp16_out(again, x)
    assert np.isfinite(got).all() and _cosine(got, ref) > 0.999

    # the CLI says the patched file is FP32 and how to make it FP16
    report.save(tmp_path / "r.json")
    np.save(tmp_path / "x16.npy", x16)
    args = [
        "patch",
        fp16,
        "--report",
        str(tmp_path / "r.json"),
        "--input",
        str(tmp_path / "x16.npy"),
    ]
    code = main([*args, "-o", str(tmp_path / "cli.onnx")])
    out_text = capsys.readouterr().out
    assert code == 0 and "FP32 twin" in out_text and "--precision fp16" in out_text


def test_an_fp16_file_with_the_loud_nodes_kept_fp32_is_clean(tmp_path):
    # the converter keeps conv2, its ReLU and the first multiply in FP32 (Casts around them)
    fp32, _, x = _files(tmp_path, 2.0**18)
    names = [n.name for n in onnx.load(fp32).graph.node]
    keep = [n for n in names if "conv2" in n or "Relu_1" in n or n.endswith("/Mul")]
    assert len(keep) == 3, names
    fp32, fp16, x = _files(tmp_path, 2.0**18, node_block_list=keep)
    got = _fp16_out(fp16, x)
    assert np.isfinite(got).all() and _cosine(got, _fp32_out(fp32, x)) > 0.999  # ground truth

    report = fp16lens.scan(fp16, [x.astype(np.float16)], progress=False)
    assert not report.spans, report.spans
    assert report.clean  # the FP16 check keeps the file's FP32 nodes FP32 as the file does
    assert any(f.kind == FindingKind.FP16_FILE for f in report.findings)


def test_a_quiet_fp16_file_is_clean(tmp_path, capsys):
    fp32, fp16, x = _files(tmp_path, 1.0)
    got = _fp16_out(fp16, x)
    assert np.isfinite(got).all() and _cosine(got, _fp32_out(fp32, x)) > 0.999
    report = fp16lens.scan(fp16, [x.astype(np.float16)], progress=False)
    assert report.clean and not report.spans
    # patch has nothing to do, and still writes the FP32 twin: it says so (the twin of the
    # shipped FP16 ISNet is 176 MB beside the file's 88 MB), and how to make it FP16 again
    report.save(tmp_path / "r.json")
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "twin.onnx"
    args = ["patch", fp16, "--report", str(tmp_path / "r.json"), "-o", str(out)]
    for given in ([], ["--input", str(tmp_path / "x.npy")]):  # proven in FP16, or not run
        assert main([*args, *given]) == 0
        said = capsys.readouterr().out
        assert "nothing to patch" in said and "FP32 twin" in said and "--precision fp16" in said
        assert onnx.load(str(out)).graph.initializer[0].data_type == onnx.TensorProto.FLOAT


def test_ppocr_det_converted_by_onnxconverter_common_names_the_clamped_variance(tmp_path):
    """PP-OCRv4's detector (rapidocr-onnxruntime's file) through onnxconverter-common as users
    run it: a batch norm's running variance of 9.8e7 is clamped to 1e4 (the converter's
    max_finite_val), and the FP16 file's text mask agrees with FP32's on about two thirds
    (IoU 0.67). The clamp alone, applied to the FP32 file, does the same: the conversion
    changed the model, which no FP16 setting of the file can show."""
    import zoo_real
    from onnx import numpy_helper

    path, x = zoo_real.or_skip(zoo_real.ppocr_det, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = float16.convert_float_to_float16(onnx.load(path), keep_io_types=True)
    fp16 = str(tmp_path / "det16.onnx")
    onnx.save(half, fp16)
    name = half.graph.input[0].name

    def iou(a, b) -> float:
        return float(((a > 0.3) & (b > 0.3)).sum() / max(((a > 0.3) | (b > 0.3)).sum(), 1))

    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {name: x})[0]
    assert iou(run_reference(half, {name: x})[0], ref) < 0.8  # ground truth: the mask moves
    clamped = onnx.load(path)  # the converter's clamp alone, in FP32
    for node in clamped.graph.node:
        for a in node.attribute:
            if node.op_type == "Constant" and a.name == "value" and a.t.data_type == 1:
                v = numpy_helper.to_array(a.t)
                a.t.CopyFrom(numpy_helper.from_array(np.clip(v, -1e4, 1e4), a.t.name))
    sess = ort.InferenceSession(clamped.SerializeToString(), providers=["CPUExecutionProvider"])
    assert iou(sess.run(None, {name: x})[0], ref) < 0.8

    report = fp16lens.scan(fp16, [x], progress=False)
    (clamp,) = [f for f in report.findings if f.kind == FindingKind.CONVERTER_CLAMP]
    assert clamp.tensor == "batch_norm_0.w_2" and clamp.site == "p2o.BatchNormalization.1"
    assert "node_block_list" in suggest_fix(report, clamp)
    # the FP32 file's own scan names the same variance as beyond FP16
    fp32 = fp16lens.scan(path, [x], progress=False)
    assert any(
        f.kind == FindingKind.PARAM_OVERFLOW and "batch_norm_0.w_2" in (f.tensor or f.detail)
        for f in fp32.findings
    )


def test_fp16lens_own_fp16_export_with_an_island_scans_clean(tmp_path):
    """The attention span patched into an FP32 island, exported to FP16: the file keeps the
    island (its MatMuls, reshapes and its FP32 out_proj weight) in FP32. Scanning the file
    once gave a span inside the island and a subnormal out_proj weight, a file that is fine."""
    import models

    model, inputs = models.attention_span()
    report = fp16lens.scan(model, [inputs], progress=False)
    assert report.spans
    patched = fp16lens.patch(model, report, batches=[inputs])
    path = str(tmp_path / "att16.onnx")
    art = fp16lens.export(patched, inputs, path, "fp16")
    assert art.parity.passed
    proto = onnx.load(path)
    feed = {i.name: t.numpy() for i, t in zip(proto.graph.input, inputs)}
    got = run_reference(proto, feed)[0]
    with torch.no_grad():
        ref = model(*inputs).numpy()
    assert np.isfinite(got).all() and _cosine(got, ref) > 0.999  # ground truth: the file is fine

    scanned = fp16lens.scan(path, [tuple(t.numpy() for t in inputs)], progress=False)
    assert scanned.clean and not scanned.spans, scanned.findings
    assert [f.kind for f in scanned.findings] == [FindingKind.FP16_FILE]


def _out_of_order(proto, moved: str):
    """``proto`` with the nodes whose name contains ``moved`` put last, after their readers:
    how the FP16 ISNet that @imgly/background-removal ships (onnxconverter-common,
    ``keep_io_types``) holds its input Cast. ONNX Runtime runs such a file; the checker
    refuses it."""
    nodes = list(proto.graph.node)
    late = [n for n in nodes if moved in n.name]
    assert late, [n.name for n in nodes]
    del proto.graph.node[:]
    proto.graph.node.extend([n for n in nodes if moved not in n.name] + late)
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(proto)
    return proto


def test_a_file_whose_nodes_are_out_of_order_is_scanned_patched_and_exported(tmp_path):
    fp32, fp16, x = _files(tmp_path, 2.0**18, keep_io_types=True)
    shuffled = _out_of_order(onnx.load(fp16), "x_cast_to_")
    before = [n.name for n in shuffled.graph.node]
    ran = ort.InferenceSession(shuffled.SerializeToString(), providers=["CPUExecutionProvider"])
    assert ran.run(None, {"x": x})[0].shape == _fp32_out(fp32, x).shape  # a file users run

    report = fp16lens.scan(shuffled, [x], progress=False)
    assert [n.name for n in shuffled.graph.node] == before  # the user's graph is untouched
    (span,) = report.spans
    assert span.start.endswith("conv2/Conv")
    out = tmp_path / "patched.onnx"
    fp16lens.patch(shuffled, report, batches=[x], out=str(out))
    onnx.checker.check_model(str(out))
    again = float16.convert_float_to_float16(onnx.load(str(out)))
    got = _fp16_out(again, x)
    assert np.isfinite(got).all() and _cosine(got, _fp32_out(fp32, x)) > 0.999

    # an FP32 file out of order exports to an FP16 file that passes the checker; it once
    # raised the checker's ValidationError as a traceback
    quiet32, _, x = _files(tmp_path, 1.0)
    source = str(tmp_path / "shuffled32.onnx")
    onnx.save(_out_of_order(onnx.load(quiet32), "Conv"), source)
    art = fp16lens.export(source, None, str(tmp_path / "q16.onnx"), "fp16", evaluation=[x])
    onnx.checker.check_model(str(art.path), full_check=True)
    assert art.parity.passed
    got = _fp16_out(onnx.load(str(art.path)), x)
    assert _cosine(got, _fp32_out(quiet32, x)) > 0.999
