"""Property: on random SE/MBConv stacks (EfficientNet/MobileNetV3-shaped: expand conv + BN
+ act, depthwise conv + BN + act, squeeze-excitation x * gate(fc2(act(fc1(pool(x))))),
project conv + BN, residual adds; acts from ReLU, ReLU6, SiLU, hardswish) with one random
batch norm planted 2^1..2^6 x 65504, real FP16 on CPU (``copy.deepcopy(m).half()``) is
inf/NaN before the patch; after it FP32 is unchanged (1e-6 relative), real FP16 finite with
cosine >= 0.999, and the only FP32 islands are activations: every conv/linear FLOP stays
in FP16."""

from __future__ import annotations

import pytest
from torch import nn

from fp16lens.patch._actisland import ACTIVATIONS

from models import random_mbconv
from plant import assert_fixed

_ACTIVATIONS = (nn.SiLU, nn.Hardswish, nn.ReLU6, nn.Sigmoid, nn.Hardsigmoid)


@pytest.mark.parametrize("seed", [*range(10), 27])  # 27: a torch.sigmoid SE gate on the span
def test_random_mbconv_stacks_are_fixed_with_islands_only_on_activations(seed):
    model, inputs, planted = random_mbconv(seed)
    the_plan, report = assert_fixed(model, inputs)
    assert report.spans and any(planted in span.sites for span in report.spans)
    assert not the_plan.unresolved
    for island in the_plan.islands:  # a module, or a functional activation made a module
        if island.site:
            assert report.sites[island.site].op in ACTIVATIONS, island.site
        else:
            inner = model.get_submodule(island.module)
            assert isinstance(inner, _ACTIVATIONS), (island.module, type(inner).__name__)
    assert the_plan.fp16_flop_share == 1.0
