"""The CLI in-process through main(argv): exit codes, --json output, one-line errors.

Overflow sites asserted here come from real FP16 (tests/models.first_inf_site_fp16),
not from fp16lens.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from fp16lens.cli import main
from fp16lens.demo import build_demo_model

import models


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _err = run(capsys, *argv, "--json")
    return code, json.loads(out)


def assert_user_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp16lens: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


def test_help_and_usage_errors(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "scan" in out and "demo" in out
    assert run(capsys)[0] == 2  # a command is required
    code, _, err = run(capsys, "scan", "demo", "--fail-on", "sometimes")
    assert code == 2 and "invalid choice" in err
    code, _, err = run(
        capsys, "patch", "demo", "--report", "r.json", "-o", "x.pt2", "--min-cosine", "abc"
    )
    assert code == 2 and err.count("\n") == 1  # one line, not the usage block
    assert "--min-cosine: invalid float value: 'abc'" in err and "fp16lens patch --help" in err


def test_scan_demo_finds_the_real_fp16_overflow_and_fails_the_gate(capsys, tmp_path):
    model, inputs = build_demo_model()
    truth, _ = models.first_inf_site_fp16(model, inputs)
    saved = tmp_path / "report.json"
    code, data = run_json(capsys, "scan", "demo", "--fail-on", "overflow", "--save", str(saved))
    assert code == 1 and data["failed"] and not data["clean"]
    assert data["spans"][0]["start"] == truth == "backbone.layer4.1.bn2"
    assert data["spans"][0]["peak"] > 65504 and data["saved"] == str(saved)

    code, shown = run_json(capsys, "show", str(saved))
    assert code == 0 and shown["spans"] == data["spans"]
    code, full = run_json(capsys, "show", str(saved), "--full")
    assert code == 0 and len(full["sites"]) == data["sites"]
    code, out, _ = run(capsys, "show", str(saved))
    assert code == 0 and "backbone.layer4.1.bn2" in out
    code, full_out, _ = run(capsys, "show", str(saved), "--full")
    assert code == 0 and "backbone.conv1" in full_out and "backbone.conv1" not in out


def test_scan_functional_op_and_clean_model(capsys):
    _, op = models.first_inf_site_fp16(*models.functional_mul())
    code, data = run_json(capsys, "scan", "models:functional_mul", "--fail-on", "any")
    assert code == 1 and data["spans"][0]["start"] == f":{op}" == ":mul"
    assert models.first_inf_site_fp16(*models.clean()) is None
    code, data = run_json(capsys, "scan", "models:clean", "--fail-on", "any", "--batches", "3")
    assert code == 0 and data["clean"] and data["failed"] == []
    assert data["batches"] == 1  # the builder's own inputs: --batches applies to shapes


def test_scan_generated_batches_and_input_files(capsys, tmp_path):
    code, data = run_json(
        capsys, "scan", "models:clean", "--input", "1x3x8x8", "--batches", "3", "--no-progress"
    )
    assert code == 0 and data["batches"] == 3
    np.savez(tmp_path / "x.npz", x=np.random.rand(4, 3, 8, 8).astype(np.float32))
    code, data = run_json(
        capsys, "scan", "models:clean", "--input", str(tmp_path / "x.npz"), "--batch-size", "2"
    )
    assert code == 0 and data["batches"] == 2


def test_scan_threshold_highlights_near_misses_but_never_fails_them(capsys):
    # the clean model's peak is ~1.2: a threshold of 0.5 shows its spans as a margin, but
    # values FP16 holds are no overflow of real FP16 (issue #27): the gate passes
    code, data = run_json(
        capsys, "scan", "models:clean", "--threshold", "0.5", "--fail-on", "overflow"
    )
    assert code == 0 and data["spans"] and data["clean"] and not data["failed"]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["scan", "models:clean", "--input", "1xfoo"], ["bad input shape '1xfoo'"]),
        (["scan", "models:clean", "--input", "missing.npz"], ["missing.npz does not exist"]),
        (["scan", "no_such_module_xyz:f"], ["cannot import"]),
        (
            ["scan", "torch.nn:Linear", "--kwargs", '{"in_features": 2, "out_features": 2}'],
            ["needs example inputs", "--input"],
        ),
        (["scan", "models:clean", "--kwargs", "{bad"], ["--kwargs is not valid JSON"]),
        (["scan", "models:clean", "--input", "1x3x8x8", "--range", "5,1"], ["bad value range"]),
        (["show", "missing.json"], ["cannot read report missing.json"]),
    ],
)
def test_user_errors_are_one_line_exit_2(capsys, argv, needles):
    assert_user_error(*run(capsys, *argv), *needles)


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["scan", "models:clean", "-o", "r.json"],
            ["-o r.json; scan writes its report with --save"],
        ),
        (["verify", "models:clean", "models:clean", "--output=x"], ["as JSON with --json"]),
        (["show", "r.json", "-o", "r.html"], ["with --save PATH", "see fp16lens show --help"]),
        (
            ["scan", "models:clean", "--bogus"],
            ["unrecognized arguments: --bogus (see fp16lens scan"],
        ),
    ],
)
def test_an_option_a_command_does_not_take_is_named_with_that_commands_help(capsys, argv, needles):
    """-o is export's and patch's output: the others say how they write instead."""
    code, out, err = run(capsys, *argv)
    assert_user_error(code, out, err, *needles)
    assert "--bogus" not in argv or "; " not in err  # no output hint for another mistake


def test_show_renders_a_saved_report_to_html_text_and_a_plot(capsys, tmp_path):
    """`fp16lens show r.json --save r.html`: the report rendered again, as scan --save
    would have written it, without scanning again; a suffix it cannot write is one line."""
    saved = tmp_path / "r.json"
    assert main(["scan", "models:functional_mul", "--save", str(saved)]) == 0
    html, text = tmp_path / "again.html", tmp_path / "again.txt"
    code, out, _ = run(capsys, "show", str(saved), "--save", str(html), "--save", str(text))
    assert code == 0 and f"report saved to {html}" in " ".join(out.split())
    assert ":mul" in html.read_text() and "<html" in html.read_text().lower()
    assert ":mul" in text.read_text()
    assert_user_error(
        *run(capsys, "show", str(saved), "--save", str(tmp_path / "r.xyz")), "use .json"
    )


def test_show_rejects_a_json_that_is_not_a_report(capsys, tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    assert_user_error(*run(capsys, "show", str(tmp_path / "other.json")), "not an fp16lens report")


def test_torchscript_model_cannot_be_watched(capsys, tmp_path):
    model, (x,) = models.clean()
    torch.jit.trace(model, (x,)).save(str(tmp_path / "m.pt"))
    code, out, err = run(capsys, "scan", str(tmp_path / "m.pt"), "--input", "1x3x16x16")
    assert_user_error(code, out, err, "eager nn.Module")


def test_scan_exported_program_keeps_qualified_names(capsys, tmp_path):
    model, inputs = models.bn_huge_var()
    torch.export.save(torch.export.export(model, inputs), str(tmp_path / "m.pt2"))
    code, data = run_json(capsys, "scan", str(tmp_path / "m.pt2"), "--input", "1x3x16x16")
    assert code == 0
    assert any(f["site"].startswith("bn") for f in data["findings"])  # not ':batch_norm#1'


def test_a_missing_extra_names_its_install_command(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnx", None)
    code, out, err = run(capsys, "export", "models:clean", "-o", str(tmp_path / "m.onnx"))
    assert_user_error(code, out, err, "pip install -e '.[onnx]'")


def test_help_imports_no_optional_dependency():
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fp16lens", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "usage: fp16lens" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    heavy = {
        "onnx",
        "onnxruntime",
        "onnxscript",
        "matplotlib",
        "torchvision",
        "tensorrt",
        "polygraphy",
        "torch_tensorrt",
    }
    assert not heavy & imported, heavy & imported


def test_scan_saves_html_and_show_prints_text(capsys, tmp_path):
    html = tmp_path / "r.html"
    code, data = run_json(capsys, "scan", "models:functional_mul", "--save", str(html))
    assert code == 0 and data["saved"] == str(html)
    assert ":mul" in html.read_text()
    code, out, _ = run(capsys, "scan", "models:functional_mul", "--fail-on", "overflow")
    assert code == 1 and ":mul" in out and "--fail-on overflow: 1 violation" in out
