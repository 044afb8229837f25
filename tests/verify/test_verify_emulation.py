"""torch-emulated against real FP16 on CPU (``copy.deepcopy(model).half()``)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from underflow_models import Fn

from fp16lens._trace import is_builtin_leaf, op_name
from fp16lens.patch._emulate import round_fp16_
from fp16lens.verify._torch import TorchEmulated, TorchFp16

from models import WATCH_CASES, first_inf_site_fp16


def _expected_site(model: nn.Module, found: tuple[str, str] | None) -> str | None:
    """The ground truth (innermost module, aten op) as a site name."""
    if found is None:
        return None
    module, op = found
    owner = dict(model.named_modules())[module]
    if is_builtin_leaf(owner):
        return module
    packet = getattr(torch.ops.aten, op)
    return f"{module}:{op_name(getattr(packet, packet.overloads()[0]))}"


@functools.cache
def _case(name: str):
    """(model, inputs, ground truth) of one shared model, built once per session."""
    model, inputs = WATCH_CASES[name]()
    return model, inputs, first_inf_site_fp16(model, inputs)


@pytest.mark.parametrize("case", sorted(WATCH_CASES))
def test_emulation_finds_first_inf_where_real_fp16_does(case, seed):
    model, inputs, truth = (seed[0], seed[1], seed[3]) if case == "seed_case" else _case(case)
    trace = TorchEmulated(model).first_nonfinite(inputs)
    assert trace.first_nonfinite_op == truth
    assert trace.first_nonfinite == _expected_site(model, truth)


def test_cases_cover_both_verdicts(seed):
    """The agreement above is not vacuous: real FP16 overflows in some cases, not in others."""
    found = {name: _case(name)[2] for name in WATCH_CASES if name != "seed_case"}
    assert seed[3] == ("backbone.layer4.1.bn2", "native_batch_norm")
    assert found["functional_mul"] == ("", "mul")
    assert found["clean"] is None


def test_round_fp16_is_fp16_storage():
    t = torch.tensor([65504.0, 65519.0, 65520.0, -1e5, 1.0 + 2.0**-11, 1e-8, 2.0**-24])
    expected = t.half().float()
    round_fp16_(t)
    assert torch.equal(t, expected)
    assert t[0] == 65504 and t[1] == 65504 and torch.isinf(t[2]) and torch.isinf(t[3])
    assert t[4] == 1.0 and t[5] == 0.0 and t[6] == 2.0**-24


class ConvBN(nn.Module):
    """conv output 1e5 (beyond FP16), the batch norm brings it back to 1e3; every
    parameter is representable in FP16."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(2).eval()
        with torch.no_grad():
            self.conv.weight.fill_(5.0e4)
            self.bn.running_var.fill_(1.0e4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def test_fusions_keep_pre_activation_unrounded():
    model, x = ConvBN().eval(), torch.ones(1, 2, 2, 2)
    real = TorchFp16(model).run((x,))[0]
    plain = TorchEmulated(model).run((x,))[0]
    fused = TorchEmulated(model, fusions=True).run((x,))[0]
    # Real FP16 stores the conv output (1e5 -> inf) and so does plain emulation.
    assert not torch.isfinite(real).all() and not torch.isfinite(plain).all()
    # A fused conv+bn+relu never stores the conv output: computed in FP32, rounded once.
    exact = torch.relu((x * 1.0e5) / (1.0e4 + 1e-5) ** 0.5).half().float()
    torch.testing.assert_close(fused, exact, rtol=1e-3, atol=0)


def test_emulation_matches_real_fp16_values_on_a_clean_model():
    model, inputs, _ = _case("clean")
    real = TorchFp16(model).run(inputs)[0].float()
    emulated = TorchEmulated(model).run(inputs)[0]
    fp32 = model(*inputs)
    # Same storage precision: the emulation is as close to real FP16 as FP16 is to FP32.
    assert (emulated - real).abs().max() <= 2 * (real - fp32).abs().max() + 1e-3


def test_emulation_leaves_the_candidate_untouched():
    model, inputs = WATCH_CASES["bn_huge_var"]()
    before = copy.deepcopy(model.state_dict())
    TorchEmulated(model).run(inputs)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def island_net() -> nn.Module:
    """Values ~1e5 inside an FP32 island (patch's Fp32Island), in range outside it."""
    from fp16lens.patch import Fp32Island

    def linear(scale: float) -> nn.Linear:
        layer = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.eye(4) * scale)
        return layer

    inner = nn.Sequential(linear(1000.0), linear(1.0e-3))
    return nn.Sequential(linear(100.0), Fp32Island(inner), linear(0.5)).eval()


def test_emulation_respects_fp32_islands_like_half_does():
    model, x = island_net(), torch.rand(2, 4) + 1.0
    real = TorchFp16(model).run((x,))[0].float()
    assert torch.isfinite(real).all()  # .half() keeps the island in FP32
    emulated = TorchEmulated(model).run((x,))[0]
    torch.testing.assert_close(emulated, real, rtol=2e-3, atol=0)
    trace = TorchEmulated(model).first_nonfinite((x,))
    assert trace.first_nonfinite is None


