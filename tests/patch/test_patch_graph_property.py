"""Property: on random dataflow *graphs* (fan-out, residual adds, concats) of conv /
linear / BN / ReLU / LeakyReLU / max and average pooling, with random weights and one
layer boosted past FP16, the patched model computes the same FP32 function (relative
1e-6), and where the plan leaves nothing unresolved, its real FP16 run (``.half()`` on
CPU) stays finite. ``scripts/property_patch.py --examples 500`` runs the big version."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp16lens
from fp16lens.patch import get_plan, patch, relative_error

from models import RandomGraph, random_graph

NODE = st.tuples(st.sampled_from(RandomGraph.KINDS), st.integers(0, 63))
GRAPHS = dict(
    spec=st.lists(NODE, min_size=2, max_size=9),
    seed=st.integers(0, 2**16),
    boost_at=st.integers(0, 30),
    boost=st.sampled_from([1.0, 3.0e3, 1.0e5]),  # the script adds 3e6 (weights beyond FP16)
    factor=st.sampled_from([None, None, None, 2.0, 64.0, 4096.0]),  # mostly chosen by plan
    extend=st.booleans(),
    extra_out=st.integers(0, 2),
)


def _leaves(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def check_graph(spec, seed, boost_at, boost, factor, extend, extra_out) -> dict:
    """One example; asserts the properties and returns what happened (for the script)."""
    model, inputs = random_graph(spec, seed, (boost_at, boost), extra_out)
    with fp16lens.watch(model) as lens, torch.no_grad():
        want = model(*inputs)
    report = lens.report
    # judged here, not by patch's own check
    patched = patch(model, report, factor=factor, extend=extend, check=False)
    with torch.no_grad():
        got = patched(*inputs)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(*(a.double() for a in inputs))
    for a, b, x in zip(_leaves(want), _leaves(got), _leaves(exact), strict=True):
        if torch.isfinite(a).all():
            err = relative_error(a, b)
            # 1e-6; where the original's own FP32 rounding is larger (a head cancelling
            # values of 1e6 leaves 1e-6 of noise), the patched model is as close to the
            # float64 truth as a few times that rounding: same function, other op order
            ok = err <= 1e-6 or relative_error(x, b) <= 1e-6 + 4 * relative_error(x, a)
            assert ok, f"FP32 output differs by {err:.3g} (relative)"
    the_plan = get_plan(patched)
    if the_plan.unresolved:  # every op here passes a scale: only an output beyond FP16, or
        # the weights of a layer whose output is the model's (no region may scale it), stay
        peak = max(float(a.abs().max()) for a in _leaves(want))
        weights = all(
            "beyond FP16" in u.reason and "reaches the model output" in u.reason
            for u in the_plan.unresolved
        )
        assert not peak <= 65504 or weights, (
            f"unresolved although the outputs fit FP16: {the_plan.unresolved}"
        )
    fp16_checked = False
    if factor is None and report.spans and not the_plan.unresolved:
        fp16_checked = True
        with torch.no_grad():
            half = copy.deepcopy(patched).half()(*(a.half() for a in inputs))
        for i, t in enumerate(_leaves(half)):
            assert torch.isfinite(t).all(), (
                f"FP16 output {i} not finite although the plan resolved every span"
            )
    return {
        "spans": len(report.spans),
        "regions": len(the_plan.regions),
        "islands": len(the_plan.islands),
        "multiplies": len(the_plan.multiplies),
        "unresolved": len(the_plan.unresolved),
        "fp16_checked": fp16_checked,
    }


@settings(
    max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(**GRAPHS)
def test_patch_is_fp32_equivalent_and_fp16_finite_on_random_graphs(
    spec, seed, boost_at, boost, factor, extend, extra_out
):
    check_graph(spec, seed, boost_at, boost, factor, extend, extra_out)


def test_a_known_graph_is_actually_fixed():
    """Guards the property from passing vacuously: a fan-out + concat + residual graph
    with a planted overflow has spans, gets regions, and is finite in FP16 only after patch."""
    spec = [
        ("conv", 0),
        ("relu", 0),
        ("add", 2),
        ("cat", 0),
        ("avgpool", 0),
        ("leaky", 0),
        ("conv", 0),
    ]
    model, inputs = random_graph(spec, 3, (1, 1.0e5))
    with torch.no_grad():
        before = copy.deepcopy(model).half()(inputs[0].half())
    assert not torch.isfinite(before).all()
    out = check_graph(spec, 3, 1, 1.0e5, None, True, 0)
    assert out["spans"] and out["regions"] and not out["unresolved"] and out["fp16_checked"]


def test_operands_from_two_regions_get_their_own_multiplies():
    """Found by this property: an add whose two cut operands come from regions with
    different factors (extend=False) needs one multiply per operand."""
    spec = [("conv", 0), ("avgpool", 0), ("add", 1)]
    out = check_graph(spec, 3, 0, 1.0e5, None, False, 0)
    assert out["multiplies"] >= 2 and not out["unresolved"] and out["fp16_checked"]


def test_weights_beyond_fp16_fit_when_the_input_is_scaled_too():
    """Found by this property: stem2's weight (5e5) sits between two scaled classes, so
    its output factor must cover W s_in / s_out, not W alone (it stayed 5e5: inf in FP16)."""
    out = check_graph([("conv", 0), ("add", 0)], 0, 1, 3.0e6, None, True, 0)
    assert out["regions"] and not out["unresolved"] and out["fp16_checked"]


def test_batch_norm_whose_affine_form_overflows_is_rescaled():
    """Found by the zoo sweep: a BN weight of 1e9 on tiny inputs; its affine form keeps
    the 1e9, so the factor of its output class must bring the BN's scale into FP16."""
    model, inputs = random_graph([("bn", 0), ("relu", 0), ("conv", 0)], 1, (1, 1.0e-4))
    with torch.no_grad():  # stem2 gives values ~1e-4 (FP16 holds them) ...
        bn = model.nodes[0]
        model.stem2.bias.zero_()
        model.nodes[2].weight.mul_(1.0e-3)  # the conv brings the values back
        bn.running_mean.zero_()
        bn.running_var.fill_(1.0)
        bn.weight.fill_(1.0e9)  # ... times a weight FP16 cannot hold (inf in .half())
    with fp16lens.watch(model) as lens, torch.no_grad():
        model(*inputs)
    assert any(f.kind == "param-overflow" and f.site == "nodes.0" for f in lens.report.findings)
    patched = patch(model, lens.report)
    with torch.no_grad():
        half = copy.deepcopy(patched).half()(inputs[0].half())
        assert relative_error(model(*inputs), patched(*inputs)) <= 1e-6
    assert torch.isfinite(half).all()


def test_a_kept_functional_operand_is_not_multiplied():
    """Found by this property: (stem2 + stem) + stem with a multiply on ``stem`` only; the
    kept operand is a functional add, which fx cannot name, so operands are matched by the
    cut producers (it was multiplied too: FP32 output off by 98%)."""
    out = check_graph([("add", 0), ("add", 0)], 0, 1, 1.0e5, None, False, 1)
    assert out["multiplies"] >= 2


@pytest.mark.xfail(
    strict=True,
    reason="known: a conv weight boosted past FP16 whose output "
    "class gets no region stays beyond FP16 after patch (found by the 500 run)",
)
def test_known_gap_weight_beyond_fp16_without_a_region_for_its_output():
    out = check_graph([("conv", 0), ("add", 1)], 0, 2, 3.0e6, None, True, 0)
    assert out["fp16_checked"]
