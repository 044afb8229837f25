"""Shared small test models, each with its example inputs (one place, never copy-pasted).

Every builder returns ``(model, inputs)`` with the model in eval mode and ``inputs`` a
tuple of positional arguments. Sizes are small: FP16 on a CPU is ~20x slower than FP32.
Ground truth for these models comes from real FP16 runs (``copy.deepcopy(m).half()``)
or from explicit decomposed FP16 computations, never from fp16lens itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp16lens._core.compat import TORCH_VERSION

from torchvision_compat import need_torchvision


def _seeded(seed: int = 0) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------
# The seed article's case: resnet18 backbone + FPN-style neck (a PANet-shaped detector)
# --------------------------------------------------------------------------------------
class ResNetBackbone(nn.Module):
    """torchvision's real resnet18 (BasicBlock), returning the four stage outputs."""

    def __init__(self):
        super().__init__()
        tv = need_torchvision()
        if tv is None:  # e.g. a torch release with no torchvision yet (the torch matrix)
            import pytest

            pytest.skip("needs torchvision (pip install -e '.[vision]')")
        r = tv.models.resnet18(weights=None)
        self.conv1, self.bn1, self.relu, self.maxpool = r.conv1, r.bn1, r.relu, r.maxpool
        self.layer1, self.layer2, self.layer3, self.layer4 = r.layer1, r.layer2, r.layer3, r.layer4

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        c2 = self.layer1(x)
        c3 = self.layer2(c2)
        c4 = self.layer3(c3)
        c5 = self.layer4(c4)
        return c2, c3, c4, c5


def conv_bn_relu(cin: int, cout: int, k: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class FPNNeck(nn.Module):
    """1x1 conv + BN + ReLU reducing each stage, top-down upsample-and-add, fused output."""

    def __init__(self, channels=(64, 128, 256, 512), width: int = 32):
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


class TextDetector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = ResNetBackbone()
        self.neck = FPNNeck()
        self.head = nn.Conv2d(32, 1, 1)

    def forward(self, x):
        return torch.sigmoid(self.head(self.neck(self.backbone(x))))


@torch.no_grad()
def calibrate_bn(model: nn.Module, inputs: tuple, modules: list[nn.BatchNorm2d]) -> None:
    """Give the listed batch norms the running statistics a trained net would have:
    the exact mean/variance of what they see on ``inputs`` (momentum None = cumulative)."""
    for bn in modules:
        bn.reset_running_stats()
        bn.momentum = None
        bn.train()
    model(*inputs)
    for bn in modules:
        bn.momentum = 0.1
        bn.eval()


def seed_case(size: int = 64, overflow_scale: float = 2.0e4):
    """The seed article's PANet situation on torchvision's real resnet18.

    ``backbone.layer4.1.bn2`` has a large affine weight and a small running variance
    (both representable in FP16, as in a trained net), so its output, the block's
    residual add and ReLU exceed 65504; the neck's reducing conv is
    still out of range and its batch norm (statistics measured like a trained net's)
    brings the values back. Expected span: backbone.layer4.1.bn2 -> ... -> neck.reduce_c5.1
    """
    _seeded(0)
    model = TextDetector().eval()
    x = torch.rand(1, 3, size, size)
    with torch.no_grad():
        model.backbone.layer4[1].bn2.weight.mul_(overflow_scale)
        model.backbone.layer4[1].bn2.running_var.mul_(0.01)
    neck_bns = [m for m in model.neck.modules() if isinstance(m, nn.BatchNorm2d)]
    calibrate_bn(model, (x,), neck_bns)
    return model, (x,)


# --------------------------------------------------------------------------------------
# One model per mechanism
# --------------------------------------------------------------------------------------
class MulHardswish(nn.Module):
    """hardswish written as x * relu6(x + 3) / 6: the multiply overflows, nothing else."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(8) * 3.0e4)
            self.fc.bias.zero_()

    def forward(self, x):
        x = self.fc(x)
        x = x * F.relu6(x + 3) / 6
        return self.out(x / 1024)


def functional_mul():
    _seeded(1)
    model = MulHardswish().eval()
    return model, (torch.rand(2, 8) * 0.5 + 0.5,)


class WideLayerNorm(nn.Module):
    """|x - mean| > 256, so (x - mean)^2 > 65504, but the norm's output is in range.
    With ``norm=nn.RMSNorm``: exported (opset < 23) as Pow(x, 2) -> ReduceMean, |x| > 255.9
    squares past 65504 in an FP16 graph."""

    def __init__(self, norm: type[nn.Module] = nn.LayerNorm):
        super().__init__()
        self.proj = nn.Linear(16, 64)
        self.norm = norm(64)
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            self.proj.weight.mul_(800.0)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))


def layernorm_variance():
    _seeded(2)
    return WideLayerNorm().eval(), (torch.randn(2, 5, 16),)


class MeanPool(nn.Module):
    """A 64x64 map of values ~20 averaged: the sum (81,920) overflows, the mean does not."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.conv.weight.fill_(0.01)
            self.conv.bias.fill_(20.0)

    def forward(self, x):
        return self.fc(self.pool(self.conv(x)).flatten(1))


def avgpool_sum():
    _seeded(3)
    return MeanPool().eval(), (torch.rand(1, 3, 64, 64),)


class HugeVarBN(nn.Module):
    """A BatchNorm whose running_var (1e7) is beyond FP16: .half() makes it inf and the
    output silently becomes the BN bias, though no activation is ever out of range."""

    def __init__(self, after_relu: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU() if after_relu else nn.Identity()
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 2, 1)
        with torch.no_grad():
            self.conv.weight.mul_(3000.0)
            self.bn.running_var.fill_(1.0e7)
            self.bn.running_mean.fill_(5.0)

    def forward(self, x):
        return self.head(self.bn(self.act(self.conv(x))))


def bn_huge_var(after_relu: bool = False):
    _seeded(4)
    return HugeVarBN(after_relu).eval(), (torch.rand(1, 3, 16, 16),)


class CleanNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        y = self.features(x)
        return self.fc(self.pool(y + x.mean(1, keepdim=True)).flatten(1))


def clean():
    _seeded(5)
    return CleanNet().eval(), (torch.rand(1, 3, 16, 16),)


class GeluSpan(nn.Module):
    """A span through a GELU: rescaling cannot pass it, so an FP32 island is needed."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 8)
        with torch.no_grad():
            self.fc1.weight.mul_(2.0e4)  # weights stay < 65504, activations do not
            self.fc2.weight.div_(100.0)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def gelu_span():
    _seeded(6)
    return GeluSpan().eval(), (torch.rand(2, 16) * 2 + 1,)


class MultiOutput(nn.Module):
    """Dict output with a nested tuple, a None and an int tensor beside the floats."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(8, 3, 1)
        self.box = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.body(x)
        logits = self.cls(y)
        return {
            "logits": logits,
            "aux": (self.box(y), None),
            "argmax": logits.argmax(1),
        }


def multi_output():
    _seeded(7)
    return MultiOutput().eval(), (torch.rand(1, 3, 8, 8),)


class UpcastRMSNorm(nn.Module):
    """Llama/T5-style RMS norm: the model's own code upcasts, so under .half() x^2 is
    FP32 and cannot overflow, although the FP32 model's x^2 is past 65504."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dtype)


class UpcastNormNet(nn.Module):
    """Residual-stream-like values |x| ~ 1000 (in FP16 range) into an upcasting norm."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = UpcastRMSNorm(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        return self.out(self.norm(self.proj(x) * 1000.0))


class LargeResidualStream(UpcastNormNet):
    """Plus a position term created in forward: an FP32 tensor that promotes the sum to
    FP32 under .half(), where 105,000 is no overflow."""

    def forward(self, x):
        h = super().forward(x)
        pos = torch.arange(h.shape[-1], dtype=torch.float32, device=h.device) * 7000.0
        return h + pos  # FP32 (promoted) under .half(): up to 105,000, no inf


def upcast_norm():
    _seeded(11)
    return LargeResidualStream().eval(), (torch.randn(2, 4, 16),)


WATCH_CASES = {
    "upcast_norm": upcast_norm,
    "seed_case": seed_case,
    "functional_mul": functional_mul,
    "layernorm_variance": layernorm_variance,
    "avgpool_sum": avgpool_sum,
    "bn_huge_var": bn_huge_var,
    "clean": clean,
    "gelu_span": gelu_span,
    "multi_output": multi_output,
}
"""Every model of the watch issue, by name: name -> builder returning (model, inputs)."""


def first_inf_site_fp16(model: nn.Module, inputs: tuple) -> tuple[str, str] | None:
    """Ground truth from real FP16 on CPU: the first module or functional op (in
    execution order) whose half-precision output holds inf/NaN. Uses only forward hooks
    on modules, plus a dispatch mode for functional ops, independent of fp16lens."""
    import copy

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    half = copy.deepcopy(model).half()
    args = tree_map(
        lambda a: a.half() if torch.is_tensor(a) and a.is_floating_point() else a, tuple(inputs)
    )
    first: list[str] = []

    class FirstInf(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not first:
                for t in tree_flatten(out)[0]:
                    if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
                        first.append(str(func.overloadpacket.__name__))
                        break
            return out

    stack: list[str] = []
    names = {m: n for n, m in half.named_modules()}
    handles = []

    def pre(mod, args):
        stack.append(names[mod])

    def post(mod, args, out):
        stack.pop()

    for m in half.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    site: list[tuple[str, str]] = []

    class Attributed(FirstInf):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            had = bool(first)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if first and not had:
                site.append((stack[-1] if stack else "", first[0]))
            return out

    try:
        with torch.no_grad(), Attributed():
            half(*args)
    finally:
        for h in handles:
            h.remove()
    return site[0] if site else None


def rmsnorm_square():
    _seeded(8)
    return WideLayerNorm(nn.RMSNorm).eval(), (torch.randn(2, 5, 16),)


class ReluSpan(nn.Module):
    """The seed article's simplified span w2(relu(w1 x + b1)) + b2 with biases on both
    linears: fc1's output exceeds FP16, fc2 brings it back (the runtime-form baselines)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 8)
        with torch.no_grad():
            self.fc1.weight.mul_(6.0e4)
            self.fc1.bias.mul_(6.0e4)
            self.fc2.weight.div_(30.0)
            self.fc2.bias.mul_(1.0e3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def relu_span():
    _seeded(9)
    return ReluSpan().eval(), (torch.rand(4, 16) * 2 + 1,)


def _trained_like_bn(model: nn.Module) -> None:
    """Batch norms with statistics and affine parameters a trained net could have."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.5, 0.5)


class RandomChain(nn.Module):
    """A chain of conv/BN/ReLU/pool blocks with residual adds, from a spec list (property
    tests): "conv", "bn", "relu", "pool", "res" (a conv-BN branch added back), then a
    linear head. ``boost`` multiplies one block's weight so its values exceed FP16."""

    def __init__(self, spec: list[str], width: int = 4, boost: tuple[int, float] = (0, 1.0)):
        super().__init__()
        self.spec = list(spec)
        self.blocks = nn.ModuleList()
        for kind in spec:
            if kind == "conv":
                self.blocks.append(nn.Conv2d(width, width, 3, padding=1))
            elif kind == "bn":
                self.blocks.append(nn.BatchNorm2d(width))
            elif kind == "relu":
                self.blocks.append(nn.ReLU())
            elif kind == "pool":
                self.blocks.append(nn.MaxPool2d(3, stride=1, padding=1))
            elif kind == "res":
                self.blocks.append(nn.Sequential(nn.Conv2d(width, width, 1), nn.BatchNorm2d(width)))
            else:
                raise ValueError(f"unknown block {kind!r}")
        self.stem = nn.Conv2d(3, width, 1)
        self.head = nn.Linear(width, 2)
        index, gain = boost
        with torch.no_grad():
            _trained_like_bn(self)
            target = [m for m in self.modules() if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))]
            target[index % len(target)].weight.mul_(gain)

    def forward(self, x):
        x = self.stem(x)
        for kind, block in zip(self.spec, self.blocks):
            x = x + block(x) if kind == "res" else block(x)
        return self.head(x.mean((2, 3)))


