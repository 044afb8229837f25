"""The models of the Fixing table: the watch issue's small test models (tests/models.py)
and, in full mode, a ResNet-50, a BERT-base (post-LN) and a ViT-Tiny-sized pre-LN
transformer (random weights) with an overflow planted by tests/plant.py the way training
can produce one (in the ViT, on the residual stream: an MLP down projection feeding it).
ONNX in: PP-OCRv4's published detector (rapidocr-onnxruntime's .onnx file, no PyTorch
source) fed raw 0-255 pixels, the mistake users make."""

from __future__ import annotations

import torch

import models
from plant import plant_overflow


def build(name: str) -> tuple[torch.nn.Module, tuple]:
    """``(model, inputs)`` for a Fixing-table model name."""
    if name in models.WATCH_CASES:
        return models.WATCH_CASES[name]()
    builders = {
        "resnet50 (planted)": _resnet50,
        "bert-base (planted)": _bert_base,
        "vit (residual stream)": _vit,
    }
    if name not in builders:
        raise KeyError(f"unknown model {name!r}; use one of {[*models.WATCH_CASES, *builders]}")
    model, inputs = builders[name]()
    planted = plant_overflow(model, inputs)
    if planted is None:
        raise RuntimeError(f"plant_overflow found no place to plant an overflow in {name}")
    return planted, inputs


def _resnet50():
    import zoo

    torch.manual_seed(0)
    return zoo.ZOO["tv.resnet50"]()


def _bert_base():
    from torchvision_compat import ensure_torchvision
    from zoo import HFEncoder

    ensure_torchvision()
    import transformers as tr

    torch.manual_seed(0)
    model = tr.BertModel(tr.BertConfig(), add_pooling_layer=False)  # 12 x 768, 110M params
    ids = torch.randint(0, 30522, (1, 16))
    return HFEncoder(model).eval(), (ids, torch.ones(1, 16, dtype=torch.long))


def _vit():
    from torchvision_compat import ensure_torchvision

    ensure_torchvision()
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)  # ViT-Tiny widths (192, 3 heads), 4 pre-LN blocks, 64x64 images
    model = VisionTransformer(
        image_size=64, patch_size=16, num_layers=4, num_heads=3, hidden_dim=192, mlp_dim=768
    )
    torch.nn.init.normal_(model.heads.head.weight, std=0.02)  # torchvision starts it at zero
    return model.eval(), (torch.randn(1, 3, 64, 64),)


ONNX_CASES = {"pp-ocrv4 det (onnx in; raw pixels)": False}
"""Fixing-table models that are ONNX files: name -> normalized input."""


def onnx_file(name: str) -> tuple[str, tuple]:
    """``(path, (x,))`` for an ONNX-in Fixing-table model (x a numpy batch)."""
    import zoo_real

    path, x = zoo_real.ppocr_det(ONNX_CASES[name])
    return path, (x,)
