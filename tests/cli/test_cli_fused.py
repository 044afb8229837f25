"""scan --fail-on overflow on the fused-attention repro (issue #15): nn.TransformerEncoderLayer
in eval under no_grad runs as one aten op, yet its QK^T scores overflow in real FP16."""

from __future__ import annotations

import copy
import json

import torch

from fp16lens.cli import main

REPRO = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    m = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0).eval()
    return m, (torch.randn(2, 16, 64) * 3000,)
"""


def test_scan_fails_the_gate_at_the_attention_scores(capsys, tmp_path):
    path = tmp_path / "encoder.py"
    path.write_text(REPRO)
    namespace: dict = {}
    exec(compile(REPRO, str(path), "exec"), namespace)
    model, (x,) = namespace["build"]()
    with torch.no_grad():  # ground truth: the fast path in real FP16 gives NaN
        assert torch.isnan(copy.deepcopy(model).half()(x.half())).any()
    code = main(["scan", f"{path}:build", "--fail-on", "overflow", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["failed"]
    assert data["spans"][0]["start"] == "self_attn:attention-scores"
    assert any("self_attn:attention-scores" in line for line in data["failed"])