def random_chain(spec: list[str], seed: int = 0, boost: tuple[int, float] = (0, 1.0)):
    _seeded(seed)
    return RandomChain(spec, boost=boost).eval(), (torch.rand(1, 3, 6, 6),)


class GatedSum(nn.Module):
    """relu(conv_a(x)) exceeds FP16 and is added to a sigmoid gate, a functional op no scale
    passes: the region cannot grow back through the gate, so the gate operand needs one
    scalar multiply at the add (in the model's own forward)."""

    def __init__(self):
        super().__init__()
        self.conv_a = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.conv_b = nn.Conv2d(3, 8, 1)
        self.head = nn.Conv2d(8, 2, 1)
        with torch.no_grad():
            self.conv_a.weight.mul_(1.0e5)
            self.head.weight.div_(10.0)

    def forward(self, x):
        return self.head(self.act(self.conv_a(x)) + torch.sigmoid(self.conv_b(x)))


def gated_sum():
    _seeded(10)
    return GatedSum().eval(), (torch.rand(1, 3, 8, 8),)


class InputLayerNorm(nn.Module):
    """A LayerNorm applied to the model input (|x - mean| > 256): no producer can absorb a
    scale, so its variance can only be kept from FP16 by an FP32 island."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.norm(x))


def layernorm_on_input():
    _seeded(11)
    return InputLayerNorm().eval(), (torch.randn(2, 5, 64) * 800,)


class HardswishBlock(nn.Module):
    """A custom (non-torch.nn) module computing hardswish as x * relu6(x + 3) / 6."""

    def forward(self, x):
        return x * F.relu6(x + 3) / 6


class BlockMulNet(nn.Module):
    """functional_mul's overflow, but inside a module of its own (``act``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = HardswishBlock()
        self.out = nn.Linear(8, 4)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(8) * 3.0e4)
            self.fc.bias.zero_()

    def forward(self, x):
        return self.out(self.act(self.fc(x)) / 1024)


def block_mul():
    _seeded(1)
    return BlockMulNet().eval(), (torch.rand(2, 8) * 0.5 + 0.5,)


