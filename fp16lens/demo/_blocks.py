"""A small text detector written out in full: ResNet-style backbone + FPN-style neck.

The layout and the module names follow torchvision's resnet18 (``layer4.1.bn2``,
``downsample.0``) and the shared seed-case model, so the names in a report read like the
ones a real PANet/DBNet-style detector gives; only the widths are narrower, so that real
FP16 on a CPU stays fast. Nothing here needs torchvision or a download.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

STAGE_WIDTHS = (16, 32, 64, 128)
NECK_WIDTH = 32


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: conv-bn-relu-conv-bn, residual add, relu (relu reused)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def make_stage(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout))


class Backbone(nn.Module):
    """resnet18's layout (stem, four stages of two BasicBlocks), returning C2..C5."""

    def __init__(self, widths: tuple[int, ...] = STAGE_WIDTHS):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = make_stage(widths[0], widths[0], 1)
        self.layer2 = make_stage(widths[0], widths[1], 2)
        self.layer3 = make_stage(widths[1], widths[2], 2)
        self.layer4 = make_stage(widths[2], widths[3], 2)

    def forward(self, x: torch.Tensor):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        c2 = self.layer1(x)
        c3 = self.layer2(c2)
        c4 = self.layer3(c3)
        return c2, c3, c4, self.layer4(c4)


def conv_bn_relu(cin: int, cout: int, k: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class Neck(nn.Module):
    """FPN-style: 1x1 conv-bn-relu per stage, top-down upsample-and-add, fused 3x3 output."""

    def __init__(self, channels: tuple[int, ...] = STAGE_WIDTHS, width: int = NECK_WIDTH):
        super().__init__()
        self.reduce_c2 = conv_bn_relu(channels[0], width)
        self.reduce_c3 = conv_bn_relu(channels[1], width)
        self.reduce_c4 = conv_bn_relu(channels[2], width)
        self.reduce_c5 = conv_bn_relu(channels[3], width)
        self.smooth = conv_bn_relu(width * 4, width, 3)

    def forward(self, feats):
        c2, c3, c4, c5 = feats
        p5 = self.reduce_c5(c5)
        p4 = self.reduce_c4(c4) + F.interpolate(p5, size=c4.shape[-2:], mode="nearest")
        p3 = self.reduce_c3(c3) + F.interpolate(p4, size=c3.shape[-2:], mode="nearest")
        p2 = self.reduce_c2(c2) + F.interpolate(p3, size=c2.shape[-2:], mode="nearest")
        size = p2.shape[-2:]
        up = [
            F.interpolate(p, size=size, mode="bilinear", align_corners=False) for p in (p3, p4, p5)
        ]
        return self.smooth(torch.cat([p2, *up], dim=1))


class DemoTextDetector(nn.Module):
    """Backbone + neck + a 1x1 text-probability head (sigmoid), PANet/DBNet-shaped."""

    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.neck = Neck()
        self.head = nn.Conv2d(NECK_WIDTH, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.neck(self.backbone(x))))
