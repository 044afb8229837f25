"""Saving a patched model in a file that keeps its fix (``fp16lens.patch.save``), which the
command line's MODEL arguments load again.

A state_dict does not keep all of it: FP32 islands are modules (``Fp32Island`` wrappers,
activations moved into children), not tensors, and a norm's eps is an attribute.
``patched.state_dict()`` has the original keys, so it loads into the original class, with
the rescaled weights, without the islands (and the scales they carry) and with the old
eps. (A batch norm keeps its own eps: ``bn_affine_stats``.)"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from fp16lens._core import Fp16LensError
from fp16lens._core.paths import check_save_path
from fp16lens._trace import call_args

if TYPE_CHECKING:
    from torch import nn


STATE_DICT_NOTE = "patched.state_dict() does not hold the whole fix"
"""How the plan's note on saving a patched model begins (when a state_dict misses a part)."""

_KEEP = (
    "keep the fix in a file with fp16lens.patch.save(patched, inputs, 'patched.pt2') "
    "(torch.export.load(...).module().half() runs it) or export it, or keep the original "
    "weights and the report and patch again where the model is loaded "
    "(fp16lens.patch(model, fp16lens.Report.load('report.json')))"
)


def state_dict_note(islands: int, multiplies: int, eps: dict[str, float]) -> str | None:
    """The plan's note on what ``patched.state_dict()`` misses: ``islands`` FP32 islands
    (modules, with the scales they carry), ``multiplies`` scalar multiplies inserted in a
    forward, and the norms whose eps became eps / p^2 (``eps``: module -> new eps, an
    attribute); None when it holds the whole fix."""
    parts = []
    if islands:
        parts.append(f"{islands} FP32 island(s) (modules, with any scales they carry)")
    if multiplies:
        parts.append(f"{multiplies} multiply(s) the fix inserted in a forward")
    if eps:
        shown = ", ".join(f"{m or 'the model'}.eps = {e:.4g}" for m, e in list(eps.items())[:3])
        more = f" and {len(eps) - 3} more" if len(eps) > 3 else ""
        parts.append(f"{len(eps)} norm(s) computing with eps / p^2 ({shown}{more})")
    if not parts:
        return None
    return (
        f"{STATE_DICT_NOTE}: {'; '.join(parts)}. Loaded into the original class, the "
        "rescaled weights run without them: its outputs change, and real FP16 can fail "
        f"again; {_KEEP}"
    )


def save(model: nn.Module, example_inputs, path: str | Path) -> Path:
    """Save a patched ``model`` so that its file keeps the fix: ``.pt2`` a torch.export
    program (recommended), ``.pt``/``.pth`` TorchScript traced on ``example_inputs`` (a
    batch as every stage takes one: a tuple of positional arguments, a dict of keywords or
    one tensor; ``_trace.call_args``). Its
    FP32 islands are stored so that a later ``.half()`` leaves them FP32, and the file names
    them (``ISLANDS_FILE``) for ``fp16lens export`` and ``verify``:
    ``torch.export.load(path).module().half()`` runs the fix with torch alone. Returns the
    path. (``patched.state_dict()`` does not keep islands: see this module's docstring.)"""
    import torch

    path = check_save_path(path)
    suffix = path.suffix.lower()
    path.parent.mkdir(parents=True, exist_ok=True)
    from fp16lens.patch import ISLANDS_FILE, islands_metadata, portable

    model = model.eval()
    meta = {ISLANDS_FILE: islands_metadata(model)}
    args, kwargs = call_args(example_inputs)
    if kwargs and suffix != ".pt2":  # TorchScript traces positional arguments only
        args, kwargs = _positional(model, kwargs, path), {}
    # FP32 islands in a form that a file keeps: they stay FP32 under a later .half()
    model = portable(model, "bits" if suffix == ".pt2" else "const")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecation notices
        if suffix == ".pt2":
            try:
                program = torch.export.export(model, args, kwargs=kwargs)
            except Exception as exc:  # torch.export cannot capture every forward
                said = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise Fp16LensError(
                    f"torch.export cannot capture the patched model ({type(exc).__name__}: "
                    f"{said}); save it as TorchScript instead (-o {path.with_suffix('.pt').name})"
                ) from exc
            _copy_before_layout_views(program)
            torch.export.save(program, str(path), extra_files=meta)
        else:
            traced = torch.jit.trace(model, args, strict=False, check_trace=False)
            traced.save(str(path), _extra_files=meta)
    return path


def _positional(model: nn.Module, kwargs: dict, path: Path) -> tuple:
    """Keyword inputs in the order of ``model.forward``'s parameters (a model kept FP32
    whole is an island around it: its own forward's); a forward that takes them otherwise
    (keyword-only, ``**kwargs``) is refused in one line."""
    import inspect

    from fp16lens.patch._island import Fp32Island

    while isinstance(model, Fp32Island):
        model = model.module
    try:
        bound = inspect.signature(model.forward).bind(**kwargs)
    except TypeError as exc:
        raise Fp16LensError(
            f"cannot trace the patched model on keyword inputs ({exc}); save it as a "
            f"torch.export program instead (-o {path.with_suffix('.pt2').name})"
        ) from exc
    if bound.kwargs:
        raise Fp16LensError(
            f"cannot trace the patched model on keyword-only inputs ({', '.join(bound.kwargs)}); "
            f"save it as a torch.export program instead (-o {path.with_suffix('.pt2').name})"
        )
    return bound.args


def _copy_before_layout_views(program) -> int:
    """Make each ``view`` of a permuted or transposed attention output in ``program`` read a
    contiguous copy of it, so the file runs on any device; returns how many were mended.

    Before torch 2.13, ``torch.export`` drops a ``.contiguous()`` that is a no-op on the
    tracing device: ``nn.MultiheadAttention``'s ``permute(...).contiguous().view(...)`` after
    its SDPA became ``permute -> view``, which runs where it was exported (the CPU) and fails
    on CUDA, whose SDPA returns another layout ("view size is not compatible ...";
    pytorch/pytorch#179287, fixed in torch by a ``reshape``). A copy to contiguous there is
    what ``.contiguous()`` does wherever the layout is not already contiguous."""
    import torch

    aten = torch.ops.aten
    layouts = {aten.permute.default, aten.transpose.int, aten.t.default}
    graph = program.graph_module.graph
    mended = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.view.default:
            continue
        source = node.args[0]
        if not _layout_of_attention(source, layouts):
            continue
        with graph.inserting_before(node):
            copy = graph.call_function(
                aten.clone.default, (source,), {"memory_format": torch.contiguous_format}
            )
        copy.meta = {k: v for k, v in node.meta.items() if k != "val"}
        if "val" in source.meta:
            copy.meta["val"] = source.meta["val"].clone(memory_format=torch.contiguous_format)
        node.replace_input_with(source, copy)
        mended += 1
    if mended:
        program.graph_module.recompile()
    return mended


def _layout_of_attention(node, layouts) -> bool:
    """Whether ``node`` is a permute/transpose (of one) of an SDPA output: the layout that
    differs by device (other views keep the copy-free form torch exported)."""
    import operator

    import torch

    seen = False
    while isinstance(node, torch.fx.Node) and node.target in layouts:
        node, seen = node.args[0], True
    if isinstance(node, torch.fx.Node) and node.target is operator.getitem:
        node = node.args[0]  # a fused SDPA kernel's (output, ...) tuple
    target = getattr(node, "target", None)
    return seen and "scaled_dot_product" in str(getattr(target, "__name__", target))
