"""How much of a model's conv/linear arithmetic a plan leaves in FP16."""

from __future__ import annotations

import torch

from fp16lens._core.algebra import Kind
from fp16lens._core.sites import site_module


def conv_linear_flops(graph, report, islands: list[str]) -> tuple[float, float]:
    """(FLOPs left in FP16, total FLOPs) of the conv/linear sites over the watched
    forwards: 2 x output elements x multiply-adds per output element (the weight's size
    over its output channels). A site runs in FP32 when it is inside one of ``islands``
    (qualified module names) or inside an island of an earlier patch."""
    fp16 = total = 0.0
    for site, mod in graph.modules.items():
        weight = getattr(mod, "weight", None)
        st = report.sites.get(site)
        if (
            graph.kinds.get(site) != Kind.LINEAR
            or not isinstance(weight, torch.Tensor)
            or st is None
        ):
            continue
        outputs = (
            getattr(mod, "out_channels", None)
            or getattr(mod, "out_features", None)
            or weight.shape[0]
        )
        flops = 2.0 * st.numel * weight.numel() / max(int(outputs), 1)
        total += flops
        owner = site if st.kind == "module" else site_module(site)
        inside = site in graph.frozen or any(
            owner == i or owner.startswith(i + ".") for i in islands
        )
        fp16 += 0.0 if inside else flops
    return fp16, total
