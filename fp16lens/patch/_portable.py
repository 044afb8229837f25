"""A patched model made fit for a file: FP32 islands that survive torch.export, TorchScript
and a later ``.half()``.

In memory an ``Fp32Island`` keeps FP32 by overriding ``_apply``; a saved program has no
such class. torch.export and tracing also fix every dtype they see: ``x.float()`` becomes
an assertion that the input is FP32 and ``out.to(x.dtype)`` a cast to FP32, so
``torch.export.load(f).module().half()`` used to fail at the island. ``portable(model)``
replaces each island by a ``PortableIsland`` that computes the same values with no dtype
written into the traced graph:

- its tensors are stored so that ``.half()`` leaves them (see ``STORAGES``): int32 buffers
  of their bits for torch.export, constants for TorchScript, read as FP32 on every call;
- its input is cast by multiplying with an FP32 scale (type promotion: FP16 * FP32 -> FP32,
  exact for a power of two);
- its output takes the dtype of its first float input at run time
  (``x.new_empty(shape).copy_(out)`` for torch.export, ``out.type_as(x)`` for TorchScript),
  or the model's dtype, followed by a one-element float buffer that ``.half()`` casts.

The island's state_dict keys become ``bits<i>`` in the saved program, whose metadata
(``ISLANDS_FILE``) names the islands so that ``fp16lens export`` keeps them FP32 and
``fp16lens verify`` knows them.
"""

from __future__ import annotations

import copy
import json
import warnings

import torch
from torch import nn

from fp16lens._core.sites import ISLAND_ATTR, is_island
from fp16lens._core.version import __version__
from fp16lens.patch._island import _no_fused_path

ISLANDS_FILE = "fp16lens.json"
"""The extra file of a saved .pt2 / TorchScript .pt that names the model's FP32 islands."""


STORAGES = ("bits", "const")
"""How an island keeps its FP32 tensors in a file. ``bits`` (torch.export): int32 buffers
holding the bits of the FP32 values, which ``.cuda()`` moves and ``.half()`` leaves, read
back with a dtype view (an exporter to ONNX gets them back as FP32 from ``rehydrate``).
``const`` (TorchScript, whose tracer cannot record a dtype view): plain tensor attributes,
which the trace stores as constants that ``.half()`` leaves. ``.cuda()`` does not move
constants either (and the tracer writes the device of a ``.to(tensor)`` as a constant), so
each is read as ``t.type_as(model_dtype.to(float32, copy=True))``: ``type_as`` takes the
dtype and the device of its operand at run time (a copy per call where they differ, none
where they agree), and the operand is a buffer that ``.cuda()`` moves. So
``torch.jit.load(f).cuda().half()`` runs on the GPU (checked in tests/test_gpu.py), as
``torch.jit.load(f, map_location="cuda")`` does without the copies."""


def _store(t: torch.Tensor, storage: str) -> torch.Tensor:
    t = t.detach().float().contiguous().clone()
    return t if storage == "const" else t.view(torch.int32)


def _f32(stored: torch.Tensor) -> torch.Tensor:
    return stored.view(torch.float32) if stored.dtype == torch.int32 else stored


class PortableIsland(nn.Module):
    """An FP32 island whose traced graph holds no dtype: see the module docstring."""

    def __init__(self, island: nn.Module, storage: str = "bits"):
        super().__init__()
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        inner = copy.deepcopy(island.module).float()
        self.names: list[tuple[str, str]] = []
        tensors = [*inner.named_parameters(), *inner.named_buffers()]
        for i, (name, t) in enumerate(t for t in tensors if t[1].is_floating_point()):
            self._keep(f"bits{i}", _store(t, storage), storage)
            self.names.append((name, f"bits{i}"))
            owner, _, attr = name.rpartition(".")
            mod = inner.get_submodule(owner)
            mod._parameters.pop(attr, None)
            mod._buffers.pop(attr, None)
            setattr(mod, attr, None)  # forward sets it from the bits on every call
        self.module = inner
        in_scale = torch.tensor([float(getattr(island, "in_scale", 1.0))])
        self._keep("in_bits", _store(in_scale, storage), storage)
        self._keep("one_bits", _store(torch.ones(1), storage), storage)
        self.storage = storage
        self.out_scale = float(getattr(island, "out_scale", 1.0))
        self.fp32_out = bool(getattr(island, "fp32_out", False))  # hands on FP32 (Fp32Island)
        self.fp32_in = bool(getattr(island, "fp32_in", False))  # fed FP32, hands back the model's
        outside = getattr(island, "outside_dtype", torch.float32)
        self.register_buffer("model_dtype", torch.zeros(1, dtype=outside))  # follows .half()
        self.register_forward_pre_hook(_no_fused_path)
        if isinstance(inner, nn.MultiheadAttention):  # see Fp32Island: no fused encoder path
            self._qkv_same_embed_dim = False

    def _keep(self, name: str, t: torch.Tensor, storage: str) -> None:
        if storage == "const":
            object.__setattr__(self, name, t)  # a plain attribute: a constant when traced
        else:
            self.register_buffer(name, t)

    def forward(self, *args, **kwargs):
        ref = self.model_dtype
        for a in args:
            if torch.is_tensor(a) and a.is_floating_point() and not self.fp32_in:
                ref = a
                break
        # constants (TorchScript) copied to the device of a buffer, in FP32 (see STORAGES);
        # buffers (torch.export) are there already
        where = (  # copy=True: a no-op .float() would leave no op in the trace
            self.model_dtype.to(torch.float32, copy=True) if self.storage == "const" else None
        )
        read = (lambda t: t.type_as(where)) if where is not None else _f32
        one = read(self.one_bits)
        args = tuple(self._enter(a, read(self.in_bits), one) for a in args)
        kwargs = {k: self._enter(v, one, one) for k, v in kwargs.items()}
        for name, b in self.names:  # plain attributes, set per call (traceable by export and jit)
            owner, _, attr = name.rpartition(".")
            setattr(self.module.get_submodule(owner), attr, read(getattr(self, b)))
        out = self.module(*args, **kwargs)
        return self._leave(out, ref, [self.out_scale])

    def __getattr__(self, name: str):
        """Attributes the model's own code reads from the wrapped module (``batch_first``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    def _enter(self, a, scale: torch.Tensor, one: torch.Tensor):
        if isinstance(a, (tuple, list)):  # a recurrent state: only cast
            return type(a)(self._enter(t, one, one) for t in a)
        if not (torch.is_tensor(a) and a.is_floating_point()):
            return a
        return a * scale  # an FP32 one-element tensor: the product is FP32

    def _leave(self, out, ref: torch.Tensor, pending: list[float]):
        if torch.is_tensor(out):
            if not out.is_floating_point():
                return out
            scale = pending.pop() if pending else 1.0
            out = out / scale if scale != 1.0 else out
            if self.fp32_out:
                return out
            if self.storage == "const":  # TorchScript records type_as with its operand
                return out.type_as(ref)
            return ref.new_empty(out.shape).copy_(out)  # torch.export would fix type_as's dtype
        if isinstance(out, (tuple, list)):
            items = [self._leave(o, ref, pending) for o in out]
            return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
        if isinstance(out, dict):
            return type(out)((k, self._leave(v, ref, pending)) for k, v in out.items())
        return out

    def extra_repr(self) -> str:
        return f"out_scale={self.out_scale:g}, tensors={len(self.names)}"


setattr(PortableIsland, ISLAND_ATTR, True)


def island_names(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s FP32 islands (outermost only)."""
    names: list[str] = []
    for name, m in model.named_modules():
        if is_island(m) and not any(name.startswith(f"{n}.") for n in names):
            names.append(name)
    return names


