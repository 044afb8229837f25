"""Test-only compatibility step for torchvision's CUDA wheel beside a CPU torch.

PyPI's torchvision 0.28 is a CUDA build. Next to the CPU torch 2.13 its compiled
ops library does not load, and ``import torchvision`` then fails in
``torchvision/_meta_registrations.py`` with "operator torchvision::nms does not
exist", because that module registers fake kernels for ``nms``/``qnms``
unconditionally. The model definitions the tests need (ResNet, MobileNet, ...)
do not use the compiled ops at all.

``ensure_torchvision()`` declares the schemas of those two operators (no kernels),
only when torchvision's own library could not be loaded, so the import succeeds.
Calling ``torchvision.ops.nms`` afterwards still fails loudly. The fp16lens
library never does this; only the test suite and the benchmark scripts do.
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
    return importlib.import_module("torchvision")