class RandomGraph(nn.Module):
    """A random dataflow graph with skip connections (property tests): node i applies
    one block to node i-1; an "add" or "cat" joins node i-1 with an earlier node, so
    tensors fan out to several consumers and join again (ResNet/DenseNet/UNet shapes).
    ``spec`` is a list of (kind, skip): kind in "conv", "linear" (over the last dim),
    "bn", "relu", "leaky", "maxpool", "avgpool", "add" (prev + earlier), "cat" (cat(prev,
    earlier) then a 1x1 conv back to the width); ``skip`` picks the earlier node, modulo
    their count (nodes 0 and 1: two stem convs, the second on the first). The output is a linear head on
    the last node, plus one head per ``extra_out`` earlier node. ``boost`` = (index, gain)
    multiplies one conv/linear/BN weight by gain."""

    KINDS = ("conv", "linear", "bn", "relu", "leaky", "maxpool", "avgpool", "add", "cat")

    def __init__(
        self,
        spec: list[tuple[str, int]],
        width: int = 4,
        size: int = 6,
        boost: tuple[int, float] = (0, 1.0),
        extra_out: int = 0,
    ):
        super().__init__()
        self.spec = [(k, b) for k, b in spec]
        self.extra_out = min(extra_out, len(self.spec))
        self.stem = nn.Conv2d(3, width, 1)
        self.stem2 = nn.Conv2d(width, width, 3, padding=1)
        self.nodes = nn.ModuleList(self._block(k, width, size) for k, _ in self.spec)
        self.head = nn.Linear(width, 2)
        self.heads = nn.ModuleList(nn.Linear(width, 2) for _ in range(self.extra_out))
        with torch.no_grad():
            _trained_like_bn(self)
            target = [
                m for m in self.modules() if isinstance(m, (nn.Conv2d, nn.Linear, nn.BatchNorm2d))
            ]
            index, gain = boost
            target[index % len(target)].weight.mul_(gain)

    @staticmethod
    def _block(kind: str, width: int, size: int) -> nn.Module:
        return {
            "conv": lambda: nn.Conv2d(width, width, 3, padding=1),
            "linear": lambda: nn.Linear(size, size),
            "bn": lambda: nn.BatchNorm2d(width),
            "relu": nn.ReLU,
            "leaky": lambda: nn.LeakyReLU(0.1),
            "maxpool": lambda: nn.MaxPool2d(3, stride=1, padding=1),
            "avgpool": lambda: nn.AvgPool2d(3, stride=1, padding=1),
            "add": nn.Identity,
            "cat": lambda: nn.Conv2d(2 * width, width, 1),
        }[kind]()

    def forward(self, x):
        xs = [self.stem(x)]
        xs.append(self.stem2(xs[0]))  # every node has a consumer: no dead code
        for (kind, skip), block in zip(self.spec, self.nodes):
            u, v = xs[-1], xs[skip % (len(xs) - 1)]
            if kind == "add":
                xs.append(u + v)
            elif kind == "cat":
                xs.append(block(torch.cat([u, v], 1)))
            else:
                xs.append(block(u))
        out = self.head(xs[-1].mean((2, 3)))
        if not self.extra_out:
            return out
        extra = xs[-1 - self.extra_out : -1]
        return (out, *[h(t.mean((2, 3))) for h, t in zip(self.heads, extra)])


def random_graph(
    spec: list[tuple[str, int]],
    seed: int = 0,
    boost: tuple[int, float] = (0, 1.0),
    extra_out: int = 0,
):
    _seeded(seed)
    return RandomGraph(spec, boost=boost, extra_out=extra_out).eval(), (torch.rand(1, 3, 6, 6),)


# --------------------------------------------------------------------------------------
# Fused attention: nn.MultiheadAttention / nn.TransformerEncoderLayer fast paths (one
# aten op in eval under no_grad) and scaled_dot_product_attention as transformers calls it
# --------------------------------------------------------------------------------------
class FusedEncoderLayer(nn.TransformerEncoderLayer):
    """Always the fused encoder-layer op, as optimum's BetterTransformer layers call it
    (nn.TransformerEncoderLayer itself leaves its fast path once hooks are attached)."""

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        a = self.self_attn
        return torch._transformer_encoder_layer_fwd(
            src,
            a.embed_dim,
            a.num_heads,
            a.in_proj_weight,
            a.in_proj_bias,
            a.out_proj.weight,
            a.out_proj.bias,
            self.activation_relu_or_gelu == 2,
            self.norm_first,
            self.norm1.eps,
            self.norm1.weight,
            self.norm1.bias,
            self.norm2.weight,
            self.norm2.bias,
            self.linear1.weight,
            self.linear1.bias,
            self.linear2.weight,
            self.linear2.bias,
        )


class EncoderBlock(nn.Module):
    """One transformer encoder layer (d=64, 4 heads, FFN 128) on (B, L, d) inputs."""

    def __init__(self, layer_cls=nn.TransformerEncoderLayer, **kw):
        super().__init__()
        self.layer = layer_cls(64, 4, 128, batch_first=True, dropout=0.0, **kw)

    def forward(self, x):
        return self.layer(x)


def encoder_fastpath(scale: float = 3000.0, fused_op: bool = False, **kw):
    """The issue's repro: at scale 3000 the QK^T scores pass 65504 (real FP16: NaN)."""
    _seeded(0)
    model = EncoderBlock(FusedEncoderLayer if fused_op else nn.TransformerEncoderLayer, **kw)
    return model.eval(), (torch.randn(2, 16, 64) * scale,)


class SelfAttention(nn.Module):
    """nn.MultiheadAttention alone, need_weights=False (its fast path), optional key padding."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x, key_padding_mask=None):
        return self.attn(x, x, x, need_weights=False, key_padding_mask=key_padding_mask)[0]


def mha_fastpath(scale: float = 3000.0, padded: bool = False):
    _seeded(1)
    x = torch.randn(2, 16, 64) * scale
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, 10:] = True  # the second sequence is 10 tokens long
    return SelfAttention().eval(), (x, pad) if padded else (x,)


class SdpaAttention(nn.Module):
    """Attention as transformers' sdpa path calls it: (B, H, L, E) heads, 2 key/value heads
    for 4 query heads (GQA, enable_gqa), is_causal without a mask, or a 4-D additive mask."""

    def __init__(self, d: int = 64, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, kv_heads * self.hd)
        self.v_proj = nn.Linear(d, kv_heads * self.hd)
        self.o_proj = nn.Linear(d, d)

    def qkv(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.hd).transpose(1, 2)
        return q, k, v

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        if TORCH_VERSION >= (2, 5):
            gqa = {"enable_gqa": True}
        else:  # enable_gqa arrived in torch 2.5: the same attention with repeated k/v heads
            gqa, rep = {}, self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **gqa)
        return self.o_proj(y.transpose(1, 2).reshape(x.shape))


def sdpa_attention(scale: float = 3000.0, masked: bool = False):
    _seeded(2)
    x = torch.randn(2, 16, 64) * scale
    if not masked:
        return SdpaAttention().eval(), (x,)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    mask = torch.zeros(2, 1, 16, 16).masked_fill(~causal, torch.finfo(torch.float32).min)
    return SdpaAttention().eval(), (x, mask)


class AttentionSpan(nn.Module):
    """A post-LN TransformerEncoderLayer whose value projection (inside MultiheadAttention,
    no module of its own) passes 65504: real FP16 gives NaN, FP32 outputs are O(1). The
    layer's fused fast path reads the attention's weights itself."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.inp.weight.mul_(10.0)
            self.layer.self_attn.in_proj_weight[32:].mul_(3.0e4)  # v: |v| ~ 4e5
            self.layer.self_attn.out_proj.weight.div_(3.0e4)

    def forward(self, x):
        return self.head(self.layer(self.inp(x)))


def attention_span():
    _seeded(13)
    return AttentionSpan().eval(), (torch.randn(2, 5, 8),)


