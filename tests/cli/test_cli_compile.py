"""`fp16lens scan --compile`: the same verdict, spans and findings as the eager scan.

Inductor itself is tested in tests/watch/test_watch_compiled.py; here the compile step
is replaced by the captured graph as it is (fast), and a spy proves the CLI went
through it.
"""

from __future__ import annotations

import json

from fp16lens.cli import main
from fp16lens.watch import _compiled_scan

import models


def _scan_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["scan", *argv, "--json", "--no-progress"])
    return code, json.loads(capsys.readouterr().out)


def test_scan_compile_matches_eager_scan(capsys, monkeypatch):
    compiled = []

    def as_captured(cap, device, backend="inductor"):
        compiled.append(backend)
        return cap.graph

    monkeypatch.setattr(_compiled_scan, "compile_graph", as_captured)
    argv = (
        "models:gelu_span",
        "--input",
        "2x16",
        "--batches",
        "4",
        "--range",
        "1,3",
        "--fail-on",
        "overflow",
    )
    code, eager = _scan_json(capsys, *argv)
    assert compiled == []
    code_c, data = _scan_json(capsys, *argv, "--compile")
    assert compiled == ["inductor"]  # one graph for the one input shape, compiled once
    assert code == code_c == 1  # the GELU span overflows (tests/models.py: gelu_span)
    assert data["spans"] and data["spans"] == eager["spans"]
    assert data["findings"] == eager["findings"] and data["sites"] == eager["sites"]
    truth = models.first_inf_site_fp16(*models.gelu_span())
    assert truth is not None and data["spans"][0]["start"] == truth[0]


def test_scan_compile_refuses_an_onnx_file(capsys, tmp_path):
    code = main(["scan", str(tmp_path / "m.onnx"), "--compile"])
    err = capsys.readouterr().err
    assert code == 2 and "--compile applies to a torch MODEL" in err and "Traceback" not in err
