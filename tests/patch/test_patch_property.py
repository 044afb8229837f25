"""Property: on random chains of conv/BN/ReLU/pool/residual adds with random weights, one
layer boosted past FP16, and random power-of-two factors, the patched model computes the
same FP32 function (relative 1e-6), and every span it rescales is gone in real FP16."""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp16lens
from fp16lens.patch import get_plan, patch, relative_error

from models import random_chain

BLOCKS = st.sampled_from(["conv", "bn", "relu", "pool", "res"])


def _report(model, inputs):
    with fp16lens.watch(model) as lens, torch.no_grad():
        model(*inputs)
    return lens.report


@settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    spec=st.lists(BLOCKS, min_size=2, max_size=7),
    seed=st.integers(0, 2**16),
    boost_at=st.integers(0, 20),
    boost=st.sampled_from([1.0, 3.0e3, 1.0e5]),
    factor=st.one_of(st.none(), st.sampled_from([2.0, 64.0, 4096.0])),
    extend=st.booleans(),
)
def test_patch_is_fp32_equivalent_on_random_chains(spec, seed, boost_at, boost, factor, extend):
    model, inputs = random_chain(spec, seed, (boost_at, boost))
    report = _report(model, inputs)
    # judged here, not by patch's own check
    patched = patch(model, report, factor=factor, extend=extend, check=False)
    with torch.no_grad():
        want, got = model(*inputs), patched(*inputs)
    if torch.isfinite(want).all():
        assert relative_error(want, got) <= 1e-6
    the_plan = get_plan(patched)
    assert the_plan.fp32_modules == []  # nothing in these chains blocks a scale
    if factor is None and report.spans and not the_plan.unresolved:
        args = tuple(a.half() for a in inputs)
        with torch.no_grad():
            half = copy.deepcopy(patched).half()(*args)
        assert torch.isfinite(half).all()