class EmbeddingRow(nn.Module):
    """An embedding with one row beyond 65504 (inf as an FP16 weight), then a Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 4)
        with torch.no_grad():
            self.emb.weight[3].mul_(1.0e5)
            self.fc.weight.div_(1.0e3)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def embedding_row():
    _seeded(14)
    return EmbeddingRow().eval(), (torch.tensor([[1, 3, 5, 3], [0, 2, 3, 9]]),)


# Parameters FP16 flushes: harmless where the values they join are large, harmful where not
# --------------------------------------------------------------------------------------
def mobilenet_v2_tiny_params(size: int = 64, seed: int = 0):
    """torchvision's MobileNetV2 (width 0.5) shaped like a trained net: batch-norm statistics
    measured on its inputs, trained-like affine parameters, and what trained ImageNet weights
    hold: whole batch-norm biases of 1e-9..1e-8 (0 in FP16) and pointwise convs whose small
    weights are partly subnormal in FP16. Returns (model, inputs, names of the tiny biases)."""
    tv = need_torchvision()
    _seeded(seed)
    model = tv.models.mobilenet_v2(width_mult=0.5, num_classes=10).eval()
    x = torch.rand(2, 3, size, size)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    names = {m: n for n, m in model.named_modules()}
    pointwise = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1)]
    with torch.no_grad():
        for conv in pointwise[3::6]:
            conv.weight.mul_(2e-3)  # |w| ~ 1e-4: about a quarter below 2^-14
        for bn in bns:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    calibrate_bn(model, (x,), bns)
    tiny = bns[2::7]
    with torch.no_grad():
        for bn in tiny:
            sign = torch.randint(0, 2, bn.bias.shape) * 2 - 1
            bn.bias.copy_(sign * torch.empty(bn.bias.shape).uniform_(1e-9, 1e-8))
    return model, (x,), [f"{names[bn]}.bias" for bn in tiny]


class LayerScaleReadout(nn.Module):
    """A block that adds a layer-scaled branch to a small residual: ``x + γ·proj(feats)``.
    The branch is large (|proj| up to ~2e3, within FP16) and γ = 1e-8, so γ·proj (up to
    ~2e-5) is far above the FP16 step of the residual ``x`` (1e-4..1.1e-3: a step of at most
    5e-7); FP16 flushes γ to 0 and the branch vanishes."""

    def __init__(self, width: int = 16, gamma: float = 1e-8):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.gamma = nn.Parameter(torch.full((width,), gamma))

    def forward(self, x, feats):
        return x + self.gamma * self.proj(feats)


def layer_scale_readout(gamma: float = 1e-8):
    _seeded(11)
    model = LayerScaleReadout(gamma=gamma).eval()
    return model, (torch.rand(4, 16) * 1e-3 + 1e-4, torch.rand(4, 16) * 4e3)


# torch.fx graphs: what symbolic_trace, torch.export and onnx2torch put in node args
# --------------------------------------------------------------------------------------
class ShapeArgsNet(nn.Module):
    """c1's output exceeds FP16; its residual add takes relu(input), which no scale
    reaches (patch multiplies that operand), with shape arithmetic (an fx add on ints),
    a None default, kwargs and constants in the forward. ``head`` brings it back."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Conv2d(6, 2, 1)
        with torch.no_grad():
            self.c1.weight.mul_(2.0e5)
            self.c1.bias.mul_(2.0e5)
            self.head.weight.mul_(0.05)

    def forward(self, x, bias=None):
        n = x.shape[1] + 1  # shape arithmetic: an fx add of ints, never an aten op
        z = torch.add(self.c1(x), F.relu(x), alpha=1)
        z = torch.cat(tensors=[z, F.max_pool2d(z, 3, stride=1, padding=1)], dim=1)
        z = z.reshape(1, 2 * (n - 1), z.shape[-2], z.shape[-1])
        out = self.head(F.interpolate(z, scale_factor=2.0, mode="nearest"))
        if bias is not None:
            out = out + bias
        return torch.sigmoid(out)


def shape_args():
    _seeded(11)
    return ShapeArgsNet().eval(), (torch.rand(1, 3, 8, 8),)


class OnnxTiny(nn.Module):
    """Conv, residual add, resize and a sigmoid head, as ONNX runtimes see them (the
    batch norm folds into the conv at export); c1's output exceeds FP16."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 1, 1)
        with torch.no_grad():
            self.c1.weight.mul_(1.0e6)
            self.head.weight.mul_(0.02)

    def forward(self, x):
        y = F.relu(self.bn1(self.c1(x)))
        z = F.relu(self.c2(y) + y)
        return torch.sigmoid(self.head(F.interpolate(z, scale_factor=2.0, mode="nearest")))


def onnx_tiny():
    _seeded(12)
    return OnnxTiny().eval(), (torch.rand(1, 3, 16, 16),)


class OutlierChannel(nn.Module):
    """fc1's channel 0 is ~1000x its other channels and the head reads all of them: one
    per-tensor INT8 scale for fc1's output either clips channel 0 or rounds the others to
    a few levels, so INT8 parity fails at fc2's input (FP16 holds every value)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)
        with torch.no_grad():
            self.fc1.weight.abs_()
            self.fc1.weight[0].mul_(1000.0)
            self.fc1.bias.zero_()
            self.fc2.weight[:, 0].div_(300.0)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def int8_outlier():
    _seeded(12)
    return OutlierChannel().eval(), (torch.rand(8, 16),)


class FusedNorms(nn.Module):
    """Norm modules that are not torch.nn leaves, so watch records their functional ops:
    timm's BatchNormAct2d (a BatchNorm2d subclass running F.batch_norm, then its own
    activation module) and torchvision's FrozenBatchNorm2d (buffers, x * scale + shift)."""

    def __init__(self):
        super().__init__()
        from torchvision_compat import need_torchvision

        need_torchvision()
        import pytest

        BatchNormAct2d = pytest.importorskip("timm.layers").BatchNormAct2d
        from torchvision.ops.misc import FrozenBatchNorm2d

        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = BatchNormAct2d(8, act_layer=nn.SiLU)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fb = FrozenBatchNorm2d(8)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn3 = BatchNormAct2d(8, act_layer=nn.ReLU)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.c2(self.bn1(self.c1(x)))
        y = self.bn3(self.c3(torch.relu(self.fb(y))))
        return self.fc(self.pool(y).flatten(1))


@torch.no_grad()
def peak_of(model, inputs, module) -> float:
    """Largest |output| of ``module`` over one forward of ``model``."""
    seen = []
    h = module.register_forward_hook(lambda m, a, o: seen.append(float(o.abs().max())))
    try:
        model(*inputs)
    finally:
        h.remove()
    return max(seen) if seen else 0.0


@torch.no_grad()
def fused_norms(plant: str = "frozen"):
    """``plant``: "frozen" scales the FrozenBatchNorm2d's affine part so its output is
    ~4x65504; "stats" makes c3's output ~1e5 and lets bn3 learn statistics beyond FP16."""
    _seeded(13)
    model, inputs = FusedNorms(), (torch.rand(2, 3, 12, 12),)
    for bn in (model.bn1, model.bn3):  # statistics of the net's own activations
        bn.momentum = None
    model.train()(*inputs)
    model.fb.running_mean.copy_(torch.randn(8) * 0.1)
    model.fb.running_var.copy_(torch.rand(8) + 0.5)
    model.fb.weight.copy_(torch.rand(8) + 0.5)
    model.eval()
    if plant == "frozen":
        k = 4 * 65504.0 / peak_of(model, inputs, model.fb)
        model.fb.weight.mul_(k)
        model.fb.bias.mul_(k)
    else:
        model.c3.weight.mul_(2e5 / peak_of(model, inputs, model.c3))
    model.bn3.reset_running_stats()  # bn3 normalizes what it now sees, as training would
    model.train()(*inputs)
    return model.eval(), inputs


