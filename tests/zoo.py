"""A zoo of real architectures with small random-weight configurations, for the sweep
(scripts/sweep_zoo.py) and its fast subset in the tests. Each entry builds
``(model, inputs)`` in eval mode; torchvision/timm/transformers are imported lazily
through the test-only torchvision compatibility step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchvision_compat import ensure_torchvision

Builder = Callable[[], tuple[nn.Module, tuple]]


def _img(size: int = 64, batch: int = 2) -> tuple:
    return (torch.rand(batch, 3, size, size),)


def _tv(name: str, size: int = 64, **kw) -> Builder:
    def build():
        tv = ensure_torchvision()
        return getattr(tv.models, name)(weights=None, **kw).eval(), _img(size)

    return build


def _tv_seg(name: str) -> Builder:
    def build():
        tv = ensure_torchvision()
        fn = getattr(tv.models.segmentation, name)
        return fn(weights=None, weights_backbone=None, num_classes=3, aux_loss=False).eval(), _img(
            64
        )

    return build


def _tv_vit() -> tuple[nn.Module, tuple]:
    tv = ensure_torchvision()
    from torchvision.models.vision_transformer import VisionTransformer

    del tv
    m = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128
    )
    return m.eval(), _img(32)


def _tv_swin() -> tuple[nn.Module, tuple]:
    ensure_torchvision()
    from torchvision.models.swin_transformer import SwinTransformer

    m = SwinTransformer(
        patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4]
    )
    return m.eval(), _img(32)


def _tv_fpn_backbone() -> tuple[nn.Module, tuple]:
    ensure_torchvision()
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    return resnet_fpn_backbone(
        backbone_name="resnet18", weights=None, trainable_layers=5
    ).eval(), _img(64)


def _timm(name: str, size: int = 64, **kw) -> Builder:
    def build():
        ensure_torchvision()
        import timm

        return timm.create_model(name, pretrained=False, **kw).eval(), _img(size)

    return build


class HFEncoder(nn.Module):
    """Calls a transformers model with keywords and returns its last hidden state."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _hf(kind: str) -> Builder:
    def build():
        ensure_torchvision()
        import transformers as tr

        ids = torch.randint(0, 500, (2, 12))
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 8:] = 0
        small = {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
        }
        if kind == "bert":
            m = tr.BertModel(tr.BertConfig(vocab_size=500, **small))
            return HFEncoder(m).eval(), (ids, mask)
        if kind == "gpt2":
            cfg = tr.GPT2Config(
                vocab_size=500,
                n_embd=64,
                n_layer=2,
                n_head=4,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=0,
            )
            return HFEncoder(tr.GPT2Model(cfg)).eval(), (ids, mask)
        if kind == "t5":
            cfg = tr.T5Config(
                vocab_size=500, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4
            )
            return HFEncoder(tr.T5EncoderModel(cfg)).eval(), (ids, mask)
        if kind == "vit":
            m = tr.ViTModel(tr.ViTConfig(image_size=32, patch_size=8, **small))

            class HFViT(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.model = m

                def forward(self, pixel_values):
                    return self.model(pixel_values=pixel_values).last_hidden_state

            return HFViT().eval(), (torch.rand(2, 3, 32, 32),)
        raise KeyError(kind)

    return build


ZOO: dict[str, Builder] = {
    "tv.resnet18": _tv("resnet18"),
    "tv.resnet50": _tv("resnet50"),
    "tv.mobilenet_v2": _tv("mobilenet_v2"),
    "tv.mobilenet_v3_small": _tv("mobilenet_v3_small"),
    "tv.efficientnet_b0": _tv("efficientnet_b0"),
    "tv.convnext_tiny": _tv("convnext_tiny", 32),
    "tv.vit": _tv_vit,
    "tv.swin": _tv_swin,
    "tv.deeplabv3_mobilenet_v3_large": _tv_seg("deeplabv3_mobilenet_v3_large"),
    "tv.fcn_resnet50": _tv_seg("fcn_resnet50"),
    "tv.lraspp_mobilenet_v3_large": _tv_seg("lraspp_mobilenet_v3_large"),
    "tv.resnet18_fpn_backbone": _tv_fpn_backbone,
    "timm.resnet18": _timm("resnet18"),
    "timm.efficientnet_b0": _timm("efficientnet_b0"),
    "timm.vit_tiny": _timm("vit_tiny_patch16_224", 32, img_size=32),
    "timm.convnext_atto": _timm("convnext_atto", 32),
    "timm.mobilevitv2_050": _timm("mobilevitv2_050", 64),
    "hf.bert": _hf("bert"),
    "hf.gpt2": _hf("gpt2"),
    "hf.t5": _hf("t5"),
    "hf.vit": _hf("vit"),
}

FAST = ["tv.resnet18", "tv.mobilenet_v3_small", "tv.vit", "hf.bert", "hf.gpt2"]
"""The subset the test suite sweeps on every run."""
