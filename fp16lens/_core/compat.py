"""Where torch releases differ, in one place (setup.cfg admits every release from the floor on).

Everything that depends on the installed torch release is decided here, so the rest of
fp16lens reads one name instead of testing versions itself.
"""

from __future__ import annotations

import torch

# torch's release as (major, minor): "2.13.0+cpu" -> (2, 13)
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# The stored form of a batch norm re-parametrized into its exact affine form
# (y = weight * x + bias): running_mean 0 and sqrt(running_var + eps) == 1.
# torch 2.10 and 2.11 reject eps = 0 even in eval ("batch_norm eps must be positive"),
# so var and eps are both 0.5: powers of two whose sum is exactly 1 in FP32 and FP16,
# which every release, ONNX BatchNormalization and TensorRT accept.
BN_AFFINE_VAR = 0.5
BN_AFFINE_EPS = 0.5
