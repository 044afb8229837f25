"""Deterministic weights for the demo detector, with statistics that look trained.

Weights come from a local generator (the global RNG is left alone). Every batch norm
gets the running statistics a trained net would have: the exact mean and variance of
what it sees on a few synthetic document pages. Then the last block's ``bn2`` gets the
large affine weight a trained net can end up with (weight decay is usually not applied to
batch-norm parameters), so ``backbone.layer4.1.bn2`` and what follows it exceed 65504:
the seed article's PANet situation. The neck's batch norm, calibrated on those large
values, brings them back into range.
"""

from __future__ import annotations

import torch
from torch import nn

from fp16lens.demo._blocks import DemoTextDetector

SEED = 20220508
IMAGE_SIZE = 96
OVERFLOW_SITE = "backbone.layer4.1.bn2"
SPAN_END = "neck.reduce_c5.1"
BIG_GAMMA = 2.0**15
"""Affine weight of the overflowing channels: finite in FP16, the output is not."""
BIG_BETA = 2.0**14
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


def document_pages(n: int = 1, size: int = IMAGE_SIZE, seed: int = SEED) -> torch.Tensor:
    """``n`` synthetic text pages (dark strokes on light paper), ImageNet-normalized."""
    g = torch.Generator().manual_seed(seed)
    pages = 0.9 + 0.08 * torch.rand(n, 1, size, size, generator=g)
    for page in pages:
        for top in range(4, size - 8, 12):
            left = 4
            while left < size - 8:
                width = int(torch.randint(4, 18, (1,), generator=g))
                ink = 0.1 + 0.2 * float(torch.rand(1, generator=g))
                page[:, top : top + 6, left : min(left + width, size - 4)] = ink
                left += width + int(torch.randint(3, 8, (1,), generator=g))
    rgb = pages.expand(n, 3, size, size)
    mean = torch.tensor(_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(_STD).view(1, 3, 1, 1)
    return ((rgb - mean) / std).contiguous()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = SEED) -> None:
    """He-normal convolutions and identity batch norms, from a local generator."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu", generator=g)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.BatchNorm2d):
            m.weight.fill_(1.0)
            m.bias.zero_()


@torch.no_grad()
def calibrate_bn(model: nn.Module, images: torch.Tensor, modules: list[nn.BatchNorm2d]) -> None:
    """Set the listed batch norms' running statistics to exactly what they see on ``images``."""
    saved = [bn.momentum for bn in modules]
    try:
        for bn in modules:
            bn.reset_running_stats()
            bn.momentum = None  # cumulative average: one pass gives the exact statistics
            bn.train()
        model(images)
    finally:
        for bn, momentum in zip(modules, saved):
            bn.momentum = momentum
            bn.eval()


@torch.no_grad()
def grow_gamma(bn: nn.BatchNorm2d, every: int = 4) -> None:
    """Give every ``every``-th channel a large affine weight and bias, as training can."""
    bn.weight[::every] = BIG_GAMMA
    bn.bias[::every] = BIG_BETA


def build_demo_model(size: int = IMAGE_SIZE) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The built-in demo: a text detector whose ``backbone.layer4.1.bn2`` overflows FP16.

    Returns ``(model, (x,))`` with the model in eval mode and ``x`` one 1x3xSxS page.
    FP32 is finite everywhere; in real FP16 the span runs from ``backbone.layer4.1.bn2``
    through the residual add, the relu and ``neck.reduce_c5.0`` to ``neck.reduce_c5.1``.
    """
    model = DemoTextDetector()
    init_weights(model)
    model.eval()
    pages = document_pages(4, size)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    calibrate_bn(model, pages, bns)
    grow_gamma(model.backbone.layer4[1].bn2)
    neck_bns = [m for m in model.neck.modules() if isinstance(m, nn.BatchNorm2d)]
    calibrate_bn(model, pages, neck_bns)
    return model.eval(), (document_pages(1, size, seed=SEED + 1),)
