"""Common mistakes named by the CLI and the API (issue #16): one test per mistake.

Each CLI mistake exits with a status that says it (2: the user's input, 1: a failed
check), a one-line message without a traceback, and writes nothing when it fails. Overflow
ground truth comes from real FP16 runs (``copy.deepcopy(m).half()(x.half())``), INT8
parity from ONNX Runtime, never from fp16lens itself.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

import fp16lens
from fp16lens._core import Fp16LensError, ReportError, WatchError
from fp16lens._core.errors import OutputPathError
from fp16lens._core.paths import check_writable
from fp16lens.cli import main
from fp16lens.cli._inputargs import attach_negative_values
from fp16lens.cli._parser import build_parser

import models

TINY_MODELS = '''
import torch
from torch import nn

from models import MulHardswish  # tests/ is on the path of the tests' processes


class OutputOverflow(nn.Module):
    """fc's output, the model output itself, is beyond 65504: no rescaling region exists."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc.weight.abs_().mul_(1.0e5)  # every weight stays below 65504

    def forward(self, x):
        return self.fc(x)


def output_overflow():
    torch.manual_seed(0)
    return OutputOverflow().eval(), (torch.rand(2, 8) + 0.5,)


class Traced(nn.Module):
    """torch.export cannot trace .item() control flow: dynamo fails, TorchScript exports."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) if x.sum().item() > 0 else self.fc(-x)


def data_dependent():
    torch.manual_seed(0)
    return Traced().eval(), (torch.rand(2, 4),)


class LongNames(nn.Module):
    """Qualified names as long as a real detector's, and one site beyond FP16."""

    def __init__(self):
        super().__init__()
        self.backbone_feature_pyramid_lateral_block = nn.Sequential(
            nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)
        )
        with torch.no_grad():
            self.backbone_feature_pyramid_lateral_block[0].weight.abs_().mul_(1.0e5)

    def forward(self, x):
        return self.backbone_feature_pyramid_lateral_block(x)


class UntraceableMul(MulHardswish):
    """tests/models.py's hardswish multiply (3e4 * x squared) in the model's own forward,
    behind a branch on a value that torch.fx cannot trace."""

    def forward(self, x):
        x = self.fc(x)
        if bool(x.abs().amax() > 0):
            x = x * torch.nn.functional.relu6(x + 3) / 6
        return self.out(x / 1024)


def untraceable_mul():
    torch.manual_seed(1)
    return UntraceableMul().eval(), (torch.rand(2, 8) * 0.5 + 0.5,)


def long_names():
    torch.manual_seed(0)
    return LongNames().eval(), (torch.rand(2, 8) + 0.5,)


def half_long_names():
    model, inputs = long_names()
    return model.half(), inputs
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny_models.py"
    path.write_text(TINY_MODELS)
    return path


def load_tiny(tiny: Path, name: str):
    from fp16lens.cli._models import load_model

    loaded = load_model(f"{tiny}:{name}")
    return loaded.model, loaded.example_inputs


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fp16lens: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---- 1. float64 inputs (numpy's default) -----------------------------------------------
def test_float64_npz_is_cast_to_the_model_dtype_with_a_note(capsys, tmp_path):
    model, (x,) = models.clean()
    batch = tmp_path / "batch.npz"
    np.savez(batch, x=x.double().numpy())
    with pytest.raises(RuntimeError):  # the mistake itself: torch refuses double inputs
        model(x.double())
    code, out, err = run(capsys, "scan", "models:clean", "--input", str(batch), "--json")
    assert code == 0, err
    assert err.strip() == "fp16lens: note: float64 inputs cast to the model's float32"
    assert json.loads(out)["clean"]  # a clean model keeps its clean verdict

    # the API does not cast (a model may mean float64): a WatchError names the mismatch
    with pytest.raises(WatchError) as info:
        fp16lens.scan(model, [(x.double(),)], progress=False)
    assert "float64" in str(info.value) and "x.to(torch.float32)" in str(info.value)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_a_model_that_casts_float64_itself_still_scans():
    class Casts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x.float())

    model = Casts().eval()
    report = fp16lens.scan(model, [torch.rand(3, 4, dtype=torch.float64)], progress=False)
    assert not report.spans  # it scans; its values are all in range
    # but its forward casts to FP32 itself, so its .half() cannot run (ground truth), and the
    # clean verdict's check in real FP16 says so instead of "FP16-safe"
    with pytest.raises(RuntimeError, match="same dtype"):
        copy.deepcopy(model).half()(torch.rand(3, 4).half())
    (f,) = report.findings
    assert f.kind == "fp16-run" and "cannot run in FP16" in f.detail


