"""ONNX graphs over protobuf's 2 GB limit (``fp16lens/_core/onnx_large.py``).

Over the limit a proto cannot be serialized: ONNX Runtime, shape inference, the checker and
``onnx.save`` each refuse it as one message. fp16lens once said "ONNX Runtime cannot load
big (Failed to serialize proto); upgrade onnxruntime" on a 2.15 GB file that ONNX Runtime
runs from its path, and scanning it ran out of 24 GB of memory
(``scripts/check_large_onnx.py`` runs that file end to end).

Here the limit is lowered to a few kilobytes and every one of those four entry points is
made to refuse a proto over it, as protobuf does at 2 GB: the journey (scan, patch, export,
verify) of a small model must go through files and external data as a 3 GB one would, and
its FP16 file is then judged in real FP16 against the FP32 graph, without fp16lens.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import fp16lens
from fp16lens._core import fingerprint, onnx_large
from fp16lens.cli import main

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx_reference import run_reference  # noqa: E402  (it imports onnx)

LIMIT = 20_000  # bytes: the model below holds about 40 kB of weights


class Loud(nn.Module):
    """conv2's output reaches about 1e5 and a multiply by 2^-6 brings it back before conv3:
    FP32 is fine, real FP16 stores inf from conv2 to the multiply."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 2, 1)
        with torch.no_grad():
            self.conv2.weight.mul_(2.0**16)
            self.conv2.bias.mul_(2.0**16)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return torch.sigmoid(self.conv3(y * 2.0**-6))


def _file(tmp_path, model: nn.Module | None = None) -> tuple[str, np.ndarray]:
    """The model as exporters write a large one: the graph, its weights in a .data file."""
    torch.manual_seed(0)
    model = model or Loud().eval()
    x = torch.rand(1, 3, 16, 16) * 4
    inline = tmp_path / "inline.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(inline), opset_version=17, dynamo=False,
                          input_names=["x"])  # fmt: skip
    path = tmp_path / "model" / "big.onnx"
    path.parent.mkdir()
    onnx.save(onnx.load(str(inline)), str(path), save_as_external_data=True,
              location="big.onnx.data", size_threshold=0)  # fmt: skip
    return str(path), x.numpy()


def _too_large(proto) -> bool:
    return isinstance(proto, onnx.ModelProto) and proto.ByteSize() > LIMIT


@pytest.fixture
def limit(monkeypatch):
    """Protobuf's limit at ``LIMIT`` bytes: the four entry points refuse a proto over it."""
    monkeypatch.setattr(onnx_large, "TWO_GB", LIMIT)
    monkeypatch.setattr(onnx_large, "LIGHT_INFERENCE", 0)

    def refusing(fn, arg=0):
        def call(*args, **kwargs):
            if kwargs.get("save_as_external_data"):
                return fn(*args, **kwargs)  # what a large file needs
            if _too_large(args[arg]) or (isinstance(args[arg], bytes) and len(args[arg]) > LIMIT):
                raise ValueError("Message onnx.ModelProto exceeds maximum protobuf size of 2GB")
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(ort, "InferenceSession", refusing(ort.InferenceSession))
    monkeypatch.setattr(onnx, "save", refusing(onnx.save))
    monkeypatch.setattr(onnx.checker, "check_model", refusing(onnx.checker.check_model))
    monkeypatch.setattr(
        onnx.shape_inference, "infer_shapes", refusing(onnx.shape_inference.infer_shapes)
    )


def test_a_graph_over_the_limit_is_scanned_patched_exported_and_verified(tmp_path, capsys, limit):
    torch.manual_seed(0)
    model = Loud().eval()
    path, x = _file(tmp_path, model)
    with torch.no_grad():  # ground truth: real FP16 breaks the model
        assert not torch.isfinite(model.half()(torch.from_numpy(x).half())).all()
    np.savez(tmp_path / "x.npz", x=x)
    fp32 = ort.InferenceSession(path, providers=["CPUExecutionProvider"])  # by path: runs
    ref = fp32.run(None, {"x": x})[0]

    report = tmp_path / "r.json"
    assert main(["scan", path, "--input", str(tmp_path / "x.npz"), "--save", str(report)]) == 0
    scanned = fp16lens.Report.load(report)
    (span,) = scanned.spans
    assert "Conv" in span.start

    fixed = tmp_path / "out" / "fixed.onnx"
    argv = ["patch", path, "--report", str(report), "--input", str(tmp_path / "x.npz")]
    assert main([*argv, "-o", str(fixed)]) == 0
    assert fixed.with_name("fixed.onnx.data").is_file()  # the weights beside the graph
    assert "proven" in capsys.readouterr().out

    half = tmp_path / "out" / "fixed16.onnx"
    argv = ["export", str(fixed), "--precision", "fp16", "-o", str(half)]
    assert main([*argv, "--input", str(tmp_path / "x.npz")]) == 0
    assert main(["verify", path, str(half), "--input", str(tmp_path / "x.npz")]) == 0

    # ground truth, without fp16lens: the file the user takes home, in real FP16 storage
    got = run_reference(onnx.load(str(half)), {"x": x.astype(np.float16)})[0]
    assert np.isfinite(got).all()
    a, b = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999


def test_the_users_proto_over_the_limit_is_left_as_it_was(tmp_path, limit):
    path, x = _file(tmp_path)
    proto = onnx.load(path)
    before = proto.SerializeToString()  # the real limit is far: this serializes
    report = fp16lens.scan(proto, [x], progress=False)
    assert report.spans
    patched = fp16lens.patch(proto, report, batches=[x])
    assert proto.SerializeToString() == before
    assert patched is not proto