class RMSNormHead(nn.Module):
    """fc1 -> an HF RMS norm (T5LayerNorm / LlamaRMSNorm: weight * x * rsqrt(mean(x^2) + eps),
    computed in FP32 even in a half model) -> fc2; fc1's output planted at ~4x65504."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = norm
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


@torch.no_grad()
def rms_norm_head(kind: str = "t5"):
    from torchvision_compat import need_torchvision

    need_torchvision()
    import pytest

    if kind == "t5":
        Norm = pytest.importorskip("transformers.models.t5.modeling_t5").T5LayerNorm
    else:
        Norm = pytest.importorskip("transformers.models.llama.modeling_llama").LlamaRMSNorm
    _seeded(14)
    model, inputs = RMSNormHead(Norm(32, eps=1e-6)).eval(), (torch.rand(4, 16),)
    model.norm.weight.copy_(torch.rand(32) + 0.5)
    k = 4 * 65504.0 / peak_of(model, inputs, model.fc1)
    model.fc1.weight.mul_(k)
    model.fc1.bias.mul_(k)
    return model, inputs


class MaskedSoftmax(nn.Module):
    """An HF-style additive attention mask: finfo(float32).min where masked. The huge
    constant is a mask, not overflow (a .half() model uses finfo(float16).min)."""

    def forward(self, x, mask):
        return torch.softmax(x + (1.0 - mask) * torch.finfo(x.dtype).min, -1)


def masked_softmax():
    _seeded(7)
    x, mask = torch.randn(2, 8), torch.ones(2, 8)
    mask[1, 4:] = 0
    return MaskedSoftmax().eval(), (x, mask)


class Magnitude(nn.Module):
    """conv -> sqrt(a² + b²) -> conv (an STFT magnitude, as in Silero VAD), with ``inner``
    between the two halves: ``"pow"`` (a ** 2), ``"square"``, ``"exp"`` (opaque),
    ``"tensor"`` (a ** t, t from the model: opaque) or ``"cube"`` (|a| ** 3: a pow whose
    exponent the report does not name)."""

    def __init__(self, inner: str = "pow"):
        super().__init__()
        self.inner = inner
        self.stft = nn.Conv1d(1, 16, 8, stride=4, bias=False)
        self.head = nn.Conv1d(8, 4, 3, padding=1)
        self.expo = nn.Conv1d(1, 8, 8, stride=4)

    def forward(self, x):
        y = self.stft(x)
        a, b = y[:, :8], y[:, 8:]
        if self.inner == "exp":
            m = (a.exp() + b.exp()).sqrt()
        elif self.inner == "tensor":
            t = torch.sigmoid(self.expo(x)) + 1.5
            m = (a.abs() ** t + b.abs() ** t).sqrt()
        elif self.inner == "square":
            m = (torch.square(a) + torch.square(b)).sqrt()
        elif self.inner == "cube":
            m = (a.abs() ** 3 + b.abs() ** 3).sqrt()
        else:
            m = (a**2 + b**2).sqrt()
        return self.head(m)


def magnitude(inner: str = "pow", peak: float = 3e3):
    """A Magnitude whose squares reach peak² (3e3 -> ~9e6: beyond FP16 at the squares only),
    its input at peak/|W| scale."""
    torch.manual_seed(0)
    m = Magnitude(inner).eval()
    with torch.no_grad():
        m.stft.weight.mul_(4.0)
    x = torch.randn(2, 1, 256)
    with torch.no_grad():
        scale = peak / float(m.stft(x).abs().max())
    return m, (x * scale,)


# --------------------------------------------------------------------------------------
# Squeeze-excitation: x * gate(pool(x)) (torchvision SqueezeExcitation, MobileNetV3)
# --------------------------------------------------------------------------------------
class SqueezeExciteNet(nn.Module):
    """conv -> bn -> relu -> torchvision SqueezeExcitation -> conv; the bn's output is
    planted beyond FP16 (the span runs through the SE product into the last conv)."""

    def __init__(self, se_layer: nn.Module, width: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.act = nn.ReLU()
        self.se = se_layer
        self.out = nn.Conv2d(width, 4, 1)

    def forward(self, x):
        return self.out(self.se(self.act(self.bn(self.conv(x)))))


class MobileNetV3Shaped(nn.Module):
    """stem conv -> bn -> hardswish, a torchvision MobileNetV3 inverted residual with SE
    (relu, hardsigmoid gate, residual add: the "RE" SE blocks of mobilenet_v3_large), a
    second one with hardswish ("HS"), pool, linear. The first block's depthwise batch norm
    is planted beyond FP16 (the projection's weights divided by as much): the span runs
    through its SE product into the projection."""

    def __init__(self):
        super().__init__()
        need_torchvision()
        from torchvision.models.mobilenetv3 import InvertedResidual, InvertedResidualConfig

        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Hardswish())
        self.re = InvertedResidual(
            InvertedResidualConfig(8, 3, 24, 8, True, "RE", 1, 1, 1.0), nn.BatchNorm2d
        )
        self.hs = InvertedResidual(
            InvertedResidualConfig(8, 3, 24, 8, True, "HS", 1, 1, 1.0), nn.BatchNorm2d
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.hs(self.re(self.stem(x))).mean((2, 3)))


def _plant_bn(
    model: nn.Module,
    inputs: tuple,
    bn: nn.BatchNorm2d,
    back: nn.Module | None = None,
    target: float = 4 * 65504.0,
) -> None:
    """Scale ``bn``'s affine part so its output peaks near ``target``; ``back``, a later
    conv, divides its weight by as much (it brings the values back to their range)."""
    k = target / peak_of(model, inputs, bn)
    bn.weight.mul_(k)
    bn.bias.mul_(k)
    if back is not None:
        back.weight.div_(k)


def _randomize_bns(model: nn.Module) -> None:
    for b in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        b.weight.uniform_(0.5, 1.5)
        b.bias.uniform_(-0.2, 0.2)


@torch.no_grad()
def squeeze_excite(gate: str = "sigmoid"):
    """SqueezeExciteNet with torchvision's SE (sigmoid, or MobileNetV3's hardsigmoid gate)."""
    from torchvision_compat import need_torchvision

    need_torchvision()
    from torchvision.ops.misc import SqueezeExcitation

    _seeded(15)
    scale = nn.Hardsigmoid if gate == "hardsigmoid" else nn.Sigmoid
    model = SqueezeExciteNet(SqueezeExcitation(8, 4, scale_activation=scale)).eval()
    _randomize_bns(model)
    inputs = (torch.rand(2, 3, 8, 8),)
    _plant_bn(model, inputs, model.bn)
    return model, inputs


@torch.no_grad()
def mobilenet_v3_shaped():
    from torchvision_compat import need_torchvision

    need_torchvision()
    _seeded(16)
    model = MobileNetV3Shaped().eval()
    _randomize_bns(model)
    inputs = (torch.rand(2, 3, 8, 8),)
    # the depthwise conv's batch norm; the projection brings the values back
    _plant_bn(model, inputs, model.re.block[1][1], back=model.re.block[3][0])
    return model, inputs


class SharedWeightNet(nn.Module):
    """One Linear called on two paths: its output on ``x`` overflows (x - mean)^2 in the
    LayerNorm after it, its output on ``x / 1024`` stays small. In ONNX the two MatMul
    nodes (and the two bias Adds) read one initializer each: rescaling one path must copy."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.fc.weight.mul_(800.0)

    def forward(self, x):
        return self.head(self.norm(self.fc(x))) + self.fc(x / 1024)[..., :4]


def shared_weight():
    _seeded(17)
    return SharedWeightNet().eval(), (torch.randn(2, 5, 16),)


