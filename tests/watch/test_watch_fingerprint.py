"""The weights fingerprint (patch's stale-report check): exact integer sums of the tensors'
bits, so the same weights give the same numbers in any reduction order, and any changed
value, moved value or flipped sign gives other numbers; reports of the older float64
format are still checked."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from fp16lens import watch
from fp16lens._core.fingerprint import changed, fingerprint
from fp16lens.report import Report

import models

MASK = (1 << 32) - 1


def expected_row(t: torch.Tensor) -> list[float]:
    """The documented row, computed independently: the contiguous tensor's bytes as the
    widest integer words that tile them, exact column sums over rows of 97 in Python
    integers, three weighted sums modulo 2^32."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    word = next(w for w in (np.int32, np.int16, np.int8) if len(raw) % np.dtype(w).itemsize == 0)
    words = np.frombuffer(raw, dtype=word).astype(object)  # Python ints: no overflow
    cols = [int(sum(words[j::97])) & MASK for j in range(97)]
    a = sum(cols) & MASK
    b = sum((2 * j + 1) * c for j, c in enumerate(cols)) & MASK
    c = sum((2 * j + 1) ** 2 * c for j, c in enumerate(cols)) & MASK
    return [float(t.numel()), float(a), -1.0 - b, float(c)]


def old_float64_row(t: torch.Tensor) -> list[float]:
    """What fp16lens wrote before (numpy, float64): [numel, Σv, Σ|v|, Σv·(1 + i mod 97)]."""
    v = t.detach().reshape(-1).double().numpy()
    ramp = np.arange(v.size) % 97 + 1
    return [float(v.size), float(v.sum()), float(np.abs(v).sum()), float((v * ramp).sum())]


def _mixed_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.big = nn.Parameter(torch.randn(3001) * 1e3)  # words far past 2^31: the sums wrap
    m.odd16 = nn.Parameter(torch.randn(7, 5).half())  # 70 bytes: 16-bit words
    m.wide = nn.Parameter(torch.randn(13, 11).double())
    m.bf16 = nn.Parameter(torch.randn(96).bfloat16())
    m.scalar = nn.Parameter(torch.tensor(-0.5))
    m.register_buffer("empty", torch.zeros(0))
    m.register_buffer("steps", torch.tensor(3))  # not floating: not fingerprinted
    m.conv = nn.Conv2d(3, 8, 3)
    return m


def test_rows_are_the_exact_integer_sums_of_the_bits():
    m = _mixed_model()
    got = fingerprint(m)
    tensors = dict(m.named_parameters()) | dict(m.named_buffers())
    assert set(got) == {n for n, t in tensors.items() if t.is_floating_point()}
    for name, row in got.items():
        assert row == expected_row(tensors[name]), name


def test_small_tensors_summed_together_give_each_its_own_row():
    """Small float32 tensors go through one batched pass (their words end to end): each
    still gets exactly its own row, whatever its length against the 97 columns."""
    torch.manual_seed(1)
    m = nn.Module()
    for i, n in enumerate([1, 96, 97, 98, 194, 5000, 16384, 16385]):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(n) * 10.0 ** (i % 5 * 9 - 18)))
    m.register_buffer("strided", torch.randn(40, 30).t())  # not contiguous: the one-by-one path
    got = fingerprint(m)
    tensors = dict(m.named_parameters()) | dict(m.named_buffers())
    assert len(got) == 9
    for name, row in got.items():
        assert row == expected_row(tensors[name]), name


def test_same_weights_same_rows_in_any_layout_and_thread_count():
    m = _mixed_model()
    before = fingerprint(m)
    other = copy.deepcopy(m).to(memory_format=torch.channels_last)  # conv weight non-contiguous
    assert not other.conv.weight.is_contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert fingerprint(other) == before
    finally:
        torch.set_num_threads(threads)
    assert changed(before, other) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_any_single_changed_value_is_seen(dtype):
    torch.manual_seed(1)
    m = nn.Linear(61, 5).to(dtype)  # 305 weights: 3 full rows of 97 and a tail
    recorded = fingerprint(m)
    w = m.weight.data.view(-1)
    for i in [0, 96, 97, 290, 291, w.numel() - 1, *torch.randint(0, w.numel(), (40,)).tolist()]:
        for new in (torch.nextafter(w[i], torch.tensor(np.inf, dtype=dtype)), -w[i]):
            old = w[i].clone()
            w[i] = new
            assert changed(recorded, m) == ["weight"], (i, float(old), float(new))
            w[i] = old
            assert changed(recorded, m) == []


def test_moved_values_are_a_change():
    torch.manual_seed(2)
    m = nn.Linear(768, 64)
    recorded = fingerprint(m)
    for move in (lambda w: w.flip(0), lambda w: w.roll(1, dims=1), lambda w: w.roll(1)):
        before = m.weight.detach().clone()
        with torch.no_grad():
            m.weight.copy_(move(before))
        assert changed(recorded, m) == ["weight"]
        with torch.no_grad():
            m.weight.copy_(before)
    assert changed(recorded, m) == []


def test_rows_survive_json_and_a_last_bit_change_of_their_floats(tmp_path):
    model, inputs = models.bn_huge_var()
    with torch.no_grad(), watch(model) as lens:
        model(*inputs)
    loaded = Report.load(lens.report.save(tmp_path / "r.json"))
    assert loaded.meta.weights == fingerprint(model)
    nudged = {k: [v[0], *(x * (1 + 1e-12) for x in v[1:])] for k, v in loaded.meta.weights.items()}
    assert changed(nudged, model) == []


def test_older_float64_rows_are_still_checked(tmp_path):
    model, inputs = models.bn_huge_var()
    with torch.no_grad(), watch(model) as lens:
        model(*inputs)
    data = lens.report.to_dict()
    data["meta"]["weights"] = {
        n: old_float64_row(t) for n, t in model.state_dict().items() if t.is_floating_point()
    }
    path = tmp_path / "old.json"
    path.write_text(Report.from_dict(data).to_json())
    old = Report.load(path)
    assert changed(old.meta.weights, model) == []
    with torch.no_grad():
        model.conv.weight[0, 0, 0, 0] += 1.0
    assert changed(old.meta.weights, model) == ["conv.weight"]
