"""scripts/bench_int8_switch.py: the switch graph (an If per unit input and weight) against
the Where form it replaced, side by side; both compute the same to the bit, and a model it
does not know is one line and exit 2."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
bench = importlib.import_module("bench_int8_switch")


def test_an_unknown_model_is_one_line_and_exit_2(capsys):
    assert bench.main(["--models", "onet,no-such-model"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "no-such-model" in err


def test_the_where_form_is_where_nodes_and_computes_the_same(capsys):
    """MTCNN ONet: the rewritten graph holds no If and one Where per switch, and the script's
    three rows (all off, one on, all on) say both forms agree to the bit."""
    import int8_zoo
    from zoo_real import Missing

    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import find_units, name_nodes
    from fp16lens.export._int8_search import switch_graph

    try:
        case = int8_zoo.MODELS["onet"](2, 2)
    except Missing as exc:
        pytest.skip(str(exc))
    proto = prepared(onnx.load(case.path))
    name_nodes(proto.graph)
    units = find_units(proto.graph, set(), True)
    graph = switch_graph(proto, units, list(dict.fromkeys(t for u in units for t in u.acts)))
    ifs = sum(n.op_type == "If" for n in graph.graph.node)
    where = bench.as_where(graph)
    assert ifs == sum(len(u.acts) + (u.weight is not None) for u in units) > 0
    assert not any(n.op_type == "If" for n in where.graph.node)
    assert sum(n.op_type == "Where" for n in where.graph.node) == ifs

    assert bench.main(["--models", "onet", "--runs", "1"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| MTCNN ONet")]
    assert len(rows) == 3 and all(r.rstrip().endswith("| yes |") for r in rows), rows


def test_the_whole_search_makes_the_same_plan_with_either_switch(capsys):
    """``--search``: MTCNN ONet's default search with the Where form and with the If form
    (ranges, bias corrections, fitted codes, each unit alone) makes the same plan, and the
    search's switch graph is restored afterwards."""
    import int8_zoo
    from zoo_real import Missing

    from fp16lens.export import _int8_search

    try:
        int8_zoo.MODELS["onet"](2, 2)
    except Missing as exc:
        pytest.skip(str(exc))
    before = _int8_search.switch_graph
    assert bench.main(["--models", "onet", "--search"]) == 0
    assert _int8_search.switch_graph is before
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| MTCNN ONet")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| yes |"), rows