# ---- 2. unwritable output paths: named, before the work, nothing written ---------------
def unwritable(tmp_path: Path, name: str) -> list[Path]:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    paths = [blocker / name]  # a folder that is a file: every platform
    if Path("/proc").is_dir():
        paths.append(Path("/proc") / name)  # root passes os.access there; writing fails
    return paths


def test_check_writable_probes_and_leaves_nothing(tmp_path):
    before = listing(tmp_path)
    assert (
        check_writable(tmp_path / "new" / "deeper" / "m.onnx")
        == tmp_path / "new" / "deeper" / "m.onnx"
    )
    assert check_writable(tmp_path / "out_dir", folder=True)
    assert listing(tmp_path) == before  # no probe file, no folder made
    with pytest.raises(OutputPathError) as info:
        check_writable(tmp_path)  # a folder where a file goes
    assert isinstance(info.value, OSError) and "writable" in str(info.value)


def test_unwritable_outputs_fail_before_the_work(capsys, tmp_path, monkeypatch):
    import fp16lens.cli._cmd_export as cmd_export
    import fp16lens.cli._cmd_scan as cmd_scan
    import fp16lens.demo._build as demo_build

    def no_work(*a, **k):
        raise AssertionError("the output path is checked before any work")

    monkeypatch.setattr(cmd_export, "load_model", no_work)
    monkeypatch.setattr(cmd_scan, "load_model", no_work)
    monkeypatch.setattr(demo_build, "build_demo_model", no_work)
    report = tmp_path / "r.json"
    report.write_text("{}")
    targets = {name: unwritable(tmp_path, name) for name in ("o.onnx", "p.pt2", "d", "r.json")}
    before = listing(tmp_path)
    for target in targets["o.onnx"]:
        one_line_error(*run(capsys, "export", "demo", "-o", str(target))[::2], "cannot write")
    for target in targets["p.pt2"]:
        code, _, err = run(capsys, "patch", "demo", "--report", str(report), "-o", str(target))
        one_line_error(code, err, "cannot write", str(target))
    for target in targets["d"]:
        one_line_error(*run(capsys, "demo", "--out", str(target))[::2], "cannot write")
    for target in targets["r.json"]:
        one_line_error(*run(capsys, "scan", "demo", "--save", str(target))[::2], "cannot write")
    one_line_error(*run(capsys, "scan", "demo", "--save", str(tmp_path / "r.jpg"))[::2], ".json")
    assert listing(tmp_path) == before


def test_unwritable_outputs_in_the_api(tmp_path, monkeypatch):
    pytest.importorskip("onnx")
    import fp16lens.export._export as ex
    from fp16lens.demo import run_demo

    model, inputs = models.clean()
    monkeypatch.setattr(ex, "_export_fp32", lambda *a, **k: pytest.fail("export ran"))
    for target in unwritable(tmp_path, "m.onnx"):
        with pytest.raises(Fp16LensError, match="writable"):
            fp16lens.export(model, inputs, target)
        with pytest.raises(OutputPathError, match="cannot write"):
            run_demo(target.parent / "demo-out", Console(file=io.StringIO()))
    report = fp16lens.scan(model, [inputs], progress=False)
    for target in unwritable(tmp_path, "r.json"):
        with pytest.raises(ReportError, match="cannot write"):
            report.save(target)
    assert listing(tmp_path) == ["a_file"]


