"""HF-style masking constants (finfo(float32).min) become -65504 in FP16 ONNX, not -inf."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from fp16lens.export import export


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask):
        bias = (1.0 - mask) * torch.finfo(torch.float32).min
        return torch.softmax(self.fc(x) + bias, -1)


def test_mask_constant_is_clamped_and_output_finite(tmp_path):
    torch.manual_seed(0)
    model = Masked().eval()
    x, mask = torch.randn(2, 8), torch.ones(2, 8)
    mask[1, 4:] = 0
    art = export(model, (x, mask), tmp_path / "m.onnx", precision="fp16")
    assert any("masking constant" in w for w in art.warnings), art.warnings
    sess = ort.InferenceSession(str(art.path), providers=["CPUExecutionProvider"])
    feeds = dict(zip([i.name for i in sess.get_inputs()], [x.numpy(), mask.numpy()]))
    (out,) = sess.run(None, feeds)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, model(x, mask).detach().numpy(), atol=2e-3)
    # unclamped, the constant would be -inf in FP16 and 0 * -inf = NaN where mask == 1
    assert np.isnan(np.float16(0.0) * np.float32(torch.finfo(torch.float32).min).astype(np.float16))
