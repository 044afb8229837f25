"""Test-only compatibility step for torchvision's CUDA wheel beside a CPU torch.

PyPI's torchvision 0.28 is a CUDA build. Next to the CPU torch 2.13 its compiled
ops library does not load, and ``import torchvision`` then fails in
``torchvision/_meta_registrations.py`` with "operator torchvision::nms does not
exist", because that module registers fake kernels for ``nms``/``qnms``
unconditionally. The model definitions the tests need (ResNet, MobileNet, ...)
do not use the compiled ops at all.

``ensure_torchvision()`` declares the schemas of those two operators, only when
torchvision's own library could not be loaded, so the import succeeds, and gives
``nms`` a plain-PyTorch CPU kernel (greedy, as torchvision's own) so that detectors
built on it (RetinaNet, FCOS, SSD) run in the tests; every other compiled op
(``roi_align``, ...) still fails loudly. The fp16lens library never does this; only
the test suite and the benchmark scripts do.
"""

from __future__ import annotations

import importlib
import importlib.util

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIB = None  # keeps the torch.library.Library alive for the process


def _native_ops_load() -> bool:
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import glob
    import os

    for path in spec.submodule_search_locations:
        for lib in glob.glob(os.path.join(path, "_C*.so")):
            try:
                torch.ops.load_library(lib)
                return True
            except (OSError, RuntimeError):
                return False
    return False


def ensure_torchvision():
    """Import torchvision, declaring its missing operator schemas first if needed.

    Returns the torchvision module, or None when torchvision is not installed.
    """
    global _LIB
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
    import sys

    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    if _LIB is None and not _native_ops_load():
        _LIB = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS.values():
            _LIB.define(schema)
        _LIB.impl("nms", _nms, "CPU")
    tv = importlib.import_module("torchvision")
    if _LIB is not None:
        tv.extension._has_ops = lambda: True  # nms has a kernel now (see the docstring)
    return tv


def _nms(dets, scores, iou_threshold: float):
    """Greedy non-maximum suppression: indices of kept boxes, by decreasing score."""
    import torch

    order = scores.argsort(descending=True)
    x1, y1, x2, y2 = dets.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    suppressed = torch.zeros(len(dets), dtype=torch.bool)
    keep = []
    for i in order.tolist():
        if suppressed[i]:
            continue
        keep.append(i)
        w = (torch.minimum(x2[i], x2) - torch.maximum(x1[i], x1)).clamp(min=0)
        h = (torch.minimum(y2[i], y2) - torch.maximum(y1[i], y1)).clamp(min=0)
        inter = w * h
        suppressed |= inter / (areas[i] + areas - inter) > iou_threshold
    return torch.tensor(keep, dtype=torch.int64)


def need_torchvision():
    """``ensure_torchvision()`` for a test that cannot run without it: the test is skipped
    where torchvision is not installed (a torch release with none yet, in the torch matrix)."""
    tv = ensure_torchvision()
    if tv is None:
        import pytest

        pytest.skip("needs torchvision (pip install -e '.[vision]')")
    return tv