def portable(model: nn.Module, storage: str = "bits") -> nn.Module:
    """A copy of ``model`` whose FP32 islands are ``PortableIsland``s (the model itself when it
    has none): the same FP32 outputs, and islands that stay FP32 in a saved program
    (``storage``: see ``STORAGES``)."""
    names = [n for n in island_names(model) if hasattr(model.get_submodule(n), "module")]
    if not names:
        return model
    out = copy.deepcopy(model)
    if "" in names:  # the whole model kept FP32 (the proof's last resort): one island
        return PortableIsland(out, storage)
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent), child, PortableIsland(out.get_submodule(name), storage))
    return out


def islands_metadata(model: nn.Module) -> str:
    """The ``ISLANDS_FILE`` text for a saved program of ``model``."""
    return json.dumps({"fp16lens_version": __version__, "fp32_modules": island_names(model)})


def read_islands(text: str | bytes) -> list[str]:
    """The island names an ``ISLANDS_FILE`` holds ([] for an empty or foreign file)."""
    try:
        data = json.loads(text or "{}")
    except ValueError:
        return []
    names = data.get("fp32_modules", []) if isinstance(data, dict) else []
    return [n for n in names if isinstance(n, str)]


def mark_islands(model: nn.Module, names: list[str]) -> list[str]:
    """Mark the modules a saved program names as islands (verify and export recognise the
    marker); returns the names found in ``model``."""
    found = []
    for name in names:
        try:
            sub = model.get_submodule(name)
            object.__setattr__(sub, ISLAND_ATTR, True)
        except (AttributeError, RuntimeError):  # flattened away, or a ScriptModule
            continue
        found.append(name)
    return found


def rehydrate(model: nn.Module) -> int:
    """In a loaded program (torch.export's unflattened modules, fx graphs), replace each bit
    view of an island's int32 storage by an FP32 buffer of the same values, in place, for
    exporters that cannot trace a dtype view (ONNX). The result runs the same FP32 values;
    ``.half()`` then casts those buffers too, so use it for export only. Returns how many
    tensors were replaced."""
    view = torch.ops.aten.view.dtype
    replaced = 0
    for sub in model.modules():
        if isinstance(sub, torch.jit.ScriptModule):  # a TorchScript file keeps constants
            continue
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in list(graph.nodes):
            if not (
                node.op == "call_function"
                and node.target == view
                and node.args[1:] == (torch.float32,)
            ):
                continue
            src = node.args[0]
            bits = getattr(sub, src.target, None) if src.op == "get_attr" else None
            if not (isinstance(bits, torch.Tensor) and bits.dtype == torch.int32):
                continue
            name = f"{src.target}_fp32"
            if not hasattr(sub, name):
                sub.register_buffer(name, bits.view(torch.float32).clone())
            with graph.inserting_before(node), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # fx: the owner is the module's
                node.replace_all_uses_with(graph.get_attr(name))
            graph.erase_node(node)
            replaced += 1
        for node in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:
            graph.erase_node(node)
        if hasattr(sub, "finalize"):
            sub.finalize()
        elif hasattr(sub, "recompile"):
            sub.recompile()
    return replaced