def test_light_copies_keep_the_structure_and_save_round_trips(tmp_path):
    path, _ = _file(tmp_path)
    proto = onnx.load(path)
    before = proto.SerializeToString()
    lite = onnx_large.light(proto)
    assert lite.ByteSize() < len(before) / 10
    assert [(t.name, list(t.dims), t.data_type) for t in lite.graph.initializer] == [
        (t.name, list(t.dims), t.data_type) for t in proto.graph.initializer
    ]
    full = onnx.shape_inference.infer_shapes(proto).graph.value_info
    light = onnx.shape_inference.infer_shapes(lite).graph.value_info
    assert [str(v) for v in light] == [str(v) for v in full]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onnx_large, "TWO_GB", LIMIT)
        assert onnx_large.is_large(proto)
        out = tmp_path / "saved.onnx"
        onnx_large.save(onnx, proto, out)
        assert out.stat().st_size < LIMIT and out.with_name("saved.onnx.data").is_file()
    assert onnx.load(str(out)).SerializeToString() == before
    assert proto.SerializeToString() == before


def test_the_onnx_fingerprint_is_the_same_a_chunk_at_a_time(tmp_path, monkeypatch):
    path, _ = _file(tmp_path)
    proto = onnx.load(path)
    whole = fingerprint.onnx_fingerprint(proto)
    monkeypatch.setattr(fingerprint, "_CHUNK", 7)
    chunked = fingerprint.onnx_fingerprint(proto)
    assert whole.keys() == chunked.keys() and len(whole) >= 6
    for name, sums in whole.items():
        np.testing.assert_allclose(chunked[name], sums, rtol=1e-12, atol=1e-9)
    assert not fingerprint.differing(whole, chunked)


def test_a_missing_data_file_is_one_line_and_exit_2_for_every_command(tmp_path, capsys):
    """A model whose .data file did not come along (copied without it): each command names
    the file and the fix in one line; verify once printed onnx's traceback."""
    path, x = _file(tmp_path)
    np.savez(tmp_path / "x.npz", x=x)
    Path(path).with_name("big.onnx.data").unlink()
    xs = str(tmp_path / "x.npz")
    inline = str(tmp_path / "inline.onnx")
    report = tmp_path / "r.json"
    assert main(["scan", inline, "--input", xs, "--save", str(report)]) == 0
    capsys.readouterr()
    for argv in (
        ["scan", path, "--input", xs],
        ["patch", path, "--report", str(report), "-o", str(tmp_path / "p.onnx")],
        ["export", path, "--precision", "fp16", "-o", str(tmp_path / "o.onnx")],
        ["verify", inline, path, "--input", xs],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "big.onnx.data" in err[0], (argv, err)
        assert "external data files lie beside it" in err[0]


def test_scan_and_patch_hold_one_session_at_a_time(tmp_path, limit, monkeypatch):
    """Each ONNX Runtime session holds the weights: the patch's FP32 check and its proof in
    FP16 run the original, the patched and the FP16-storage graphs one after another (they
    ran side by side, three sessions), and the scan drops its own sessions before the
    advice plans (scripts/check_large_onnx.py prints what that saves)."""
    import gc
    import weakref

    from fp16lens.patch.onnx import _patch
    from fp16lens.watch.onnx import _dead, _run, _scan

    path, x = _file(tmp_path)
    live: weakref.WeakSet = weakref.WeakSet()
    most = [0]

    def counted(module, name):
        real = getattr(module, name)

        def session(*args, **kwargs):
            made = real(*args, **kwargs)
            live.add(made)
            most[0] = max(most[0], len(live))
            return made

        monkeypatch.setattr(module, name, session)

    for module, name in ((_patch, "_session"), (_run, "ort_session"), (_dead, "ort_session")):
        counted(module, name)
    at_advice = []
    advised = _scan.advised

    def advising(*args, **kwargs):
        gc.collect()
        at_advice.append(len(live))
        return advised(*args, **kwargs)

    monkeypatch.setattr(_scan, "advised", advising)
    report = fp16lens.scan(path, [x], progress=False)
    assert report.spans and report.advice is not None and at_advice == [0] and most[0] >= 1
    gc.collect()
    most[0] = 0
    patched = fp16lens.patch(path, report, batches=[x])
    assert patched.graph.node and most[0] == 1


def test_the_advice_plans_on_the_graph_itself_and_leaves_it_as_it_was(tmp_path):
    """The scan's advice reads the scanned proto without copying it (a copy held a large
    graph's weights again): planning never writes it, whatever the plan holds. A span
    rescaled, underflow islands before a log and a divide, and a conv that reads flushed
    values (nothing to do): each proto is byte-identical after the scan and its advice."""
    from underflow_graphs import log_eps, quiet, sqrt_div, square_into_conv

    path, x = _file(tmp_path)
    cases = [
        (onnx.load(path), [x]),
        (log_eps(), [{"x": quiet()}]),
        (sqrt_div(), [{"x": quiet()}]),
        (square_into_conv(), [{"x": quiet((4, 1, 16))}]),
    ]
    planned = []
    for proto, batches in cases:
        before = proto.SerializeToString()
        report = fp16lens.scan(proto, batches, progress=False)
        assert proto.SerializeToString() == before
        advice = report.advice
        planned.append((bool(advice and advice.regions), bool(advice and advice.islands)))
    assert planned[0][0] and planned[1][1] and planned[2][1]  # a rescaling, two FP32 chains
