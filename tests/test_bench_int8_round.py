"""scripts/bench_int8_round.py: the weight-rounding fit against the form it replaced (three
``fit`` calls, GPTQ's column loop in torch), side by side; both give the same codes and the
same plan, the form before is restored afterwards, and a model it does not know is one line
and exit 2."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")
bench = importlib.import_module("bench_int8_round")


def test_an_unknown_model_is_one_line_and_exit_2(capsys):
    assert bench.main(["--models", "pnet,no-such-model"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "no-such-model" in err


def test_the_loop_before_rounds_as_the_loop_now():
    """The torch column loop the script keeps and the NumPy one of the code: the same codes
    on correlated inputs, rows wider and narrower than a block, one group and many."""
    from fp16lens.export._int8_round import gptq

    rng = np.random.default_rng(0)
    for groups, rows, k in ((1, 40, 300), (1, 200, 27), (16, 1, 9)):
        x = rng.standard_normal((groups, k, 3 * k)) + rng.standard_normal((groups, 1, 3 * k))
        w = rng.standard_normal((groups, rows, k)) * 0.1
        scale = np.abs(w).max(-1) / 127
        h = x @ x.transpose(0, 2, 1)
        now, then = gptq(w, scale, h), bench.torch_loop_gptq(w, scale, h)
        nearest = np.clip(np.rint(w / scale[..., None]), -127, 127)
        assert np.array_equal(now, then) and np.count_nonzero(now != nearest) > 0


@pytest.mark.parametrize("search", [False, True])
def test_both_forms_give_the_same_codes_and_plan(capsys, search):
    """MTCNN PNet: the fit's three sets of codes, and with ``--search`` the whole default
    search's plan, are the same in either form; the module's own fit is back afterwards."""
    import int8_zoo
    from zoo_real import Missing

    from fp16lens.export import _int8_round

    try:
        int8_zoo.MODELS["pnet"](2, 2)
    except Missing as exc:
        pytest.skip(str(exc))
    kept = _int8_round.gptq, _int8_round.folds
    assert bench.main(["--models", "pnet", *(["--search"] if search else [])]) == 0
    assert (_int8_round.gptq, _int8_round.folds) == kept
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| MTCNN PNet")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| yes |"), rows
