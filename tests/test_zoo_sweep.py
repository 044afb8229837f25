"""The zoo's fast subset through scripts/sweep_zoo.py: every row watched bit-identically,
no hook or dispatch mode left behind, the report's JSON round trip exact, a planted
overflow patched (FP32-equivalent and finite in real FP16 on CPU) or an explained "n/a",
and a checker-valid strongly typed FP16 ONNX export."""

from __future__ import annotations

import importlib.util
import os

import pytest

import zoo

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "sweep_zoo.py")


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sweep_zoo", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("onnx")
    return {r["model"]: r for r in _sweep_module().sweep(zoo.FAST)}


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.FAST)
def test_fast_zoo_row(rows, name):
    row = rows[name]
    assert "error" not in row, row.get("trace")
    assert row["sites"] > 0
    assert row["bit_identical"] is True
    assert row["leaked_hooks"] == 0
    assert row["json_round_trip"] is True
    patch = row["patch"]
    assert patch == "yes" or (patch.startswith("n/a (") and len(patch) > len("n/a ()")), patch
    assert row["onnx_fp16_valid"] == "yes", row["onnx_fp16_valid"]


def test_fast_subset_is_what_the_sweep_calls_fast():
    assert set(zoo.FAST) <= set(zoo.ZOO) and len(zoo.FAST) >= 5


def test_real_rows_agree_where_the_verdict_matches_real_fp16():
    """The trained-zoo table's agreement column: a finite real FP16 run agrees with a clean
    verdict only at parity, and with a verdict that is not clean only below it; an input
    FP16 cannot hold agrees when the verdict names the input."""
    from types import SimpleNamespace as NS

    agreement = _sweep_module()._agreement
    clean, broken = NS(clean=True, findings=[]), NS(clean=False, findings=[NS(mechanism="output")])
    named = NS(clean=False, findings=[NS(mechanism="input")])
    assert agreement(clean, 0.9999, None, []) == "yes"
    assert agreement(clean, 0.16, None, []) == "no"  # finite garbage called clean
    assert agreement(broken, 0.16, None, ["conv"]) == "yes"  # finite garbage found
    assert agreement(broken, 0.9999, None, ["conv"]) == "no"  # a false alarm
    assert agreement(named, float("nan"), "lstm", [], beyond=True) == "yes (the input itself)"
    assert agreement(broken, float("nan"), "lstm", [], beyond=True) == "no"
    assert agreement(broken, float("nan"), "conv", ["conv"]) == "yes"
