"""An INT8 export given evaluation batches held out from the calibration ones checks the
file it wrote on them, as TensorRT computes its Q/DQ graph (verify's ``onnx-int8``):
``artifact.parity``, the CLI's ``checked ... on the evaluation batches`` line and its JSON
``int8_check``, a warning and exit 1 where the file fails, and ``--target`` held on
them. Ground truth: the written file and the FP32 one run in ONNX Runtime directly, graph
optimizations off (each QuantizeLinear/DequantizeLinear on its own), without fp16lens."""

from __future__ import annotations

import json

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import int8_zoo  # noqa: E402

from fp16lens.cli import main  # noqa: E402
from fp16lens.export import export  # noqa: E402


def _run(path, feeds: list[dict]) -> list[list[np.ndarray]]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return [sess.run(None, {name: next(iter(f.values()))}) for f in feeds]


def _worst_cosine(fp32, int8, feeds: list[dict]) -> float:
    """Per output, the cosine over every item together; the worst output's."""
    refs, outs = _run(fp32, feeds), _run(int8, feeds)
    worst = 1.0
    for j in range(len(refs[0])):
        a = np.concatenate([np.ravel(r[j]) for r in refs]).astype(np.float64)
        b = np.concatenate([np.ravel(o[j]) for o in outs]).astype(np.float64)
        worst = min(worst, float(a @ b / np.sqrt((a @ a) * (b @ b))))
    return worst


def _items(feeds: list[dict]) -> np.ndarray:
    return np.concatenate([next(iter(f.values())) for f in feeds])


def test_trained_pnet_is_checked_on_its_held_out_crops(tmp_path, capsys):
    """MTCNN PNet (trained weights), calibrated on its 8 calibration crops and checked on
    its 24 evaluation crops, each file holding one batch for a graph of batch 1: the CLI
    reports the worst output cosine ONNX Runtime gives on the held-out crops, `verify`
    on the same file of 24 gives it item by item, and the library's artifact the same."""
    try:
        case = int8_zoo.MODELS["pnet"](8, 24)
    except int8_zoo.Missing as exc:
        pytest.skip(str(exc))
    np.savez(tmp_path / "cal.npz", x=_items(case.cal))
    np.savez(tmp_path / "eval.npz", x=_items(case.eval))
    out = tmp_path / "pnet_int8.onnx"
    argv = ["export", case.path, "--precision", "int8", "-o", str(out)]
    argv += ["--calibration", str(tmp_path / "cal.npz"), "--input", str(tmp_path / "eval.npz")]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["int8_check"]
    truth = _worst_cosine(case.path, out, case.eval)
    assert got["passed"] and got["batches"] == 24
    assert got["cosine"] == pytest.approx(truth, abs=1e-6) and truth > 0.99
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    said = f"on the evaluation batches (--input): cosine {truth:.6f} against FP32 over its 24"
    assert f"{said} batches together, the worst output" in text, text
    # verify takes the same file of 24 crops for the graph of batch 1, item by item
    assert (
        main(["verify", case.path, str(out), "--input", str(tmp_path / "eval.npz"), "--json"]) == 0
    )
    checked = capsys.readouterr()
    assert "split into its items" in checked.err
    assert json.loads(checked.out)["cosine"] == pytest.approx(truth, abs=1e-6)
    art = export(
        case.path, None, tmp_path / "lib.onnx", "int8", calibration=case.cal, evaluation=case.eval
    )
    assert art.parity.passed and art.parity.cosine == pytest.approx(
        _worst_cosine(case.path, tmp_path / "lib.onnx", case.eval), abs=1e-6
    )


def _mismatched(tmp_path):
    """A two-layer MLP calibrated on inputs 1000x smaller than the ones it is checked on:
    INT8 clips every held-out input to the calibration range."""
    (tmp_path / "mlp.py").write_text(
        "import torch\n\ndef build():\n    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(),"
        " torch.nn.Linear(32, 8, bias=False)).eval()\n"
    )
    model = f"{tmp_path}/mlp.py:build"
    fp32 = tmp_path / "mlp.onnx"
    assert main(["export", model, "--input", "1x16", "--precision", "fp32", "-o", str(fp32)]) == 0
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cal.npz", x=rng.normal(size=(8, 16)).astype(np.float32) * 1e-3)
    np.savez(tmp_path / "eval.npz", x=rng.normal(size=(8, 16)).astype(np.float32))
    return model, fp32