# ---- 3. --range with a negative low end ----------------------------------------------
def test_negative_range_parses_and_help_says_so(capsys):
    argv = ["scan", "models:clean", "--input", "1x3x16x16", "--range", "-1,1"]
    args = build_parser().parse_args(attach_negative_values(argv))
    assert args.range == "-1,1" and args.input == ["1x3x16x16"]
    from fp16lens.cli._inputargs import spec_from_args

    (batch,) = spec_from_args(args).make()
    assert batch[0].min() < -0.5 and batch[0].max() <= 1.0
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0 and json.loads(out)["clean"], err


def test_help_documents_negative_range(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scan", "--help"])
    assert "--range -1,1" in " ".join(capsys.readouterr().out.split())


# ---- 4. a patch that leaves something unfixed ------------------------------------------
def test_an_output_span_is_an_island_that_keeps_fp32_and_the_file_exports(capsys, tmp_path, tiny):
    """fc's output, the model output itself, is beyond 65504: patch makes fc an FP32 island
    whose output stays FP32 (it used to stay unfixed); the saved file and its FP16 export
    carry it without being told."""
    model, inputs = load_tiny(tiny, "output_overflow")
    truth = copy.deepcopy(model).half()(inputs[0].half())
    assert not torch.isfinite(truth).all()  # real FP16: the model output overflows
    spec = f"{tiny}:output_overflow"
    report, patched = tmp_path / "r.json", tmp_path / "p.pt2"
    assert run(capsys, "scan", spec, "--save", str(report), "--no-progress")[0] == 0
    code, out, err = run(capsys, "patch", spec, "--report", str(report), "-o", str(patched))
    assert code == 0, out + err
    assert "NOT FIXED" not in out and "fp32_modules=['fc']" in out
    with torch.no_grad():  # torch alone: the saved program under .half()
        got = torch.export.load(str(patched)).module().half()(inputs[0].half())
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    pytest.importorskip("onnxruntime")
    onnx_path = tmp_path / "p.onnx"
    code, _, err = run(
        capsys, "export", str(patched), "-o", str(onnx_path), "--input", "2x8", "--range", "0.5,1.5"
    )
    assert code == 0, err
    code, out, err = run(capsys, "verify", spec, str(onnx_path), "--json")
    assert code == 0 and json.loads(out)["backend"] == "onnx-fp16", out + err


def test_patch_of_a_functional_op_in_an_untraceable_forward_names_what_to_do(
    capsys, tmp_path, tiny
):
    """The multiply of hardswish in the model's own forward, which torch.fx cannot trace (a
    branch on a value): no island can hold it, and patch says what the user can do."""
    report, patched = tmp_path / "r.json", tmp_path / "p.pt"
    model, inputs = load_tiny(tiny, "untraceable_mul")
    assert not torch.isfinite(copy.deepcopy(model).half()(inputs[0].half())).all()
    spec = f"{tiny}:untraceable_mul"
    run(capsys, "scan", spec, "--save", str(report), "--no-progress")
    code, out, _ = run(capsys, "patch", spec, "--report", str(report), "-o", str(patched))
    assert code == 1 and "NOT FIXED" in out and "--fp32-modules" not in out
    assert "move that op into its own nn.Module" in " ".join(out.split())
    # a .pt2 cannot hold this forward: said in one line, with the format that can
    code, _, err = run(
        capsys, "patch", spec, "--report", str(report), "-o", str(tmp_path / "p.pt2")
    )
    assert (
        code == 2 and "save it as TorchScript instead (-o p.pt)" in err and "Traceback" not in err
    )


# ---- 5. scan(m, x) and scan(m, []) ------------------------------------------------------
@pytest.mark.parametrize(
    "batches, needle",
    [
        (torch.rand(1, 3, 16, 16), "bare tensor (1x3x16x16)"),
        ([], "no batch"),
        (iter([]), "no batch"),
        ({"x": torch.rand(1, 3, 16, 16)}, "dict"),
        (3, "iterable"),
    ],
    ids=["tensor", "empty-list", "empty-iterator", "dict", "int"],
)
def test_scan_names_what_to_pass(batches, needle):
    model, inputs = models.clean()
    reference = model(*inputs)
    with pytest.raises(WatchError) as info:
        fp16lens.scan(model, batches, progress=False)
    assert needle in str(info.value) and "scan(model, [x])" in str(info.value)
    assert "scan(model, [(x1, x2)])" in str(info.value)
    assert not model._forward_hooks and torch.equal(model(*inputs), reference)


# ---- 6. verify picks the INT8 backend and explains an INT8 failure ---------------------
def test_verify_picks_onnx_int8_for_a_qdq_file(capsys, tmp_path):
    pytest.importorskip("onnxruntime")
    int8, fp16 = tmp_path / "m8.onnx", tmp_path / "m16.onnx"
    for path, precision in ((int8, "int8"), (fp16, "fp16")):
        code, _, err = run(
            capsys,
            "export",
            "models:clean",
            "-o",
            str(path),
            "--precision",
            precision,
            "--exporter",
            "torchscript",
        )
        assert code == 0, err
    code, out, _ = run(capsys, "verify", "models:clean", str(int8), "--json")
    data = json.loads(out)
    assert data["backend"] == "onnx-int8" and code == (0 if data["passed"] else 1)
    model, inputs = models.clean()
    result = fp16lens.verify(model, str(int8), [inputs])
    assert result.backend == "onnx-int8"
    if not result:  # ONNX Runtime's fused CPU kernels can fail where Q/DQ as written holds
        assert result.advice and "fused" in result.advice[0], result.advice
    assert fp16lens.verify(model, str(fp16), [inputs], backend="auto").backend == "onnx-fp16"


def test_int8_failure_names_the_layers_and_the_fix_works(capsys, tmp_path):
    pytest.importorskip("onnxruntime")
    int8, kept = tmp_path / "o8.onnx", tmp_path / "o8_kept.onnx"
    export = ["export", "models:int8_outlier", "--precision", "int8", "--exporter", "torchscript"]
    assert run(capsys, *export, "-o", str(int8))[0] == 0
    code, out, _ = run(capsys, "verify", "models:int8_outlier", str(int8))
    flat = " ".join(out.split())
    # Q/DQ sit at fc2's input only (where TensorRT computes INT8): the pair act -> fc2
    assert code == 1 and "FAILED" in flat and "act -> fc2" in flat and "--fp32-modules" in flat
    model, inputs = models.int8_outlier()
    result = fp16lens.verify(model, str(int8), [inputs])
    assert not result and result.backend == "onnx-int8"
    suggested = result.advice[-1].split("--fp32-modules ")[1].split()[0]
    assert {"act", "fc2"} <= set(suggested.split(","))
    assert run(capsys, *export, "-o", str(kept), "--fp32-modules", suggested)[0] == 0
    assert fp16lens.verify(model, str(kept), [inputs]), "the advice must fix the INT8 check"


# ---- 7. piped output keeps every column -------------------------------------------------
def test_piped_output_keeps_the_headroom_column(capsys, tmp_path, tiny):
    spec = f"{tiny}:long_names"
    report_path = tmp_path / "r.json"
    code, out, _ = run(capsys, "scan", spec, "--save", str(report_path), "--no-progress")
    assert code == 0
    hottest = out[out.index("Hottest sites") :].splitlines()
    assert "headroom" in hottest[1] and "2^-14" in hottest[1]
    rows = [r for r in hottest if r.startswith("backbone_feature_pyramid_lateral_block.")]
    assert len(rows) == 3 and all("bits" in r for r in rows), hottest
    # at rich's 80-column default for a pipe the table shortens names, and keeps the headroom
    from fp16lens.report import Report
    from fp16lens.report._render import print_report

    narrow = Console(file=io.StringIO(), width=80, record=True)
    print_report(Report.load(report_path), console=narrow)
    text = narrow.export_text()
    table = text[text.index("Hottest sites") :].splitlines()
    assert sum("bits" in r for r in table) >= 3 and all(len(r.rstrip()) <= 80 for r in table)


# ---- 8. torch's chatter stays out of `fp16lens export` ----------------------------------
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")  # the --verbose run lets torch's warnings through
def test_export_keeps_torch_output_quiet_unless_verbose(capfd, tmp_path, tiny):
    pytest.importorskip("onnxscript")
    spec = f"{tiny}:data_dependent"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["export", spec, "-o", str(tmp_path / "q.onnx")])
    out, err = capfd.readouterr()
    assert code == 0 and "TorchScript exporter instead" in out
    assert "\x1b[" not in out + err and "Warning" not in err and "def forward" not in err, err
    assert [str(w.message) for w in caught] == []  # torch's deprecations stayed inside
    code = main(["export", spec, "-o", str(tmp_path / "v.onnx"), "--verbose"])
    _, err = capfd.readouterr()
    assert code == 0 and "def forward" in err  # torch.export's own dump, let through


