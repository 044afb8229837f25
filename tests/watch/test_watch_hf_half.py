"""Real text architectures (transformers, tiny random configs) whose code upcasts inside
their norms: with large residual-stream values, x^2 passes 65504 in the FP32 model, but
a .half() model computes it in FP32 and stays finite. watch must agree with real FP16."""

from __future__ import annotations

import pytest
import torch

from fp16lens import watch

import models
from torchvision_compat import ensure_torchvision

ensure_torchvision()  # transformers imports torchvision when it is installed
transformers = pytest.importorskip("transformers")


def _llama():
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
    )
    return transformers.LlamaModel(cfg)


def _t5():
    cfg = transformers.T5Config(
        d_model=64, num_layers=2, num_heads=4, d_ff=128, d_kv=16, vocab_size=100
    )
    return transformers.T5EncoderModel(cfg)


@pytest.mark.parametrize(("build", "scale"), [(_llama, 2e4), (_t5, 2e3)], ids=["llama", "t5"])
def test_upcasting_norms_are_not_fp16_overflow(build, scale):
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)  # |residual| in the hundreds+: x^2 > 65504
    ids = (torch.tensor([[1, 2, 3, 4, 5, 6]]),)
    truth = models.first_inf_site_fp16(model, ids)
    # real FP16 stays finite; T5's relative-position buckets take log(0) = -inf in FP32 too
    # (a masking value, reported as a note), which the plain first-inf search also stops at
    assert truth is None or truth[1] == "log"
    with torch.no_grad(), watch(model) as lens:
        model(*ids)
    report = lens.report
    assert lens._recorder.half_fp32, "the FP16 meta run did not go through"
    assert report.spans == []
    notes = [f for f in report.findings if f.kind == "fp32-upcast"]
    assert notes and notes[0].site.endswith(":pow")
    with torch.no_grad(), watch(model, half_dtypes=False) as naive:
        model(*ids)
    assert naive.report.spans  # counted as FP16, the upcast x^2 would be overflow
