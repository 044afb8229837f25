"""The seed case, built once per session with its ground truth from real FP16 (tests
must not modify it)."""

from __future__ import annotations

import copy

import pytest
import torch

from models import first_inf_site_fp16, seed_case


@pytest.fixture(scope="session")
def seed():
    """(model, inputs, real FP16 output, first inf site as (module, aten op))."""
    model, inputs = seed_case()
    with torch.no_grad():
        real = copy.deepcopy(model).half()(*(x.half() for x in inputs))
    return model, inputs, real, first_inf_site_fp16(model, inputs)
