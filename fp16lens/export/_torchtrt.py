"""compile_torch_tensorrt(): explicit typing, with the FP32 islands kept as FP32 modules.

The model is made FP16 except the islands, which compute in FP32 (``half_with_islands``,
plain PyTorch, testable on a CPU); torch-tensorrt then compiles it with
``use_explicit_typing=True`` so TensorRT keeps exactly those types.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from fp16lens._core import ExportError, import_optional
from fp16lens.export._islands import resolve_fp32_modules

_PURPOSE = "compiling with torch-tensorrt"


def _cast_floats(obj, dtype: torch.dtype):
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


class Typed(nn.Module):
    """Runs ``inner`` in ``dtype``: its floating-point inputs are cast to ``dtype`` first.

    Outputs keep ``dtype``: an FP32 island's values stay FP32 (type promotion carries them
    through functional ops) until a module typed FP16 casts them down on entry.
    """

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = inner.to(dtype)
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        args, kwargs = _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)
        return self.inner(*args, **kwargs)


def half_with_islands(model: nn.Module, fp32_modules: Iterable[str]) -> nn.Module:
    """A copy of ``model`` computing in FP16 except ``fp32_modules``, which compute in FP32.

    Each island, and each FP16 leaf module holding floating-point tensors, casts its inputs
    to its own dtype, so the Casts sit exactly where a value enters or leaves an island.
    """
    islands = set(fp32_modules)
    typed = copy.deepcopy(model)  # islands keep the FP32 parameters, not FP16 round trips
    if "" in islands:
        return Typed(typed, torch.float32)
    outermost = {i for i in islands if not _inside(i, islands, strict=True)}
    for name, module in list(typed.named_modules()):
        if _inside(name, outermost, strict=False):
            continue
        _half_direct_tensors(module)
        if name and _is_float_leaf(module):
            _replace(typed, name, Typed(module, torch.float16))
    for name in outermost:
        _replace(typed, name, Typed(typed.get_submodule(name), torch.float32))
    return typed


def _half_direct_tensors(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        if p.is_floating_point():
            p.data = p.data.half()
    for key, b in module.named_buffers(recurse=False):
        if b.is_floating_point():
            module._buffers[key] = b.half()


def _inside(name: str, islands: set[str], strict: bool) -> bool:
    return any(name.startswith(f"{i}.") for i in islands) or (not strict and name in islands)


def _is_float_leaf(module: nn.Module) -> bool:
    if next(module.children(), None) is not None:
        return False
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.is_floating_point() for t in tensors)


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name), child, new)


def compile_torch_tensorrt(
    model: nn.Module,
    example_inputs,
    precision: str = "fp16",
    *,
    fp32_modules: Iterable[str] | None = None,
    **compile_kwargs,
):
    """torch_tensorrt.compile with explicit typing: FP16 everywhere but the FP32 islands
    (the plan's and ``fp32_modules``). Extra keyword arguments go to torch_tensorrt.compile."""
    torch_trt = import_optional("torch_tensorrt", "torchtrt", _PURPOSE)
    if precision not in ("fp16", "fp32"):
        raise ExportError(
            f"compile_torch_tensorrt supports precision 'fp16' or 'fp32', got {precision!r}; for "
            "INT8 use export(..., precision='int8') and build_engine()"
        )
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    islands = resolve_fp32_modules(model, fp32_modules)
    if precision == "fp16":
        model, args = half_with_islands(model, islands), _cast_floats(args, torch.float16)
    model = model.eval().cuda()
    args = tuple(a.cuda() if torch.is_tensor(a) else a for a in args)
    return torch_trt.compile(
        model, ir="dynamo", inputs=list(args), use_explicit_typing=True, **compile_kwargs
    )