# --------------------------------------------------------------------------------------
# Activations inside a span (SiLU, GELU, hardswish, sigmoid, tanh) and exits that cannot
# absorb a large factor alone
# --------------------------------------------------------------------------------------
class HugeWeightHead(nn.Module):
    """fc1 with one weight column of 1e6 on an input feature that is always 0 (a parameter
    beyond FP16 whose region needs a factor of 128), relu, and fc2 with weights of about
    600 whose output is the model's: fc2 would store 600 x 128, beyond FP16, and its
    output can carry no scale."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 4)
        with torch.no_grad():
            self.fc1.weight[:, 0] = 1e6
            self.fc2.weight.uniform_(-600.0, 600.0)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def huge_weight_head():
    _seeded(31)
    x = torch.rand(4, 8)
    x[:, 0] = 0.0
    return HugeWeightHead().eval(), (x,)


_ACT_FNS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "hardswish": F.hardswish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
_ACT_MODULES = {
    "silu": nn.SiLU,
    "gelu": nn.GELU,
    "hardswish": nn.Hardswish,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
}


class ActSpan(nn.Module):
    """conv -> bn -> act -> conv (``mlp``: linear -> act -> linear), the activation an
    nn module (``act``) or a function called in this forward (``fn``, functional)."""

    def __init__(self, act: str, functional: bool, mlp: bool = False):
        super().__init__()
        self.first = (
            nn.Linear(16, 32)
            if mlp
            else nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))
        )
        if functional:
            self.fn = _ACT_FNS[act]
        else:
            self.act = _ACT_MODULES[act]()
        self.last = nn.Linear(32, 8) if mlp else nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.first(x)
        return self.last(self.act(y) if hasattr(self, "act") else self.fn(y))


@torch.no_grad()
def act_span(act: str = "silu", functional: bool = False, mlp: bool = False, wrap: bool = False):
    """ActSpan with the first layer's output planted beyond FP16 (the conv's batch norm,
    or the linear's weight) and the last layer's weight divided by as much; ``wrap``: inside
    an nn.Sequential (a functional activation then runs in a submodule's forward)."""
    _seeded(32)
    span = ActSpan(act, functional, mlp).eval()
    model = nn.Sequential(span).eval() if wrap else span
    inputs = (torch.rand(2, 16) * 2 - 1,) if mlp else (torch.rand(2, 3, 8, 8),)
    _randomize_bns(model)
    planted = span.first if mlp else span.first[1]
    k = 4 * 65504.0 / peak_of(model, inputs, planted)
    planted.weight.mul_(k)
    planted.bias.mul_(k)
    span.last.weight.div_(k)
    return model, inputs


# --------------------------------------------------------------------------------------
# Random SE/MBConv stacks (EfficientNet/MobileNetV3-shaped) for the property tests
# --------------------------------------------------------------------------------------
_MB_ACTS = {"relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "hardswish": nn.Hardswish}


def _conv_bn_act(cin: int, cout: int, k: int, act: str | None, groups: int = 1) -> nn.Sequential:
    layers = [
        nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    return nn.Sequential(*layers, *([_MB_ACTS[act]()] if act else []))


class SqueezeExcite(nn.Module):
    """x * gate(fc2(act(fc1(pool(x))))), the gate a sigmoid or a hard sigmoid module, or
    ``torch.sigmoid`` called in this forward (``sigmoid-fn``)."""

    def __init__(self, ch: int, squeeze: int, act: str, gate: str):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.act, self.fc2 = (
            nn.Conv2d(ch, squeeze, 1),
            _MB_ACTS[act](),
            nn.Conv2d(squeeze, ch, 1),
        )
        self.gate = {"hardsigmoid": nn.Hardsigmoid(), "sigmoid": nn.Sigmoid()}.get(
            gate, torch.sigmoid
        )

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


class MBConv(nn.Module):
    """Expand 1x1 conv + BN + act (when the ratio is not 1), depthwise conv + BN + act, an
    optional squeeze-excitation, project 1x1 conv + BN, residual add when shapes match."""

    def __init__(self, cin: int, cout: int, ratio: int, k: int, act: str, se: str | None):
        super().__init__()
        mid = cin * ratio
        self.expand = _conv_bn_act(cin, mid, 1, act) if ratio != 1 else nn.Identity()
        self.dw = _conv_bn_act(mid, mid, k, act, groups=mid)
        self.se = SqueezeExcite(mid, max(2, cin // 2), act, se) if se else nn.Identity()
        self.project = _conv_bn_act(mid, cout, 1, None)
        self.residual = cin == cout

    def forward(self, x):
        y = self.project(self.se(self.dw(self.expand(x))))
        return x + y if self.residual else y


class MBConvStack(nn.Module):
    """Stem conv + BN + act, MBConv blocks, head 1x1 conv + BN + act, pool, linear."""

    def __init__(self, blocks: list[tuple], stem: int, act: str):
        super().__init__()
        self.stem = _conv_bn_act(3, stem, 3, act)
        self.blocks = nn.Sequential(*(MBConv(*b) for b in blocks))
        last = blocks[-1][1] if blocks else stem
        self.head = _conv_bn_act(last, 16, 1, act)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(self.pool(self.head(self.blocks(self.stem(x)))).flatten(1))


@torch.no_grad()
def random_mbconv(seed: int):
    """A random MBConv stack (2-3 blocks, random acts, SE gates, ratios, kernels), its BN
    statistics from one batch, one random BN's affine part planted 2^1..2^6 x 65504 and
    every later BN's statistics taken again (as a trained net's would follow): returns
    (model, inputs, the planted BN's name)."""
    import random

    rng = random.Random(seed)
    _seeded(seed)
    act = rng.choice(list(_MB_ACTS))
    ch, blocks = rng.choice([4, 8]), []
    for _ in range(rng.randint(2, 3)):
        cout = rng.choice([ch, ch, 8])
        se = rng.choice([None, "sigmoid", "hardsigmoid", "sigmoid-fn"])
        blocks.append(
            (ch, cout, rng.choice([1, 2, 4]), rng.choice([3, 5]), rng.choice(list(_MB_ACTS)), se)
        )
        ch = cout
    model = MBConvStack(blocks, blocks[0][0], act).eval()
    inputs = (torch.rand(2, 3, 8, 8),)
    bns = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    calibrate_bn(model, inputs, [m for _, m in bns])
    name, bn = bns[rng.randrange(len(bns) - 1)]  # not the head's: something must normalize
    k = 2.0 ** rng.randint(1, 6) * 65504.0 / peak_of(model, inputs, bn)
    bn.weight.mul_(k)
    bn.bias.mul_(k)
    calibrate_bn(model, inputs, [m for n, m in bns[[b for b, _ in bns].index(name) + 1 :]])
    return model, inputs, name


class FunctionModule(nn.Module):
    """A module that runs one function of its input and holds nothing (HF's
    ``GELUActivation`` is one: its forward calls ``F.gelu``)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# ---- transformers whose residual stream passes 65504 (tests/patch/test_patch_streams.py)
@torch.no_grad()
def plant_linear(
    model: nn.Module, inputs: tuple, name: str, target: float = 4 * 65504.0
) -> nn.Module:
    """Scale the weight and bias of module ``name`` (a residual stream's producer) so that
    its output peaks at ``target``: the stream it adds into passes 65504 from there on."""
    mod = model.get_submodule(name)
    k = target / peak_of(model, inputs, mod)
    mod.weight.mul_(k)
    if getattr(mod, "bias", None) is not None:
        mod.bias.mul_(k)
    return model


@torch.no_grad()
def tv_vit_tiny(plant: str | None = "encoder.layers.encoder_layer_0.mlp.3"):
    """torchvision's VisionTransformer, tiny (pre-LN; class token concatenated, position
    embedding added), its zero-initialized head made random; ``plant``: the producer whose
    output is raised to ~4 x 65504."""
    need_torchvision()
    from torchvision.models import VisionTransformer

    _seeded(21)
    model = VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=8,
    ).eval()
    nn.init.normal_(model.heads.head.weight, std=0.2)
    nn.init.normal_(model.class_token, std=0.5)
    inputs = (torch.rand(2, 3, 32, 32),)
    return (plant_linear(model, inputs, plant) if plant else model), inputs


@torch.no_grad()
def hf_tiny(kind: str, plant: str | None = None):
    """A tiny transformers model (hidden 32, 2 layers, 2 heads, sequence 12) returning its
    last hidden state: "gpt2" (Conv1D projections), "bert" (post-LN), "t5" (T5LayerNorm),
    "llama" (LlamaRMSNorm), "vit" (class token and position embeddings as parameters)."""
    need_torchvision()
    import pytest

    tr = pytest.importorskip("transformers")
    from zoo import HFEncoder

    _seeded(22)
    ids = (torch.randint(0, 100, (2, 12)),)
    if kind == "gpt2":
        m = tr.GPT2Model(
            tr.GPT2Config(
                vocab_size=100,
                n_embd=32,
                n_layer=2,
                n_head=2,
                n_positions=32,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    elif kind == "bert":
        m = tr.BertModel(
            tr.BertConfig(
                vocab_size=100,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=32,
            )
        )
    elif kind == "t5":
        m = tr.T5EncoderModel(
            tr.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)
        )
    elif kind == "llama":
        m = tr.LlamaModel(
            tr.LlamaConfig(
                vocab_size=100,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=32,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
            )
        )
    elif kind == "vit":
        m = tr.ViTModel(
            tr.ViTConfig(
                image_size=32,
                patch_size=8,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
            )
        )
        nn.init.normal_(m.embeddings.cls_token, std=0.5)
        nn.init.normal_(m.embeddings.position_embeddings, std=0.5)
        model, inputs = ViTPixels(m).eval(), (torch.rand(2, 3, 32, 32),)
        return (plant_linear(model, inputs, plant) if plant else model), inputs
    else:
        raise KeyError(kind)
    model = HFEncoder(m).eval()
    return (plant_linear(model, ids, plant) if plant else model), ids


class ViTPixels(nn.Module):
    """A transformers vision model called with pixel values, returning its last hidden state."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).last_hidden_state


@torch.no_grad()
def tv_swin_tiny(plant: str | None = "features.1.0.mlp.3"):
    """torchvision's SwinTransformer, tiny: its attention ends in F.linear on its proj's
    parameters (not a module call) and its patch merging concatenates slices of one tensor."""
    need_torchvision()
    from torchvision.models.swin_transformer import SwinTransformer

    _seeded(23)
    model = SwinTransformer(
        patch_size=[4, 4],
        embed_dim=32,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=[4, 4],
        num_classes=8,
    ).eval()
    inputs = (torch.rand(2, 3, 32, 32),)
    return (plant_linear(model, inputs, plant) if plant else model), inputs


class HandAttention(nn.Module):
    """Self-attention written out: q, k, v and output projections, softmax of scaled scores."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.q, self.k, self.v, self.out = heads, *(nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            f(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, n, d))


class StreamBlock(nn.Module):
    """One transformer block, pre-LN (x + f(LN(x))) or post-LN (LN(x + f(x)))."""

    def __init__(self, d: int, pre_ln: bool, attention: str):
        super().__init__()
        self.pre_ln, self.hand = pre_ln, attention == "hand"
        self.attn = (
            HandAttention(d, 2) if self.hand else nn.MultiheadAttention(d, 2, batch_first=True)
        )
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.up, self.act, self.down = nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)

    def _attend(self, x):
        return self.attn(x) if self.hand else self.attn(x, x, x, need_weights=False)[0]

    def forward(self, x):
        if self.pre_ln:
            x = x + self._attend(self.ln1(x))
            return x + self.down(self.act(self.up(self.ln2(x))))
        x = self.ln1(x + self._attend(x))
        return self.ln2(x + self.down(self.act(self.up(x))))


class StreamNet(nn.Module):
    """Token or patch embedding, a class token, position embeddings, blocks, a final norm
    (pre-LN) and a head: the residual stream of ViT/GPT-style transformers."""

    def __init__(self, d: int, layers: int, pre_ln: bool, attention: str, tokens: bool, seq: int):
        super().__init__()
        self.tokens = tokens
        self.embed = nn.Embedding(50, d) if tokens else nn.Linear(12, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, seq + 1, d) * 0.5)
        self.blocks = nn.ModuleList(StreamBlock(d, pre_ln, attention) for _ in range(layers))
        self.norm = nn.LayerNorm(d) if pre_ln else nn.Identity()
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.embed(x)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


@torch.no_grad()
def stream_net(
    seed: int, layers: int, pre_ln: bool, attention: str, tokens: bool, plant_at: int, peak: float
):
    """A random StreamNet (d 32, sequence 8) whose ``plant_at``-th residual producer (the
    attention outputs and MLP down projections in order) outputs ``peak``."""
    _seeded(seed)
    seq = 8
    model = StreamNet(32, layers, pre_ln, attention, tokens, seq).eval()
    x = torch.randint(0, 50, (2, seq)) if tokens else torch.randn(2, seq, 12)
    producers = [m for b in model.blocks for m in (b.attn, b.down)]
    at = producers[plant_at % len(producers)]  # an attention's output: its out projection's
    seen = []
    hook = at.register_forward_hook(
        lambda m, a, o: seen.append(float((o[0] if isinstance(o, tuple) else o).abs().max()))
    )
    try:
        model(x)
    finally:
        hook.remove()
    lin = at if isinstance(at, nn.Linear) else getattr(at, "out", None) or at.out_proj
    lin.weight.mul_(peak / seen[0])
    lin.bias.mul_(peak / seen[0])
    return model, (x,)


class TiedStream(nn.Module):
    """An embedding whose table is also the output projection's weight (tied, as in
    language models), a stream add, a norm: the table cannot take the stream's scale."""

    def __init__(self, vocab: int = 40, d: int = 32):
        super().__init__()
        self.embed, self.fc, self.norm = nn.Embedding(vocab, d), nn.Linear(d, d), nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(self.norm(h + self.fc(h)))


@torch.no_grad()
def tied_stream():
    _seeded(24)
    model, inputs = TiedStream().eval(), (torch.randint(0, 40, (2, 8)),)
    return plant_linear(model, inputs, "fc"), inputs


@torch.no_grad()
def timm_vit_tiny(plant: str | None = "blocks.0.mlp.fc2"):
    """timm's vit_tiny_patch16_224 at 32 px (12 blocks; cls token and position embedding
    joined in its ``_pos_embed``), its zero-initialized head made random."""
    need_torchvision()
    import pytest

    timm = pytest.importorskip("timm")
    _seeded(5)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=8
    ).eval()
    nn.init.normal_(model.head.weight, std=0.2)
    inputs = (torch.rand(2, 3, 32, 32),)
    return (plant_linear(model, inputs, plant) if plant else model), inputs


@torch.no_grad()
def timm_convnext_atto(plant: str | None = "stages.1.blocks.1.mlp.fc2"):
    """timm's convnext_atto at 64 px: a conv net whose residual stream is scaled by a layer
    scale (``x.mul(self.gamma.reshape(1, -1, 1, 1))``) before each add; ``plant``: the MLP
    output raised to ~4 x 65504 (the stream passes 65504 after its layer scale)."""
    need_torchvision()
    import pytest

    timm = pytest.importorskip("timm")
    _seeded(7)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=8).eval()
    for blk in model.modules():  # trained layer scales are not 1e-6: make them matter
        if isinstance(getattr(blk, "gamma", None), nn.Parameter):
            blk.gamma.copy_(torch.rand_like(blk.gamma) + 0.5)
    inputs = (torch.randn(1, 3, 64, 64),)
    return (plant_linear(model, inputs, plant) if plant else model), inputs


class ScaledProducts(nn.Module):
    """A span through ``x * 0.5`` (a number: homogeneous) and, with ``square``, ``x * x``
    (degree 2: no scale of degree 1 passes)."""

    def __init__(self, square: bool):
        super().__init__()
        self.square = square
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        nn.init.normal_(self.fc2.weight, std=0.01)  # the output stays in range

    def forward(self, x):
        h = self.fc1(x) * 0.5
        return self.fc2(h * h if self.square else h)


# --------------------------------------------------------------------------------------
# Spans whose FP32 islands must reach further (patch/_reach.py)
# --------------------------------------------------------------------------------------
class HardswishStem(nn.Module):
    """A conv stem and hardswish written out as ``x * relu6(x + 3) / 6`` (as onnx2torch
    converts a decomposed HardSwish: separate Mul and Div modules)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = self.conv(x)
        x = x * F.relu6(x + 3)
        return self.head(x / 6)


def hardswish_stem(peak: float = 1.7e4):
    """Raw 0-255 pixels; the stem's peak is ``peak``, so the product peaks near 6 x peak
    (8e4: inf in FP16) and the / 6 brings it back in range."""
    g = _seeded(0)
    m = HardswishStem().eval()
    x = torch.rand(1, 3, 16, 16, generator=g) * 255
    with torch.no_grad():
        m.conv.weight.mul_(peak / m.conv(x).max())
    return m, (x,)


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class ExpLog(nn.Module):
    """conv -> exp -> log -> conv: exp's output passes 65504, log brings it back."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.exp, self.log = Exp(), Log()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.log(self.exp(self.conv(x))))


def exp_log(peak: float = 12.0):
    """exp of ``peak`` (12: 1.6e5, inf in FP16) between two ops no scale passes."""
    g = _seeded(0)
    m = ExpLog().eval()
    x = torch.rand(1, 3, 8, 8, generator=g) * 4
    with torch.no_grad():
        m.conv.weight.mul_(peak / m.conv(x).max())
    return m, (x,)


class StftMagnitude(nn.Module):
    """An STFT as two conv1d (cos and sin windows) and its magnitude sqrt(re^2 + im^2)."""

    def __init__(self, n_fft: int = 64, hop: int = 16):
        super().__init__()
        t, k = torch.arange(n_fft).double(), torch.arange(n_fft // 2 + 1).double()
        win = torch.hann_window(n_fft, dtype=torch.float64)
        angle = 2 * torch.pi * k[:, None] * t[None] / n_fft
        self.real = nn.Conv1d(1, n_fft // 2 + 1, n_fft, stride=hop, bias=False)
        self.imag = nn.Conv1d(1, n_fft // 2 + 1, n_fft, stride=hop, bias=False)
        with torch.no_grad():
            self.real.weight.copy_((win * torch.cos(angle)).float()[:, None])
            self.imag.weight.copy_((-win * torch.sin(angle)).float()[:, None])

    def forward(self, x):
        return torch.sqrt(self.real(x).pow(2) + self.imag(x).pow(2))


class LogSpec(nn.Module):
    def forward(self, x):
        return torch.log(x + 1e-5)


class PitchFrontEnd(nn.Module):
    """STFT magnitude -> log -> a 1x1 conv head, as a pitch estimator's front end."""

    def __init__(self):
        super().__init__()
        self.stft, self.log, self.head = StftMagnitude(), LogSpec(), nn.Conv1d(33, 4, 1)

    def forward(self, x):
        return self.head(self.log(self.stft(x)))


def stft_log(samples: int = 1024):
    """Raw int16-scale samples (peaks of the STFT 1.5e5, of its square 2e10), the second
    half near silence (dither of +-1: magnitudes near 0 reach the log)."""
    g = _seeded(0)
    x = (torch.randn(1, 1, samples, generator=g) * 8000).clamp(-32768, 32767).round()
    x[..., samples // 2 :] = torch.randint(-1, 2, (samples - samples // 2,), generator=g).float()
    return PitchFrontEnd().eval(), (x,)


class EmbeddingHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(16, 8), nn.Linear(8, 4)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def embedding_output(row: float = 1.2e5):
    """An embedding row beyond 65504 and the Linear after it is the model output (beyond
    65504 too): a span that reaches the output."""
    g = _seeded(0)
    m = EmbeddingHead().eval()
    with torch.no_grad():
        m.emb.weight[3] = row
        m.fc.weight.copy_(torch.rand(4, 8, generator=g) * 0.5)
    return m, (torch.tensor([[1, 3, 5, 3]]),)


class LstmEncoder(nn.Module):
    """A speaker-encoder shape: an LSTM over frames, the last step to a Linear."""

    def __init__(self):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 4)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.fc(y[:, -1])


def lstm_raw_input(peak: float = 8e5):
    """Raw features beyond FP16 (8e5) straight into an LSTM."""
    g = _seeded(0)
    x = torch.randn(2, 5, 8, generator=g)
    return LstmEncoder().eval(), (x * (peak / x.abs().max()),)


class ScaledInput(nn.Module):
    """An input read by a multiply before the conv: nothing holds a factor there."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x * 0.5)


def raw_conv_input(peak: float = 3e5, scaled: bool = False):
    """Raw values beyond FP16 into a conv (``scaled``: through ``x * 0.5`` first)."""
    g = _seeded(0)
    m = (
        ScaledInput()
        if scaled
        else nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    )
    with torch.no_grad():
        for c in m.modules():
            if isinstance(c, nn.Conv2d):
                c.weight.mul_(1e-2)
    return m.eval(), (torch.rand(1, 3, 8, 8, generator=g) * peak,)


def silu_pair(peak: float = 1e5):
    """conv (peak 1e5) -> SiLU -> SiLU -> conv: two module islands with a region between."""
    g = _seeded(0)
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.SiLU(), nn.Conv2d(8, 4, 1)
    ).eval()
    x = torch.rand(1, 3, 8, 8, generator=g)
    with torch.no_grad():
        m[0].weight.mul_(peak / m[0](x).max())
    return m, (x,)


class _LogSquare(nn.Module):
    def forward(self, x):
        return torch.log(x * x + 1e-10)  # x² of a quiet signal flushes in FP16: log(0)


class _Offset(nn.Module):
    def forward(self, x):
        return x - 1000.0  # FP16's spacing at 1000 is 0.5: the rounded input moves it


class RoundingSensitive(nn.Module):
    """An underflow (log of a flushed square) beside an output that rounding the input to
    FP16 alone moves: no FP16 run of it meets cosine 0.999, with any part in FP32."""

    def __init__(self):
        super().__init__()
        self.log, self.offset = _LogSquare(), _Offset()

    def forward(self, x):
        return self.log(x[:, :8]), self.offset(x[:, 8:])


def rounding_sensitive():
    quiet = 10.0 ** torch.linspace(-6, 0, 8)
    near = 1000.3 + 0.02 * torch.arange(8.0)  # all round to 1000.5 in FP16
    return RoundingSensitive().eval(), (torch.cat([quiet, near])[None],)