def test_a_file_that_fails_on_the_held_out_batches_says_so_and_exits_1(tmp_path, capsys):
    model, fp32 = _mismatched(tmp_path)
    capsys.readouterr()
    out = tmp_path / "q.onnx"
    argv = ["export", str(fp32), "--precision", "int8", "-o", str(out)]
    argv += ["--calibration", str(tmp_path / "cal.npz"), "--input", str(tmp_path / "eval.npz")]
    assert main(argv) == 1
    text = " ".join(capsys.readouterr().out.split())
    feeds = [{"x": a[None]} for a in np.load(tmp_path / "eval.npz")["x"]]
    truth = _worst_cosine(fp32, out, feeds)
    assert truth < 0.99  # ground truth: the written file does fail there
    assert "the INT8 file fails its check on the evaluation batches" in text, text
    assert f"worst output cosine against FP32 is {truth:.6f}, below 0.99" in text
    assert "--target 0.999" in text and "target=" not in text
    # an ONNX source's failing part is kept FP32 by node name, the flag its command takes
    assert "keep those nodes FP32 (--fp32-nodes NAME,...)" in text, text
    # the calibration batches alone pass: nothing was checked where it fails
    argv_cal = ["export", str(fp32), "--precision", "int8", "-o", str(tmp_path / "c.onnx")]
    assert main([*argv_cal, "--input", str(tmp_path / "cal.npz")]) == 0
    assert "fails its check" not in capsys.readouterr().out
    # retype of the FP32 file: the same check, through the library
    from fp16lens.export import retype

    cal = [(np.load(tmp_path / "cal.npz")["x"],)]  # in input order
    held = [(f["x"],) for f in feeds]
    art = retype(fp32, tmp_path / "r.onnx", "int8", calibration=cal, evaluation=held)
    assert not art.parity.passed and art.parity.cosine == pytest.approx(
        _worst_cosine(fp32, tmp_path / "r.onnx", feeds), abs=1e-6
    )
    assert any("fails its check on the evaluation batches" in w for w in art.warnings)
    # the PyTorch model itself: the same check against the model in FP32
    argv[1] = model
    assert main(argv) == 1
    text = " ".join(capsys.readouterr().out.split())
    x = np.load(tmp_path / "eval.npz")["x"]  # the file takes the 8 items at once
    a = np.concatenate([r[0] for r in _run(fp32, feeds)]).ravel().astype(np.float64)
    b = _run(out, [{"x": x}])[0][0].ravel().astype(np.float64)
    truth = float(a @ b / np.sqrt((a @ a) * (b @ b)))
    assert f"worst output cosine against FP32 is {truth:.6f}, below 0.99" in text, text
    assert "keep those modules FP32 (--fp32-modules NAME,...)" in text, text
    assert any("fp32_nodes=[...]" in w for w in art.warnings)  # the library's own words