# ---- 9. the demo's missing-dependency hint names the extra ------------------------------
def test_demo_hint_without_onnx_names_the_extra(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["onnx"] = None
        from rich.console import Console
        from fp16lens.demo import build_demo_model
        from fp16lens.demo._journey import _export, _stages
        model, inputs = build_demo_model()
        console = Console(record=True, width=200, file=open({os.devnull!r}, "w"))
        _export(_stages(), console, model, model, inputs, __import__("pathlib").Path({str(tmp_path)!r}))
        print(console.export_text())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ONNX export skipped" in proc.stdout
    assert "pip install -e '.[onnx]'" in proc.stdout, proc.stdout


# ---- a model already in float16 --------------------------------------------------------
def test_a_float16_model_is_refused_in_one_line(capsys, tmp_path, tiny):
    model, (x,) = load_tiny(tiny, "long_names")
    assert not torch.isfinite(model.half()(x.half())).all()  # its own values: FP16's inf
    fp32 = tmp_path / "fp32.onnx"  # a candidate for verify, exported from the FP32 model
    assert (
        run(capsys, "export", f"{tiny}:long_names", "-o", str(fp32), "--precision", "fp32")[0] == 0
    )
    for command in (["scan"], ["export", "-o", str(tmp_path / "h.onnx")], ["verify", str(fp32)]):
        code, _out, err = run(capsys, command[0], f"{tiny}:half_long_names", *command[1:])
        one_line_error(code, err, "float16", "model.float()")
    report = tmp_path / "r.json"  # made from the FP32 model
    assert run(capsys, "scan", f"{tiny}:long_names", "--save", str(report))[0] == 0
    code, _out, err = run(
        capsys,
        "patch",
        f"{tiny}:half_long_names",
        "--report",
        str(report),
        "-o",
        str(tmp_path / "p.pt2"),
    )
    one_line_error(code, err, "float16", "model.float()")
    assert listing(tmp_path) == ["fp32.onnx", "r.json"]


# ---- raw uint8 pixels in a file ---------------------------------------------------------
def test_dtype_casts_a_files_arrays_as_the_refusal_says(capsys, tmp_path):
    pixels = tmp_path / "pixels.npy"
    rng = np.random.default_rng(0)
    np.save(pixels, rng.integers(0, 256, (1, 3, 64, 64), dtype=np.uint8))
    code, _out, err = run(capsys, "scan", "demo", "--input", str(pixels))
    one_line_error(code, err, "uint8", "--dtype")  # the refusal names --dtype ...
    code, out, err = run(
        capsys, "scan", "demo", "--input", str(pixels), "--dtype", "float32", "--json"
    )
    assert code == 0, err  # ... and --dtype float32 casts the file's pixels
    assert json.loads(out)["spans"]
    # ground truth: the demo model on those pixels in real FP16
    model, _ = fp16lens.demo.build_demo_model()
    x = torch.from_numpy(np.load(pixels)).float()
    assert (
        torch.isfinite(model(x)).all()
        and not torch.isfinite(copy.deepcopy(model).half()(x.half())).all()
    )
