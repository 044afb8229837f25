"""Small models whose FP16 run breaks by underflow (a zero FP16 makes reaches a log, a
denominator, an rsqrt or a negative power), and clean controls where small values flush
harmlessly. Each is a front linear layer (no bias, so quiet inputs stay quiet) and a
``block`` submodule holding the normalization, as real models hold theirs.

    CASES[name] -> (build() -> model, input) ; FAILING: the names whose real FP16 breaks
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 16


class Net(nn.Module):
    def __init__(self, block: nn.Module, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.front = nn.Linear(WIDTH, WIDTH, bias=False)
        with torch.no_grad():
            self.front.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5)
        self.block = block

    def forward(self, x):
        return self.block(self.front(x))


class Fn(nn.Module):
    """A block computing ``fn(x)`` in its own forward (functional ops, as models write them)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def quiet_rows(quiet: float, loud: float = 1.0, seed: int = 1) -> torch.Tensor:
    """(6, WIDTH): three rows at scale ``quiet`` (near silence), three at ``loud``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, WIDTH, generator=g)
    return torch.cat([x[:3] * quiet, x[3:] * loud])


def _softmax_by_hand(x):
    e = torch.exp(x)
    return e / e.sum(-1, keepdim=True)


BLOCKS = {  # name -> (block fn, quiet scale, loud scale)
    "log-square-eps": (lambda x: torch.log(x * x + 1e-10), 1e-5, 1.0),
    "log2-square-eps": (lambda x: torch.log2(x.pow(2) + 1e-10), 1e-5, 1.0),
    "log10-clamp": (lambda x: torch.log10(torch.clamp(x * x, min=1e-8)), 1e-5, 1.0),
    "softmax-by-hand": (_softmax_by_hand, 1.0, 1.0),  # input shifted below: whole rows flush
    "rsqrt-rms": (lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-12), 1e-6, 1.0),
    "sqrt-denominator": (lambda x: x / torch.sqrt((x * x).mean(-1, keepdim=True)), 1e-6, 1.0),
    "reciprocal": (lambda x: torch.reciprocal(x * x + 1e-10) * 1e-6, 1e-5, 1.0),
    "pow-negative": (lambda x: torch.pow(x * x + 1e-9, -0.5) * 1e-3, 1e-5, 1.0),
    "normalize": (lambda x: F.normalize(x * x, dim=-1), 1e-5, 1.0),
    "cosine-similarity": (
        lambda x: F.cosine_similarity(x * x, x.flip(-1) ** 2 + 1.0, dim=-1),
        1e-5,
        1.0,
    ),
    "log-of-softmax": (
        lambda x: torch.log(torch.softmax(x * 4, -1)),
        1.0,
        1.0,
    ),  # tiny probabilities
    "log-of-sigmoid": (lambda x: torch.log(torch.sigmoid(x * 5 - 20)), 1e-5, 1.0),
    "log-in-place": (
        lambda x: (x * x).add_(1e-10).log_(),
        1e-5,
        1.0,
    ),  # log_ overwrites its operand
    "clip-in-place-div": (lambda x: x / (x * x).mean(-1, keepdim=True).clip_(min=1e-8), 1e-5, 1.0),
    # clean controls: the small values flush, harmlessly
    "log-eps-1e-3": (lambda x: torch.log(x * x + 1e-3), 1e-5, 1.0),
    "softmax-by-hand-in-range": (_softmax_by_hand, 1.0, 1.0),
    "relu-flush-linear": (lambda x: F.relu(x) * 2.0, 1e-8, 1.0),
    # a .half() model computes this block in FP32 (its own upcast): nothing flushes
    "log-upcast-float": (lambda x: torch.log(x.float() ** 2 + 1e-10), 1e-5, 1.0),
}
FAILING = (
    "log-square-eps",
    "log2-square-eps",
    "log10-clamp",
    "softmax-by-hand",
    "rsqrt-rms",
    "sqrt-denominator",
    "reciprocal",
    "pow-negative",
    "normalize",
    "log-in-place",
    "clip-in-place-div",
    "cosine-similarity",
    "log-of-softmax",
    "log-of-sigmoid",
)
CLEAN = ("log-eps-1e-3", "softmax-by-hand-in-range", "relu-flush-linear", "log-upcast-float")


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    fn, quiet, loud = BLOCKS[name]
    model = Net(Fn(fn)).eval()
    x = quiet_rows(quiet, loud)
    if name == "softmax-by-hand":
        # exp of the front's output: rows 0-2 far below ln(2^-25) ≈ -17 flush whole
        x = (
            x
            + torch.linalg.pinv(model.front.weight.detach())
            @ torch.full((WIDTH,), -30.0)
            * (torch.arange(6) < 3).float()[:, None]
        )
    return model, x