def test_the_target_holds_on_the_held_out_batches(tmp_path, capsys):
    """--target beside --calibration and an --input file is checked on the --input
    batches: met on the calibration batches alone, missed on the held-out ones (every
    layer would have to leave INT8), and the export fails in one line."""
    _, fp32 = _mismatched(tmp_path)
    capsys.readouterr()
    argv = ["export", str(fp32), "--precision", "int8", "-o", str(tmp_path / "q.onnx")]
    argv += ["--calibration", str(tmp_path / "cal.npz"), "--target", "0.999"]
    assert main(argv) == 0  # on the calibration batches
    capsys.readouterr()
    code = main([*argv, "--input", str(tmp_path / "eval.npz")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("fp16lens: error: INT8 misses its target"), err
    assert len([e for e in err if e.startswith("fp16lens: error")]) == 1


def test_speech_of_several_lengths_calibrates_plcmos_and_another_speaker_checks_it(tmp_path):
    """PLCMOS v2 (speechmos's wheel) takes spectrograms of any length: calibrated on the
    first speaker's sentence whole and its first 1.2 s (124 and 76 frames), clean and with
    packets lost, and held to a MOS error of 0.05 on the second speaker's (241 and 76
    frames). All in INT8 its score moves by up to about 0.12 MOS there (a regression head
    on a 1-to-5 scale); the target keeps the few units it needs out (almost none of the
    FLOPs), and ONNX Runtime without fp16lens scores the second speaker within 0.05 MOS of
    FP32 with the written file."""
    import re

    import torch
    import zoo_real

    from fp16lens.export import Int8Target

    path = zoo_real.or_skip(zoo_real.plcmos_model)
    feeds = zoo_real.or_skip(zoo_real.plcmos_feeds, (None, 1.2))
    cal = [f for k, f in feeds.items() if k.startswith("first") and "raw" not in k]
    held = [f for k, f in feeds.items() if k.startswith("second") and "raw" not in k]
    assert len({f["degraded_audio"].shape for f in cal}) == 2  # two lengths

    def mos_error(refs, outs):  # minus the worst score difference, as --target metric.py:
        return -max(
            abs(float(np.ravel(o[0])[0]) - float(np.ravel(r[0])[0])) for r, o in zip(refs, outs)
        )

    def as_torch(fs):
        return [tuple(torch.from_numpy(a) for a in f.values()) for f in fs]

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    errors = {}
    for target in (None, Int8Target(-0.05, mos_error, "MOS error")):
        art = export(
            path,
            None,
            tmp_path / "q.onnx",
            precision="int8",
            calibration=as_torch(cal),
            evaluation=as_torch(held),
            **({} if target is None else {"target": target, "max_fallback": 0.5}),
        )
        assert art.parity is not None and art.parity.passed
        q = ort.InferenceSession(str(art.path), so, providers=["CPUExecutionProvider"])
        errors[target is None] = [
            abs(float(q.run(None, f)[0]) - float(ref.run(None, f)[0])) for f in held
        ]
    (plan,) = [w for w in art.warnings if w.startswith("INT8: ")]
    share = float(re.search(r"\(([0-9.]+)% of conv", plan)[1])
    assert max(errors[False]) <= 0.05 < max(errors[True]) < 0.2, errors
    assert share >= 99.0, plan


def test_a_cosine_target_holds_plcmos_score_about_its_mean(tmp_path):
    """One MOS per clip: a plain cosine of scores from 1.9 to 3.6 is 0.9998 with INT8's
    errors of a tenth, and the cosine of one score alone is its sign. verify judges the
    scores about FP32's mean too (0.998 all in INT8: fails 0.999, names the batch that
    departs most and the layers to keep out), and the search's cosine target does the same:
    ``target=0.999`` on the second speaker keeps a few units out, and ONNX Runtime without
    fp16lens scores that speaker closer to FP32 with that file."""
    import torch
    import zoo_real

    from fp16lens.verify import verify

    path = zoo_real.or_skip(zoo_real.plcmos_model)
    feeds = zoo_real.or_skip(zoo_real.plcmos_feeds, (None, 1.2))
    cal = [
        tuple(torch.from_numpy(a) for a in f.values())
        for k, f in feeds.items()
        if k.startswith("first") and "raw" not in k
    ]
    keys = [k for k in feeds if k.startswith("second") and "raw" not in k]
    held = [tuple(torch.from_numpy(a) for a in feeds[k].values()) for k in keys]
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    fp32 = np.array([float(ref.run(None, feeds[k])[0]) for k in keys])
    errors = {}
    for target in (None, 0.999):
        out = tmp_path / f"{target}.onnx"
        export(
            path,
            None,
            out,
            precision="int8",
            calibration=cal,
            **(
                {}
                if target is None
                else {"target": target, "max_fallback": 0.5, "evaluation": held}
            ),
        )
        q = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        got = np.array([float(q.run(None, feeds[k])[0]) for k in keys])
        errors[target] = np.abs(got - fp32)
        result = verify(path, out, held, tolerance=0.999)
        a, b = fp32 - fp32.mean(), got - fp32.mean()
        assert result.cosine_about_mean == pytest.approx(
            a @ b / np.linalg.norm(a) / np.linalg.norm(b), abs=1e-5
        )
        assert result.cosine > 0.999  # the plain cosine passes either way
        if target is None:
            assert not result.passed and "cosine about FP32's mean" in result.failures()[0]
            assert any("--fp32-nodes" in line for line in result.advice), result.advice
        else:
            assert result.passed, result.failures()
    # closer on the worst clip and on the mean (all in INT8 0.098 and 0.042 MOS; 0.074, 0.032)
    assert errors[0.999].max() < errors[None].max(), errors
    assert errors[0.999].mean() < 0.8 * errors[None].mean(), errors


def test_a_met_target_with_a_failing_check_says_the_target_holds(tmp_path):
    """A target on what the task reads (here: every output finite) is met on the held-out
    batches while verify's check of the same file fails there (ground truth: ONNX Runtime
    on the written file): the warning says the target holds and what the check read
    beyond it, and does not ask for the target the user already gave."""
    import torch

    from fp16lens.export import Int8Target

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False)
    ).eval()
    rng = np.random.default_rng(0)
    cal = [(torch.tensor(rng.normal(size=(1, 16)).astype(np.float32) * 1e-3),) for _ in range(8)]
    held = [(torch.tensor(rng.normal(size=(1, 16)).astype(np.float32)),) for _ in range(8)]

    def finite(refs, outs) -> float:
        return float(all(np.isfinite(x).all() for out in outs for x in out))

    goal = Int8Target(1.0, finite, "finite outputs")
    out = tmp_path / "q.onnx"
    art = export(model, cal[0], out, "int8", calibration=cal, evaluation=held, target=goal)
    assert art.int8["target"]["score"] == 1.0 and not art.parity.passed
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    got = np.concatenate([sess.run(None, {name: x.numpy()})[0] for (x,) in held]).ravel()
    with torch.no_grad():
        ref = torch.cat([model(x) for (x,) in held]).numpy().ravel().astype(np.float64)
    assert float(ref @ got / np.sqrt((ref @ ref) * (got @ got))) < 0.99  # it does fail
    said = [w for w in art.warnings if "check on the evaluation batches" in w]
    assert len(said) == 1, art.warnings
    assert "meets its target (finite outputs 1.0000 >= 1)" in said[0], said
    assert "give a parity target" not in said[0] and "target=0.999" in said[0], said
