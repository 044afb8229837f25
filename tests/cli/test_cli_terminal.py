"""Terminal mistakes of issue #27: each exits 2 with one line naming the problem and the
fix (no traceback), ``--verbose``/FP16LENS_TRACEBACK=1 shows the traceback, Ctrl-C during
a scan keeps the report of the batches done, and a bug of fp16lens still has its traceback.
The models are tiny files written by the tests, run through ``main(argv)``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fp16lens import Report
from fp16lens._core import Fp16LensError, OptionError
from fp16lens.cli import main

MODELS = '''
import torch
from torch import nn


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()


class Ids(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)

    def forward(self, ids):
        return self.emb(ids)


def ids():
    torch.manual_seed(0)
    return Ids().eval()


class Interrupts(nn.Module):
    """Ctrl-C on the third call, as a user would press it during a long scan of this model
    (a copy, such as the one the clean verdict's check in real FP16 runs, never gets it)."""

    scanned = None  # the model object the user scans (set by interrupts())

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        if self is Interrupts.scanned:
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
        return self.fc(x)


def interrupts():
    torch.manual_seed(0)
    Interrupts.scanned = Interrupts().eval()
    return Interrupts.scanned


def meta():
    with torch.device("meta"):
        return nn.Linear(4, 4)


def lazy():
    return nn.Sequential(nn.LazyLinear(4))
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("terminal")
    (folder / "models.py").write_text(MODELS)
    pkg = folder / "project"
    pkg.mkdir()
    (pkg / "blocks.py").write_text(
        "from torch import nn\n\ndef stem():\n    return nn.Linear(4, 2)\n"
    )
    (pkg / "net.py").write_text(
        textwrap.dedent(
            """
            from blocks import stem  # a sibling module, as real model files import them


            def build():
                return stem().eval()
            """
        )
    )
    np.savez(folder / "two.npz", np.ones((1, 3, 8, 8), "f4"), np.ones((1, 3, 8, 8), "f4"))
    return folder


def one_line(capsys, argv: list[str], *needles: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("fp16lens: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_input_shape_the_model_refuses(capsys, files):
    one_line(
        capsys,
        ["scan", f"{files}/models.py:cnn", "--input", "1x4x8x8", "--no-progress"],
        "refused its input",
        "1x4x8x8 float32",
        "3 channels",
        "--input",
    )


def test_integer_input_for_a_cnn(capsys, files):
    one_line(
        capsys,
        ["scan", f"{files}/models.py:cnn", "--input", "1x3x8x8", "--dtype", "int64"],
        "1x3x8x8 int64",
        "--dtype",
    )


def test_npz_with_two_arrays_for_a_one_input_model(capsys, files):
    one_line(
        capsys,
        ["scan", f"{files}/models.py:cnn", "--input", str(files / "two.npz")],
        "2 inputs",
        "positional",
    )


def test_float_ids_for_an_embedding(capsys, files):
    one_line(capsys, ["scan", f"{files}/models.py:ids", "--input", "1x5"], "float32", "--dtype")


def test_integer_range_is_half_open_so_a_vocabulary_bound_works(capsys, files):
    """--range 0,100 for a vocabulary of 100 ids: every id valid (it was an IndexError)."""
    code = main(
        [
            "scan",
            f"{files}/models.py:ids",
            "--input",
            "64x50",
            "--dtype",
            "int64",
            "--range",
            "0,100",
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    from fp16lens.cli._inputs import InputSpec

    (ids,) = InputSpec(((4096,),), (torch.int64,), 0, 100).make()[0]
    assert int(ids.min()) == 0 and int(ids.max()) == 99
    one_line(
        capsys,
        [
            "scan",
            f"{files}/models.py:ids",
            "--input",
            "1x5",
            "--dtype",
            "int64",
            "--range",
            "0.2,0.7",
        ],
        "holds no integer",
    )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["scan", "{m}:cnn", "--input", "1x3x8x8", "--threshold", "-1"], "threshold must be"),
        (["verify", "{m}:cnn", "{m}:cnn", "--input", "1x3x8x8", "--tolerance", "2"], "min_cosine"),
        (["scan", "{m}:cnn", "--input", "1x3x8x8", "--kwargs", '{"sed": 1}'], "takes no keyword"),
        (["scan", "{m}:meta", "--input", "1x4"], "meta device"),
        (["scan", "{m}:lazy", "--input", "1x4"], "lazy"),
    ],
)
def test_option_and_model_mistakes(capsys, files, argv, needle):
    one_line(capsys, [a.replace("{m}", f"{files}/models.py") for a in argv], needle)


def test_option_errors_stay_value_errors_in_python():
    from fp16lens.verify import Tolerance
    from fp16lens.watch import WatchOptions

    for make in (lambda: WatchOptions(threshold=-1), lambda: Tolerance(min_cosine=2)):
        with pytest.raises(ValueError) as info:
            make()
        assert isinstance(info.value, OptionError) and isinstance(info.value, Fp16LensError)


def test_a_file_imports_its_neighbours(capsys, files):
    code = main(["scan", f"{files}/project/net.py:build", "--input", "1x4", "--no-progress"])
    assert code == 0, capsys.readouterr().err


def test_verbose_shows_the_traceback(files, monkeypatch):
    monkeypatch.setenv("FP16LENS_TRACEBACK", "1")
    with pytest.raises(OptionError):
        main(["scan", f"{files}/models.py:cnn", "--input", "1x3x8x8", "--threshold", "-1"])
    with pytest.raises(RuntimeError, match="3 channels"):
        main(["scan", f"{files}/models.py:cnn", "--input", "1x4x8x8", "--no-progress"])


def test_a_bug_of_fp16lens_keeps_its_traceback(files, monkeypatch):
    """The model runs its input fine outside fp16lens: the error is fp16lens's own."""
    import fp16lens.cli._cmd_scan as cmd

    def broken(*args, **kwargs):
        raise RuntimeError("a bug inside fp16lens")

    monkeypatch.setattr(cmd, "watch_batches", broken)
    with pytest.raises(RuntimeError, match="a bug inside fp16lens"):
        main(["scan", f"{files}/models.py:cnn", "--input", "1x3x8x8"])


def test_ctrl_c_saves_the_report_of_the_batches_done(capsys, files, tmp_path):
    saved = tmp_path / "partial.json"
    code = main(
        [
            "scan",
            f"{files}/models.py:interrupts",
            "--input",
            "2x4",
            "--batches",
            "5",
            "--save",
            str(saved),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 130
    assert "interrupted during batch 3 of 5 (2 ran whole)" in err and str(saved) in err
    assert "Traceback" not in err
    report = Report.load(saved)
    assert report.sites["fc"].calls == 2  # the third call stopped before fc ran


def test_ctrl_c_without_save_exits_130_in_one_line(capsys, files, tmp_path):
    code = main(
        [
            "scan",
            f"{files}/models.py:interrupts",
            "--input",
            "2x4",
            "--batches",
            "2",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err  # two calls: no Ctrl-C
    code = main(
        [
            "scan",
            f"{files}/models.py:interrupts",
            "--input",
            "2x4",
            "--batches",
            "5",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 130 and err.strip().splitlines() == [
        "fp16lens: interrupted during batch 3 of 5 (2 ran whole); nothing saved (add --save PATH "
        "to keep a partial report)"
    ]


SLOW = """
import os, time
import torch
from torch import nn


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            open(os.environ["MARK"], "w").close()  # the test sends SIGINT from here on
        time.sleep(0.05)
        return self.fc(x)


def build():
    torch.manual_seed(0)
    return Slow().eval()
"""


def test_sigint_during_a_scan_saves_a_partial_report(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "slow.py").write_text(SLOW)
    mark, saved = tmp_path / "started", tmp_path / "partial.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fp16lens",
            "scan",
            f"{tmp_path}/slow.py:build",
            "--input",
            "2x4",
            "--batches",
            "300",
            "--save",
            str(saved),
            "--no-progress",
        ],
        env={**os.environ, "MARK": str(mark)},
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it: a shell that starts this suite in the background
        # without job control hands SIGINT down ignored, and Python then keeps ignoring it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted during batch" in err
    report = Report.load(saved)
    assert 2 <= report.sites["fc"].calls < 300


def test_save_is_repeatable_and_a_json_summary_is_not_taken_for_a_report(capsys, files, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.html"
    code = main(
        [
            "scan",
            f"{files}/models.py:cnn",
            "--input",
            "1x3x8x8",
            "--save",
            str(a),
            "--save",
            str(b),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and a.is_file() and b.is_file() and "<html" in b.read_text().lower()
    summary = tmp_path / "summary.json"
    summary.write_text(out)
    one_line(capsys, ["show", str(summary)], "summary", "--save report.json")
    assert main(["show", str(a)]) == 0


def test_a_file_that_is_not_a_pt2_says_so_in_one_line(capfd, tmp_path):
    import zipfile

    (tmp_path / "text.pt2").write_text("hello")
    with zipfile.ZipFile(tmp_path / "zip.pt2", "w") as z:
        z.writestr("x", "y")
    for name in ("text.pt2", "zip.pt2"):
        code = main(["scan", str(tmp_path / name), "--input", "1x3"])
        err = capfd.readouterr().err
        assert code == 2 and err.strip().splitlines() == [err.strip()], err
        assert "is not a torch.export program" in err


@pytest.mark.parametrize("command", ["scan", "verify"])
def test_verbose_flag_shows_the_traceback(files, command):
    model = f"{files}/models.py:cnn"
    argv = [
        command,
        model,
        *([model] if command == "verify" else []),
        "--input",
        "1x4x8x8",
        "--verbose",
    ]
    with pytest.raises(RuntimeError, match="3 channels"):
        main(argv)


def test_batches_that_do_not_apply_are_said(capsys):
    code = main(["scan", "demo", "--batches", "3", "--no-progress"])
    err = capsys.readouterr().err
    assert code in (0, 1) and "--batches 3 does not apply" in err


def test_verify_against_the_onnx_file_of_another_model(capsys, files, tmp_path):
    pytest.importorskip("onnxruntime")
    (tmp_path / "lin.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(4, 4).eval()\n"
    )
    onnx_path = tmp_path / "lin.onnx"
    assert main(["export", f"{tmp_path}/lin.py:build", "--input", "2x4", "-o", str(onnx_path)]) == 0
    capsys.readouterr()
    one_line(
        capsys,
        ["verify", f"{files}/models.py:cnn", str(onnx_path), "--input", "1x3x8x8"],
        "ONNX file refused the inputs",
        "Invalid rank",
        "exported from this model",
    )


def _linear_onnx(folder: Path, batch: int) -> Path:
    """An FP32 .onnx file of nn.Linear(4, 4) exported with a fixed first axis ``batch``."""
    pytest.importorskip("onnxruntime")
    (folder / "lin.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(4, 4).eval()\n"
    )
    onnx_path = folder / "lin.onnx"
    fp32 = ["--input", f"{batch}x4", "--precision", "fp32", "-o", str(onnx_path)]
    assert main(["export", f"{folder}/lin.py:build", *fp32]) == 0
    return onnx_path


def test_an_onnx_file_with_a_fixed_batch_takes_a_file_of_its_items(capsys, tmp_path):
    """A calibration file of 8 items for a graph whose batch is 1: split into its items
    (the plan says so) and the file written; a file of items of another width: one line
    naming both shapes, nothing written."""
    onnx_path = _linear_onnx(tmp_path, batch=1)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cal.npz", x=rng.normal(size=(8, 4)).astype(np.float32))
    np.savez(tmp_path / "wide.npz", x=rng.normal(size=(8, 5)).astype(np.float32))
    capsys.readouterr()
    argv = ["export", str(onnx_path), "-o", str(tmp_path / "q.onnx"), "--precision", "int8"]
    line = one_line(
        capsys,
        [*argv, "--input", str(tmp_path / "wide.npz")],
        "has shape 8x5 where the graph takes 1x4",
    )
    assert "Please fix" not in line  # ONNX Runtime's own advice, which names no flag
    assert not (tmp_path / "q.onnx").exists()
    assert main([*argv, "--input", str(tmp_path / "cal.npz")]) == 0
    assert (tmp_path / "q.onnx").exists()
    out = " ".join(capsys.readouterr().out.split())
    assert "the calibration batch of 8 items split into its items" in out, out


def test_every_command_takes_a_file_of_items_for_a_graph_of_batch_one(capsys, tmp_path):
    """A file of 8 items for an .onnx graph exported with batch 1: scan, verify (an ONNX or
    a torch reference) and the FP16 export's own check run it item by item, with a note,
    and verify's numbers are the ones --batch-size 1 gives. The FP16 check really runs:
    a graph whose real FP16 is inf (ground truth: torch in FP16, no fp16lens) exits 1
    naming the failure, where the check used to be skipped with a warning."""
    pytest.importorskip("onnxruntime")
    (tmp_path / "big.py").write_text(
        "import torch\n\ndef build():\n    torch.manual_seed(0)\n"
        "    fc = torch.nn.Linear(4, 4)\n    with torch.no_grad():\n"
        "        fc.weight.fill_(2.0e4)\n"
        "    return torch.nn.Sequential(fc, torch.nn.ReLU(), torch.nn.Linear(4, 3)).eval()\n"
    )
    model = f"{tmp_path}/big.py:build"
    fp32 = tmp_path / "big.onnx"
    assert main(["export", model, "--input", "1x4", "--precision", "fp32", "-o", str(fp32)]) == 0
    x = np.random.default_rng(0).uniform(1, 2, size=(8, 4)).astype(np.float32)
    np.savez(tmp_path / "cal.npz", x=x)
    np.savez(tmp_path / "small.npz", x=x / 1e5)
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 4)
    with torch.no_grad():
        fc.weight.fill_(2.0e4)
    truth = torch.nn.Sequential(fc, torch.nn.ReLU(), torch.nn.Linear(4, 3)).half()
    assert not torch.isfinite(truth(torch.from_numpy(x).half())).all()  # real FP16 breaks
    assert torch.isfinite(truth(torch.from_numpy(x / 1e5).half())).all()
    capsys.readouterr()
    note = "the batch of 8 items split into its items (the graph's first axis is 1)"

    half = tmp_path / "half.onnx"
    argv = ["export", str(fp32), "--precision", "fp16", "-o", str(half)]
    assert main([*argv, "--input", str(tmp_path / "cal.npz")]) == 1
    got = capsys.readouterr()
    out = " ".join(got.out.split())
    assert note in got.err and "fails in real FP16 on the evaluation batches" in out, out
    assert "was not run in real FP16" not in out
    assert main([*argv, "--input", str(tmp_path / "small.npz")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "checked in real FP16 on the evaluation batches (--input)" in out, out

    small = str(tmp_path / "small.npz")
    code = main(["scan", str(fp32), "--input", small, "--no-progress"])
    got = capsys.readouterr()
    assert code == 0 and note in got.err and "over 8 batches" in " ".join(got.out.split())
    for reference in (str(fp32), model):
        code = main(["verify", reference, str(half), "--input", small, "--json"])
        got = capsys.readouterr()
        assert code == 0 and note in got.err, got.err
        assert (
            main(["verify", reference, str(half), "--input", small, "--json", "--batch-size", "1"])
            == 0
        )
        assert got.out == capsys.readouterr().out  # the same numbers, item by item


def test_a_file_the_graph_batch_does_not_divide_is_refused_in_one_line(capsys, tmp_path):
    """6 items for a graph of batch 4: not split (no batch of 4 holds them all), and the
    refusal names both shapes; 8 items: two batches of 4."""
    onnx_path = _linear_onnx(tmp_path, batch=4)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "six.npz", x=rng.normal(size=(6, 4)).astype(np.float32))
    np.savez(tmp_path / "eight.npz", x=rng.normal(size=(8, 4)).astype(np.float32))
    capsys.readouterr()
    one_line(
        capsys,
        ["scan", str(onnx_path), "--input", str(tmp_path / "six.npz"), "--no-progress"],
        "(6, 4)",
    )
    code = main(["scan", str(onnx_path), "--input", str(tmp_path / "eight.npz"), "--no-progress"])
    got = capsys.readouterr()
    assert code == 0, got.err
    assert "the batch of 8 items split into 2 batches of 4" in got.err
    assert "over 2 batches" in " ".join(got.out.split())


def test_a_graph_fixed_to_the_files_batch_is_said(capsys, tmp_path):
    """A torch MODEL exported from an --input file of 8 items takes exactly 8 (its example
    fixes the axes): a note says so and names the two ways out, each of which the written
    file then shows (a free first axis; batch 1 calibrated by the file)."""
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    (tmp_path / "lin.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(4, 4).eval()\n"
    )
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    np.savez(tmp_path / "cal.npz", x=x)
    model, cal = f"{tmp_path}/lin.py:build", str(tmp_path / "cal.npz")

    def first_axis(argv: list[str]) -> tuple[object, str]:
        out = tmp_path / "m.onnx"
        assert main(["export", model, "--precision", "int8", "-o", str(out), *argv]) == 0
        dim = onnx.load(out).graph.input[0].type.tensor_type.shape.dim[0]
        return dim.dim_value or dim.dim_param, capsys.readouterr().err

    capsys.readouterr()
    size, err = first_axis(["--input", cal])
    assert size == 8 and "the graph takes exactly 8 items per batch" in err, err
    assert "--dynamic batch" in err and "--calibration" in err
    size, err = first_axis(["--input", cal, "--dynamic", "batch"])
    assert isinstance(size, str) and "exactly" not in err
    size, err = first_axis(["--input", "1x4", "--calibration", cal])
    assert size == 1 and "exactly" not in err


def test_a_threshold_never_lets_real_fp16_overflow_pass(capsys, tmp_path):
    """--threshold 1e9 would have passed a model whose real FP16 is inf; a margin below
    65504 is named as the limit of the spans."""
    (tmp_path / "big.py").write_text(
        textwrap.dedent(
            """
        import torch

        def build():
            torch.manual_seed(0)
            fc = torch.nn.Linear(4, 4)
            with torch.no_grad():
                fc.weight.fill_(2.0e4)
            return torch.nn.Sequential(fc, torch.nn.ReLU()).eval()
        """
        )
    )
    model = f"{tmp_path}/big.py:build"
    import copy
    import importlib.util

    spec = importlib.util.spec_from_file_location("big_for_truth", tmp_path / "big.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = mod.build()
    x = torch.rand(1, 4) + 1.0
    assert torch.isinf(copy.deepcopy(m).half()(x.half())).any()  # ground truth: real FP16
    one_line(
        capsys,
        ["scan", model, "--input", "1x4", "--threshold", "1e9", "--fail-on", "any"],
        "(0, 65504]",
    )
    code = main(
        [
            "scan",
            model,
            "--input",
            "1x4",
            "--range",
            "1,2",
            "--threshold",
            "32768",
            "--fail-on",
            "any",
        ]
    )
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1 and "±32768 (the threshold, a margin below FP16's 65504)" in out
    # values FP16 holds are highlighted by a lower threshold, never counted as overflow
    code = main(
        [
            "scan",
            model,
            "--input",
            "1x4",
            "--range",
            "0.25,0.5",
            "--threshold",
            "16384",
            "--fail-on",
            "any",
        ]
    )
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "FP16-safe" in out and "past the threshold 16384" in out
    m.eval()
    x = torch.rand(1, 4) * 0.25 + 0.25
    assert (
        16384 < float(m(x).abs().max()) < 65504
        and torch.isfinite(copy.deepcopy(m).half()(x.half())).all()
    )


def test_output_paths_follow_one_rule(capsys, files, tmp_path):
    """Missing parent folders are made for every output (scan --save included); a suffix
    that is not the format written is refused before any work."""
    deep = tmp_path / "new" / "deeper" / "r.json"
    assert main(["scan", f"{files}/models.py:cnn", "--input", "1x3x8x8", "--save", str(deep)]) == 0
    assert Report.load(deep).sites
    capsys.readouterr()
    out = tmp_path / "model.pt"
    one_line(
        capsys,
        ["export", f"{files}/models.py:cnn", "--input", "1x3x8x8", "-o", str(out)],
        ".onnx suffix",
    )
    assert not out.exists()


def test_generated_batches_are_made_one_at_a_time():
    """--batches 1000 of 1x3x224x224 held 1000 tensors (1.18 GB) before the first forward."""
    import gc
    import weakref

    from fp16lens.cli._inputs import InputSpec

    spec = InputSpec(((1, 3, 224, 224),), (torch.float32,), batches=1000)
    batches = spec.make()
    assert len(batches) == 1000
    first = batches[0][0]
    alive = weakref.ref(first)
    assert torch.equal(first, batches[0][0]) and not torch.equal(first, batches[1][0])
    del first
    gc.collect()
    assert alive() is None  # nothing keeps a made batch
    cast = batches.map(lambda b: tuple(t.half() for t in b))
    assert len(cast) == 1000 and cast[999][0].dtype == torch.float16
    assert torch.equal(cast[5][0], batches[5][0].half())


def test_export_io_dtype_from_the_terminal(capsys, files, tmp_path):
    onnx = pytest.importorskip("onnx")
    out = {}
    for io in ("fp32", "fp16"):
        path = tmp_path / f"{io}.onnx"
        code = main(
            [
                "export",
                f"{files}/models.py:cnn",
                "--input",
                "1x3x8x8",
                "-o",
                str(path),
                "--io-dtype",
                io,
            ]
        )
        assert code == 0, capsys.readouterr().err
        graph = onnx.load(str(path)).graph
        out[io] = {
            graph.input[0].type.tensor_type.elem_type,
            graph.output[0].type.tensor_type.elem_type,
        }
    assert out == {"fp32": {onnx.TensorProto.FLOAT}, "fp16": {onnx.TensorProto.FLOAT16}}


def test_export_names_inputs_and_outputs_and_takes_dynamic_axes(capsys, files, tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "d.onnx"
    code = main(
        [
            "export",
            f"{files}/models.py:cnn",
            "--input",
            "2x3x8x8",
            "-o",
            str(path),
            "--dynamic",
            "batch",
        ]
    )
    assert code == 0, capsys.readouterr().err
    graph = onnx.load(str(path)).graph

    def dims(v):
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    assert [(v.name, dims(v)) for v in (*graph.input, *graph.output)] == [
        ("input", ["batch", 3, 8, 8]),
        ("output", ["batch", 4, 6, 6]),
    ]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((5, 3, 8, 8), dtype=np.float32)
    (got,) = session.run(None, {"input": x})
    import importlib.util

    spec = importlib.util.spec_from_file_location("terminal_models", files / "models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with torch.no_grad():
        want = mod.cnn()(torch.from_numpy(x)).numpy()
    assert got.shape == (5, 4, 6, 6) and np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    one_line(
        capsys,
        [
            "export",
            f"{files}/models.py:cnn",
            "--input",
            "2x3x8x8",
            "-o",
            str(path),
            "--dynamic",
            "time",
        ],
        "batch, sequence",
    )


def test_meta_and_lazy_models_are_named_in_python_too(tmp_path):
    import fp16lens
    from fp16lens._core import ExportError, WatchError

    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4))
    for model, what in ((meta, "meta device"), (lazy, "lazy")):
        with pytest.raises(WatchError, match=what), fp16lens.watch(model):
            pass
    pytest.importorskip("onnx")
    with pytest.raises(ExportError, match="meta device"):
        fp16lens.export(meta, (torch.rand(1, 4),), tmp_path / "m.onnx")


def test_an_onnx_npz_whose_names_are_not_the_graphs_matches_by_position(capsys, files, tmp_path):
    pytest.importorskip("onnxruntime")
    onnx_file = tmp_path / "cnn.onnx"
    assert (
        main(
            [
                "export",
                f"{files}/models.py:cnn",
                "--input",
                "1x3x8x8",
                "-o",
                str(onnx_file),
                "--precision",
                "fp32",
            ]
        )
        == 0
    )
    np.savez(tmp_path / "named.npz", images=np.ones((1, 3, 8, 8), "f4"))  # the graph says "input"
    capsys.readouterr()
    code = main(["scan", str(onnx_file), "--input", str(tmp_path / "named.npz"), "--no-progress"])
    assert code == 0, capsys.readouterr().err


def test_onnx_scan_with_a_missing_npz_is_one_line_and_exit_2(tmp_path, capsys):
    pytest.importorskip("onnx")
    import fp16lens

    path = tmp_path / "m.onnx"
    fp16lens.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),), path, "fp32")
    assert main(["scan", str(path), "--input", str(tmp_path / "nope.npz")]) == 2
    err = capsys.readouterr().err
    assert "cannot read --input" in err and "Traceback" not in err and len(err.splitlines()) == 1
    np.savez(tmp_path / "x.npz", x=np.ones((2, 2), "f4"))
    argv = ["export", str(path), "--precision", "int8", "-o", str(tmp_path / "q.onnx")]
    argv += ["--calibration", str(tmp_path / "nope.npz"), "--input", str(tmp_path / "x.npz")]
    assert main(argv) == 2  # the flag that names the missing file, not another
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp16lens: error: cannot read --calibration") and "\n" not in err, err
    assert "shapes such as" not in err and not (tmp_path / "q.onnx").exists()


def _overflowing_report(path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
    ).eval()
    with torch.no_grad():
        model[0].weight.mul_(3e4)
    from fp16lens import watch

    with watch(model) as lens, torch.no_grad():
        model(torch.randn(8, 4) * 10)
    lens.report.save(path)


@pytest.mark.parametrize("encoding", ["ascii", "cp1252"])
def test_a_terminal_that_cannot_hold_the_symbols_gets_them_in_ascii(tmp_path, encoding):
    """A Windows console piped to a file writes cp1252, a CI log may be ASCII: the report's
    symbols (✗, ≤, →, the headroom bars) are written as ASCII that reads the same, never a
    UnicodeEncodeError half-way through; an error is still one line and exit 2."""
    import os
    import subprocess
    import sys

    report = tmp_path / "r.json"
    _overflowing_report(report)
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    run = [sys.executable, "-m", "fp16lens", "show", str(report)]
    done = subprocess.run(run, capture_output=True, env=env, timeout=300)
    out, err = done.stdout.decode(encoding), done.stderr.decode(encoding)
    assert done.returncode == 0, err
    assert "Traceback" not in err
    assert out.startswith("X Sequential: 1 overflow span"), out[:200]
    assert "->" in out and "?" not in out.replace("?)", "")
    if encoding == "cp1252":
        return  # one encoding shows the rest: the same words, UTF-8 untouched, one error line
    utf8 = subprocess.run(run, capture_output=True, env={**env, "PYTHONIOENCODING": "utf-8"})
    assert utf8.stdout.decode("utf-8").startswith("✗ Sequential: 1 overflow span")

    missing = subprocess.run(
        [*run[:-1], str(tmp_path / "nosuch.json")], capture_output=True, env=env, timeout=300
    )
    assert missing.returncode == 2
    lines = missing.stderr.decode(encoding).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp16lens: error: cannot read report")


def test_output_to_a_file_is_wide_unless_columns_says_otherwise(tmp_path):
    """Piped to a file, the report is 120 columns wide so no table column is cut; a width
    the user sets with COLUMNS (``COLUMNS=60 fp16lens show r.json > log``) is kept."""
    import os
    import subprocess
    import sys

    report = tmp_path / "r.json"
    _overflowing_report(report)
    run = [sys.executable, "-m", "fp16lens", "show", str(report)]
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}

    def widest(extra):
        done = subprocess.run(run, capture_output=True, text=True, env={**env, **extra})
        assert done.returncode == 0, done.stderr
        return max(len(line) for line in done.stdout.splitlines())

    assert 100 < widest({}) <= 120
    assert widest({"COLUMNS": "60"}) <= 60
