"""Plant an FP16 overflow into a copy of a real architecture, the way training can:
scale one layer's affine weight so its output exceeds 65504, then let every later
batch norm see (and normalize) the larger values, as a trained net's statistics would.
For norm-free transformers, scale a Linear that feeds a LayerNorm (scale-invariant)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fp16lens

from models import peak_of

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@torch.no_grad()
def plant_overflow(model: nn.Module, inputs: tuple, target: float = 4 * 65504.0):
    """A copy of ``model`` whose chosen layer outputs about ``target``; None if no place."""
    m = copy.deepcopy(model).eval()
    bns = [mod for mod in m.modules() if isinstance(mod, _BN) and mod.affine]
    if bns:
        bn = bns[int(len(bns) * 0.6)]
        peak = peak_of(m, inputs, bn)
        if peak <= 0:
            return None
        bn.weight.mul_(target / peak)
        bn.bias.mul_(target / peak)
        later = bns[bns.index(bn) + 1 :]
        for b in later:
            b.reset_running_stats()
            b.momentum = None
            b.train()
        m(*inputs)
        for b in later:
            b.momentum = 0.1
        m.eval()
        return m
    names = [n for n, _ in m.named_modules()]
    mods = dict(m.named_modules())
    for name in names[: int(len(names) * 0.8)][::-1]:
        mod = mods[name]
        nxt = [mods[n] for n in names[names.index(name) + 1 : names.index(name) + 4]]
        if isinstance(mod, nn.Linear) and any(isinstance(x, nn.LayerNorm) for x in nxt):
            peak = peak_of(m, inputs, mod)
            if peak <= 0:
                continue
            mod.weight.mul_(target / peak)
            if mod.bias is not None:
                mod.bias.mul_(target / peak)
            return m
    return None


def watch_report(model: nn.Module, inputs: tuple):
    """fp16lens's report of one FP32 forward."""
    with fp16lens.watch(model) as lens, torch.no_grad():
        model(*inputs)
    return lens.report


@torch.no_grad()
def run_half(model: nn.Module, inputs: tuple) -> torch.Tensor:
    """Ground truth: the model in real FP16 on a copy (``.half()``), float inputs halved."""
    args = tuple(a.half() if a.is_floating_point() else a for a in inputs)
    return copy.deepcopy(model).half()(*args).float()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def assert_fixed(model: nn.Module, inputs: tuple, rel: float = 1e-6, min_cosine: float = 0.999):
    """Real FP16 is inf/NaN before; after patch() FP32 is unchanged (``rel`` relative) and
    real FP16 finite with cosine >= ``min_cosine``. Returns the plan and the report."""
    from fp16lens.patch import get_plan, relative_error

    assert not torch.isfinite(run_half(model, inputs)).all()
    report = watch_report(model, inputs)
    patched = fp16lens.patch(model, report)
    with torch.no_grad():
        want, got = model(*inputs), patched(*inputs)
    assert relative_error(want, got) <= rel
    half = run_half(patched, inputs)
    assert torch.isfinite(half).all()
    assert cosine(want, half) >= min_cosine
    return get_plan(patched), report


def onnx_fp16_run(proto, feed: dict, fp32_nodes=()) -> list:
    """``proto`` run with FP16 storage made real (verify's ``onnx-fp16`` rewrite): every
    float constant and every stored float tensor rounded to FP16, except the outputs of
    ``fp32_nodes`` (node names: FP32 islands) and the constants only they read."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from fp16lens.verify._onnx import session
    from fp16lens.verify._onnx_graph import _round_outputs, tensor_types

    keep = set(fp32_nodes)
    island_outputs = {o for n in proto.graph.node if n.name in keep for o in n.output}
    types = {k: 10 for k, v in tensor_types(proto).items() if v == 1 and k not in island_outputs}
    m = onnx.ModelProto()
    m.CopyFrom(proto)

    def half(t):
        with np.errstate(over="ignore"):
            return numpy_helper.from_array(
                numpy_helper.to_array(t).astype(np.float16).astype(np.float32), t.name
            )

    readers: dict[str, set] = {}
    for n in m.graph.node:
        for t in n.input:
            readers.setdefault(t, set()).add(n.name)
    for i, init in enumerate(m.graph.initializer):
        if init.data_type == 1 and not readers.get(init.name, set()) <= keep:
            m.graph.initializer[i].CopyFrom(half(init))
    nodes = []
    for node in m.graph.node:
        for a in node.attribute:
            if a.HasField("t") and a.t.data_type == 1:
                a.t.CopyFrom(half(a.t))
        nodes.append(node)
        nodes.extend(_round_outputs(node, types))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    rounded = {
        k: (v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v)
        for k, v in feed.items()
    }
    return session(m).run(None, rounded)
