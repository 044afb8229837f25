"""Where torch releases differ, in one place (setup.cfg admits every release from the floor on).

Everything that depends on the installed torch release is decided here, so the rest of
fp16lens reads one name instead of testing versions itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# torch's release as (major, minor): "2.13.0+cpu" -> (2, 13)
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@contextlib.contextmanager
def dispatch_mode_paused(mode: TorchDispatchMode) -> Iterator[bool]:
    """``mode`` taken off the dispatch-mode stack while the block runs, and put back after,
    when it is the innermost mode (ops run inside then reach it no more); otherwise nothing
    changes. Yields whether it was paused. torch has no public way to do this: the two
    names below are private (present from torch 2.1 to 2.13)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    if _get_current_dispatch_mode() is not mode:
        yield False
        return
    with _pop_mode_temporarily():
        yield True


def register_state_dict_post_hook(module: torch.nn.Module, hook) -> object:
    """``module.register_state_dict_post_hook(hook)``, public from torch 2.5; before it the
    private ``_register_state_dict_hook``, which calls ``hook(module, state_dict, prefix,
    local_metadata)`` the same way."""
    register = getattr(module, "register_state_dict_post_hook", None)
    return (register or module._register_state_dict_hook)(hook)


@contextlib.contextmanager
def mha_fast_path_under_make_fx() -> Iterator[None]:
    """nn.MultiheadAttention leaves its fused fast path when it sees make_fx's mode on the
    stack; the eager path takes it (and records the steps the fused kernel stores as their
    own sites), so the capture must take it too. Nothing changes where torch has no such
    check (``torch.nn.modules.activation._is_make_fx_tracing``, a private name)."""
    from torch.nn.modules import activation

    saved = getattr(activation, "_is_make_fx_tracing", None)
    if saved is None:
        yield
        return
    activation._is_make_fx_tracing = lambda: False
    try:
        yield
    finally:
        activation._is_make_fx_tracing = saved


@contextlib.contextmanager
def torch_function_metadata_mode_off() -> Iterator[None]:
    """Inside make_fx: its torch-function mode (source metadata, which this graph does not
    need) taken off while the forward runs, since any torch-function mode makes
    nn.MultiheadAttention leave its fast path (``has_torch_function``). The mode's class
    and ``_pop_mode_temporarily`` are private; nothing changes where the mode is absent."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    stack = _get_current_function_mode_stack()
    if not stack or type(stack[-1]).__name__ != "TorchFunctionMetadataMode":
        yield
        return
    with _pop_mode_temporarily():
        yield


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes in on ``device_type`` ("cpu", "cuda") right now,
    or None when it is off there. ``torch.is_autocast_enabled(device_type)`` and
    ``torch.get_autocast_dtype`` take a device from torch 2.4; before, the CPU has its own
    names and the plain ones mean CUDA."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):
        if device_type == "cpu":
            on, dtype = torch.is_autocast_cpu_enabled, torch.get_autocast_cpu_dtype
        else:
            on, dtype = torch.is_autocast_enabled, torch.get_autocast_gpu_dtype
        return dtype() if on() else None
