"""scan and real FP16 agree on every test model (issue #26): a model whose real FP16 run
(``copy.deepcopy(m).half()`` on the CPU, outside fp16lens) turns a finite FP32 output
into inf/NaN is never called FP16-safe by scan. Every zero-argument builder of
tests/models.py that returns (model, tensor inputs) is checked."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch.utils._pytree import tree_flatten

import fp16lens

import models


def _builders() -> list[str]:
    names = []
    for name, fn in inspect.getmembers(models, inspect.isfunction):
        if fn.__module__ != "models" or name.startswith("_"):
            continue
        params = inspect.signature(fn).parameters.values()
        if all(p.default is not p.empty for p in params):
            names.append(name)
    return names


def _floats(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.is_floating_point()]


@pytest.mark.parametrize("name", _builders())
def test_a_model_real_fp16_breaks_is_never_called_safe(name):
    try:
        built = getattr(models, name)()
    except Exception as exc:  # a builder needing an optional package or a GPU
        pytest.skip(f"{name}: {type(exc).__name__}: {str(exc)[:100]}")
    if not (isinstance(built, tuple) and len(built) >= 2 and isinstance(built[0], torch.nn.Module)):
        pytest.skip(f"{name} does not return (model, inputs)")
    model, inputs = built[0], built[1]
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    if not all(torch.is_tensor(a) for a in inputs):
        pytest.skip(f"{name} takes inputs other than tensors")
    with torch.no_grad():
        want = _floats(model(*inputs))
        half = copy.deepcopy(model).half()(
            *(a.half() if a.is_floating_point() else a for a in inputs)
        )
    broken = any(
        bool((torch.isfinite(a) & ~torch.isfinite(b.float())).any())
        for a, b in zip(want, _floats(half))
    )
    report = fp16lens.scan(model, [inputs], progress=False)
    if broken:
        assert not report.clean, f"{name}: real FP16 breaks, scan says FP16-safe"
