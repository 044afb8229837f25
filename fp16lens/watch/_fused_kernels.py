"""Fused transformer kernels: the values they store inside, recomputed for watch().

``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` in eval under no_grad
run as one aten op (their "fast path"). Its kernel still stores each step in the
model's dtype (a ``.half()`` model keeps the QK^T scores in FP16, where they become
inf and the softmax NaN), but none of those steps reaches the dispatch mode. Here
they are recomputed, in the op's dtype and in the kernel's order (projection without
bias, then bias and 1/sqrt(d) on q, q k^T, softmax, attention, output projection), so
that the recorder records them as the op's own events: the same values, and so the
same spans, as the unfused module would give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp16lens.watch import _internal

# display names (see _ops.op_name) of the ops decomposed here
FUSED = frozenset({"native_multi_head_attention", "transformer_encoder_layer_fwd"})


@dataclass
class Stored:
    """One value the kernel stores. ``name`` is relative to the module running the op:
    ":softmax" an op of it, "norm1" a submodule, "self_attn:softmax" an op of a
    submodule. ``inputs`` index earlier steps (-1: the op's own inputs). The last step
    has no value: it is the op's output. ``internal``: a finding inside the step."""

    name: str
    op: str
    value: torch.Tensor | None
    inputs: tuple[int, ...]
    internal: tuple | None = None


class _Steps(list):
    def add(self, name: str, op: str, value, *inputs: int, internal=None) -> int:
        self.append(Stored(name, op, value, inputs or (-1,), internal))
        return len(self) - 1


def _masked_softmax(scores: torch.Tensor, mask, mask_type) -> torch.Tensor:
    if mask is None:
        return torch.softmax(scores, dim=-1)
    if mask_type == 1 and mask.dim() == 2:  # key padding (B, S)
        mask = mask.view(mask.shape[0], 1, 1, mask.shape[1])
    if mask.dtype != torch.bool:
        mask = mask != 0
    p = torch.softmax(scores.masked_fill(mask, -math.inf), dim=-1)
    return p.nan_to_num(0.0)  # a fully masked row gives 0, as the kernel does


def _attention(s: _Steps, pre: str, b: dict, src: int) -> tuple[int, torch.Tensor]:
    """Steps of _native_multi_head_attention (its CPU kernel); returns the last index and
    the attention's output (before the output projection)."""
    q_in, k_in, v_in = b["query"], b["key"], b["value"]
    d, h = b["embed_dim"], b["num_head"]
    w, bias = b["qkv_weight"], b["qkv_bias"]
    if q_in is k_in and k_in is v_in:
        qkv = torch.matmul(q_in, w.t())
    else:
        qkv = torch.cat(
            [torch.matmul(t, w[i * d : (i + 1) * d].t()) for i, t in enumerate((q_in, k_in, v_in))],
            dim=-1,
        )
    i = s.add(f"{pre}:in_proj", "mm", qkv, src)
    qkv = qkv + bias
    bsz, t = qkv.shape[0], qkv.shape[1]
    q, k, v = (x.reshape(bsz, -1, h, d // h).transpose(1, 2) for x in qkv.chunk(3, dim=-1))
    q = q / math.sqrt(d // h)
    i = s.add(f"{pre}:qkv", "transform_bias_rescale_qkv", torch.stack([q, k, v]), i)
    scores = torch.matmul(q, k.transpose(-2, -1))
    i = s.add(f"{pre}:attention-scores", "bmm", scores, i)
    p = _masked_softmax(scores, b.get("mask"), b.get("mask_type"))
    i = s.add(f"{pre}:softmax", "softmax", p, i)
    ctx = torch.matmul(p, v)
    j = s.add(f"{pre}:attention", "bmm", ctx, i, i - 2)
    return j, ctx.transpose(1, 2).reshape(bsz, t, d)


def _mha(b: dict) -> _Steps:
    s = _Steps()
    j, _ = _attention(s, "", b, -1)
    s.add("out_proj", "Linear", None, j)
    return s


def _norm(s: _Steps, name: str, x: torch.Tensor, w, bias, eps: float, src: int):
    out = F.layer_norm(x, (x.shape[-1],), w, bias, eps)
    found = _internal.check_layer_norm(x, (x.shape[-1],))
    return s.add(name, "LayerNorm", out, src, internal=found), out


def _encoder_layer(b: dict) -> _Steps | None:
    src = b["src"]
    if src.is_nested:
        return None
    s = _Steps()
    eps, first = b["eps"], b["norm_first"]
    x, i = src, -1
    if first:
        i, x = _norm(s, "norm1", x, b["norm_weight_1"], b["norm_bias_1"], eps, i)
    mha = {
        "query": x,
        "key": x,
        "value": x,
        "embed_dim": b["embed_dim"],
        "num_head": b["num_heads"],
        "qkv_weight": b["qkv_weight"],
        "qkv_bias": b["qkv_bias"],
        "mask": b.get("mask"),
        "mask_type": b.get("mask_type"),
    }
    j, ctx = _attention(s, "self_attn", mha, i)
    a = F.linear(ctx, b["proj_weight"], b["proj_bias"])
    i = s.add("self_attn.out_proj", "Linear", a, j)
    x = a + src
    i = s.add(":add", "add", x, i, -1)
    if not first:
        i, x = _norm(s, "norm1", x, b["norm_weight_1"], b["norm_bias_1"], eps, i)
    res, r = x, i
    if first:
        i, x = _norm(s, "norm2", x, b["norm_weight_2"], b["norm_bias_2"], eps, i)
    x = F.linear(x, b["ffn_weight_1"], b["ffn_bias_1"])
    i = s.add("linear1", "Linear", x, i)
    act = "gelu" if b["use_gelu"] else "relu"
    x = F.gelu(x) if b["use_gelu"] else torch.relu(x)
    i = s.add(f":{act}", act, x, i)
    x = F.linear(x, b["ffn_weight_2"], b["ffn_bias_2"])
    i = s.add("linear2", "Linear", x, i)
    if first:
        s.add(":add", "add", None, i, r)
        return s
    x = x + res
    i = s.add(":add", "add", x, i, r)
    s.add("norm2", "LayerNorm", None, i, internal=_internal.check_layer_norm(x, (x.shape[-1],)))
    return s


_DECOMPOSE = {"native_multi_head_attention": _mha, "transformer_encoder_layer_fwd": _encoder_layer}


def stored(name: str, func, args, kwargs) -> _Steps | None:
    """The values the fused op ``name`` stores inside, in execution order (None: not
    decomposed here, e.g. nested tensors). Computed with no gradient."""
    b = _internal.bind(func, args, kwargs)
    with torch.no_grad():
        return _DECOMPOSE[name](b)
