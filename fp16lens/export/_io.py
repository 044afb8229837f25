"""Names and dynamic axes of an exported graph's inputs and outputs.

torch's exporters name inputs after nothing in particular (``args_0``, ``onnx::Gemm_0``)
and fix every dimension to the example's. ``io_spec`` names inputs after the model's
``forward`` parameters and outputs after what the model returns (``output``,
``output_<i>``, a dict's keys, a transformers ModelOutput's fields), and makes the batch
axis (dimension 0 of every input and output) and the sequence axis (dimension 1 of every
input of rank 2 or 3) symbolic when asked.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from fp16lens._core import OptionError, onnx_large

DYNAMIC_AXES = ("batch", "sequence")


@dataclass(frozen=True)
class IoSpec:
    input_names: list[str] | None
    output_names: list[str] | None
    dynamic_axes: dict[str, dict[int, str]] | None

    def kwargs(self) -> dict:
        """Keyword arguments of ``torch.onnx.export`` (both exporters take them)."""
        out: dict = {}
        if self.input_names:
            out["input_names"] = self.input_names
        if self.output_names:
            out["output_names"] = self.output_names
        if self.dynamic_axes:
            out["dynamic_axes"] = self.dynamic_axes
        return out


def check_dynamic(dynamic) -> tuple[str, ...]:
    """``dynamic`` as a tuple of known axis names (an OptionError names the known ones)."""
    names = (dynamic,) if isinstance(dynamic, str) else tuple(dynamic or ())
    unknown = [n for n in names if n not in DYNAMIC_AXES]
    if unknown:
        raise OptionError(
            f"dynamic axes must be among {', '.join(DYNAMIC_AXES)}, got {unknown[0]!r}"
        )
    return names


def io_spec(model: torch.nn.Module, args: tuple, dynamic: tuple[str, ...] = ()) -> IoSpec:
    """Names for ``model(*args)``'s inputs and outputs, and its dynamic axes."""
    inputs = _input_names(model, args)
    with torch.no_grad():
        outputs = _output_names(model(*args))
    if not dynamic or inputs is None:
        return IoSpec(inputs, outputs, None)
    axes: dict[str, dict[int, str]] = {}
    for name, a in zip(inputs, args):
        dims = {0: "batch"} if "batch" in dynamic and a.dim() >= 1 else {}
        if "sequence" in dynamic and a.dim() in (2, 3):
            dims[1] = "sequence"
        if dims:
            axes[name] = dims
    for name in outputs or () if "batch" in dynamic else ():
        axes[name] = {0: "batch"}
    return IoSpec(inputs, outputs, axes or None)


def _input_names(model: torch.nn.Module, args: tuple) -> list[str] | None:
    if not all(torch.is_tensor(a) for a in args):
        return None  # the exporters flatten other arguments their own way
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= len(args) and not positional[0].startswith("args"):
        return positional[: len(args)]
    return ["input"] if len(args) == 1 else [f"input_{i}" for i in range(len(args))]


def _output_names(out) -> list[str] | None:
    if torch.is_tensor(out):
        return ["output"]
    if isinstance(out, dict) or hasattr(out, "keys"):
        items = [(k, v) for k, v in out.items() if v is not None]
        if all(isinstance(k, str) and torch.is_tensor(v) for k, v in items):
            return [k for k, _ in items]
        return None
    if isinstance(out, (tuple, list)) and all(torch.is_tensor(o) for o in out):
        return [f"output_{i}" for i in range(len(out))]
    return None


def other_sizes(args: tuple, spec: IoSpec) -> tuple | None:
    """``args`` with every dynamic axis of another size (batch doubled, sequence one
    shorter), or None when there is nothing to vary."""
    if not spec.dynamic_axes or not spec.input_names:
        return None
    out = []
    for name, a in zip(spec.input_names, args):
        dims = spec.dynamic_axes.get(name, {})
        if dims.get(1) == "sequence" and a.shape[1] > 1:
            a = a.narrow(1, 0, a.shape[1] - 1)
        if dims.get(0) == "batch":
            a = torch.cat([a, a.flip(0)], dim=0)
        out.append(a.contiguous())
    return tuple(out)


def dynamic_failure(proto, model: torch.nn.Module, args: tuple, spec: IoSpec) -> str | None:
    """Run the FP32 graph ``proto`` on inputs whose dynamic axes have other sizes and
    compare with ``model``: why it does not hold (a size baked in by the exporter), or None."""
    from fp16lens._core import import_optional

    ort = import_optional("onnxruntime", "onnx", "checking dynamic axes")
    other = other_sizes(args, spec)
    if other is None:
        return None
    try:
        quiet = ort.SessionOptions()
        quiet.log_severity_level = 4  # the failure is reported below, in one line
        session = onnx_large.session(ort, proto, quiet)
        feed = {i.name: a.numpy() for i, a in zip(session.get_inputs(), other)}
        got = session.run(None, feed)
    except Exception as exc:  # ONNX Runtime refuses the other sizes
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    with torch.no_grad():
        want = model(*other)
    flat = (
        [want]
        if torch.is_tensor(want)
        else [v for v in (want.values() if hasattr(want, "values") else want) if torch.is_tensor(v)]
    )
    for g, w in zip(got, flat):
        if tuple(g.shape) != tuple(w.shape):
            return f"an output has shape {tuple(g.shape)} where the model gives {tuple(w.shape)}"
    return None