class _Scalars(nn.Module):
    """FP16 kernels read the scalar of an add, sub, pow or comparison as FP16 (0.3 is
    0.2998, 1000.3 is 1000.5) and that of a mul or div as FP32; each output here moves
    where the emulation reads the scalar the other way."""

    def forward(self, x):
        s = x * 8.0 + 1000.0  # values on FP16's 0.5 grid near 1000
        keep = (s > 1000.3).float()  # 1000.5 passes only with an FP32 threshold
        shifted = (x + 1000.3) - 1000.0  # 1000.3 adds as 1000.5
        root = x.abs() ** 0.1  # 0.1 as FP16 is 0.09998
        mixed = torch.add(x, x, alpha=0.3) - torch.tensor(0.3)  # alpha and a 0-dim tensor
        rest = torch.remainder(x, 0.3)  # 0.3 as FP16: near-zero remainders move most
        return keep, shifted, root, mixed, rest, x * 1.0004  # mul keeps its FP32 scalar


def test_emulation_reads_scalar_operands_as_fp16_kernels_do():
    """Ground truth: the model's own ``.half()`` on the CPU, bit for bit (the same kernels
    on torch 2.4 to 2.15). Reading every scalar as FP32 got the threshold's mask, the
    shift and the root wrong: a mask of 85 kept values against real FP16's 20 in a model
    that keeps scores above a threshold."""
    torch.manual_seed(0)
    model, x = _Scalars().eval(), torch.randn(4, 256)
    real = [t.float() for t in TorchFp16(model).run((x,))]
    emulated = TorchEmulated(model).run((x,))
    for k, (a, b) in enumerate(zip(real, emulated)):
        assert torch.equal(a, b.float()), k
    fp32 = model(x)
    assert not torch.equal(fp32[0], real[0])  # the threshold's premise: the mask moves


_F = torch.nn.functional
OPS = {  # one op each, scalar parameters included, on values where FP16 rounds them
    "leaky_relu": lambda x: _F.leaky_relu(x, 0.01),
    "elu": lambda x: _F.elu(x, 0.3),
    "softplus": lambda x: _F.softplus(x, beta=2.3, threshold=7.7),
    "hardtanh": lambda x: _F.hardtanh(x, -0.3, 0.3),
    "threshold": lambda x: _F.threshold(x, 0.3, 0.7),
    "gelu": _F.gelu,
    "gelu_tanh": lambda x: _F.gelu(x, approximate="tanh"),
    "silu": _F.silu,
    "mish": _F.mish,
    "hardswish": _F.hardswish,
    "softmax": lambda x: _F.softmax(x, -1),
    "layer_norm": lambda x: _F.layer_norm(x, x.shape[-1:]),
    "addcmul": lambda x: torch.addcmul(x, x, x, value=0.3),
    "addcdiv": lambda x: torch.addcdiv(x, x, x.abs() + 1, value=0.3),
    "lerp": lambda x: torch.lerp(x, x * 2, 0.3),
    "fmod": lambda x: torch.fmod(x, 0.3),
    "remainder": lambda x: torch.remainder(x, 0.3),
    "pow_base": lambda x: torch.pow(1.3, x),
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.1),
    "var": lambda x: x.var(-1),
    "norm": lambda x: x.norm(dim=-1),
    "cumsum": lambda x: x.cumsum(-1),
    "matmul": lambda x: x @ x.transpose(-1, -2),
    "sub_alpha": lambda x: torch.sub(x, x * 0.5, alpha=0.3),
    "where_scalar": lambda x: torch.where(x > 0, x, 0.3),
    "celu": lambda x: _F.celu(x, 0.3),
    "normalize": lambda x: _F.normalize(x, dim=-1),
    "interpolate": lambda x: _F.interpolate(x.unsqueeze(1), scale_factor=2, mode="linear"),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_emulation_is_half_bit_for_bit_op_by_op(name):
    """Each op, scalar parameters included, as the model's own ``.half()`` computes it on
    the CPU (torch 2.4 to 2.15 alike; log_softmax, 1 ulp apart on 8% of its values, is left
    out): what the proof and the verdict check read is what FP16 gives."""
    torch.manual_seed(0)
    model, x = Fn(OPS[name]).eval(), torch.randn(16, 64) * 3
    real = TorchFp16(model).run((x,))[0].float()
    emulated = TorchEmulated(model).run((x,))[0].float()
    assert torch.equal(real.isnan(), emulated.isnan())
    if name == "gelu":  # exact GELU: 1 + erf(x / sqrt 2) cancels in its negative tail
        # On some CPUs (AVX-512 EPYC, torch 2.13) the FP16 kernel's erf there is not the FP32
        # one: for x in [-5.6, -2.4] (|gelu| < 0.016) it lands up to 6 FP16 steps away
        # (measured on a dense grid of x); everywhere else, bit for bit.
        tail = (x.half().float() >= -6) & (x.half().float() <= -2)
        assert torch.equal(real[~tail], emulated[~tail])
        got, want = real[tail], emulated[tail]
        step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2.0**-14))) - 10)
        assert ((got - want).abs() <= 8 * step).all()
        return
    assert torch.equal(real.nan_to_num(), emulated.nan_to_num())
