"""export(): PyTorch model (or an FP32 ONNX file) -> ONNX file in FP32, strongly typed
FP16, or INT8 Q/DQ."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fp16lens._core import ExportError, import_optional, onnx_large
from fp16lens._core.feeds import declared_batch, split_to_declared
from fp16lens._core.model_dtype import half_model
from fp16lens._core.onnx_types import check_graph, is_onnx
from fp16lens._core.options import given, one_form
from fp16lens._core.paths import check_writable
from fp16lens._core.weights import missing_weights
from fp16lens.export._artifact import (
    EXPORTER_KEY,
    PRECISION_KEY,
    ExportArtifact,
    default_opset,
    records,
)
from fp16lens.export._io import dynamic_failure, io_spec
from fp16lens.export._islands import fp32_outputs, resolve_fp32_modules
from fp16lens.export._naming import map_nodes, stamp
from fp16lens.export._onnx_in import ONNX_EXPORTER
from fp16lens.export._onnx_meta import ISLANDS_KEY, in_islands
from fp16lens.export._options import ExportOptions
from fp16lens.export._ranges import MAY_CHANGE, keep_fp32
from fp16lens.export._torch_export import export_fp32

if TYPE_CHECKING:
    from fp16lens.export._int8_search import Target as Int8Target


def export(
    model,
    example_inputs,
    path: str | Path,
    precision: str | None = None,
    *,
    options: ExportOptions | None = None,
    calibration: Iterable | None = None,
    evaluation: Iterable | None = None,
    fp32_modules: Iterable[str] | None = None,
    fp32_nodes: Iterable[str] | None = None,
    io_dtype: str | None = None,
    opset: int | None = None,
    exporter: str | None = None,
    calibration_cache: str | Path | None = None,
    dynamic: Iterable[str] | str | None = None,
    target: float | Int8Target | None = None,
    max_fallback: float | None = None,
    float_parts: str | None = None,
) -> ExportArtifact:
    """Export ``model(*example_inputs)`` to ``path``.

    The options are ``options=ExportOptions(...)`` or the same fields as keywords (and
    ``precision`` as the fourth argument), not both. precision "fp32" keeps the exported
    graph; "fp16" (the default) makes every float tensor FP16 except the FP32 islands (the
    patch plan's ``model._fp16lens_plan.fp32_modules`` plus ``fp32_modules``), with Casts
    at their boundaries; "int8" inserts Q/DQ nodes calibrated on ``calibration`` (an
    iterable of input batches) and writes a TensorRT calibration cache next to the file (or
    at ``calibration_cache``). Q/DQ go where TensorRT computes in INT8 (conv/gemm/matmul
    inputs, residual adds), each activation's range is chosen by its cost at the output;
    with ``target`` (a worst output cosine such as 0.999, or ``Int8Target(threshold,
    metric)``) the costliest layers leave INT8 until the target holds on ``evaluation``
    (default: the calibration batches), and ExportError says so when it cannot (more than
    ``max_fallback`` of the FLOPs, default 10%, would leave INT8).

    An FP16 file is checked in real FP16 once written (``artifact.parity``, verify's
    ``onnx-fp16``: FP16 storage of every tensor): on the example inputs for a PyTorch
    model, on ``evaluation`` for an ONNX source; a warning says where it fails, or that an
    ONNX source came without batches to check it on. An INT8 file given ``evaluation``
    (batches held out from the calibration ones) is checked on them as TensorRT computes
    its Q/DQ graph (``artifact.parity``, verify's ``onnx-int8``), and a warning says where
    it fails; one that passes is checked again with its float parts in FP16, and where
    that fails it is made again from its FP32 graph patched for FP16 (kept only where it
    passes both ways: ``_int8_fp16_fix``). ``float_parts="fp16"`` then types those parts
    FP16 in the file (opset 19 or later, as ModelOpt's default writes them; for a strongly
    typed TensorRT build), checked the same way with their FP16 storage made real, and
    ExportError says so where that fails; with a ``target`` the fallback aims at that
    file (each set scored with those parts in FP32 and in FP16), and the file must meet
    the target itself. One batch of N items for a graph whose first
    axis is fixed below N is fed in parts of that size.

    ``model`` may also be an FP32 ONNX file (a path or an ``onnx.ModelProto``; pass
    ``example_inputs=None``): its graph is re-typed, the FP32 islands being the nodes
    ``fp16lens.patch`` recorded in it, ``fp32_nodes`` (node names) and the nodes of
    ``fp32_modules`` (in a file fp16lens exported).

    A PyTorch model's graph inputs are named after its ``forward`` parameters and its
    outputs after what it returns; ``dynamic=("batch",)`` (or ``("batch", "sequence")``)
    makes those axes symbolic.
    """
    opts = one_form(
        ExportOptions,
        options,
        given(
            precision=precision,
            fp32_modules=fp32_modules,
            fp32_nodes=fp32_nodes,
            io_dtype=io_dtype,
            opset=opset,
            exporter=exporter,
            calibration_cache=calibration_cache,
            dynamic=dynamic,
            target=target,
            max_fallback=max_fallback,
            float_parts=float_parts,
        ),
    )
    if is_onnx(model):
        return _export_onnx(model, path, opts, calibration, evaluation)
    _check_model(model)
    if opts.fp32_nodes is not None:
        raise ExportError(
            "fp32_nodes names nodes of an ONNX source; for a PyTorch model keep modules in "
            "FP32 with fp32_modules=[...]"
        )
    path = _check_writable(Path(path))
    islands = resolve_fp32_modules(model, opts.fp32_modules or None)
    model = _stored_islands_as_fp32(model)
    opts = replace(opts, fp32_modules=islands)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    calibration = _check_calibration(opts, calibration)
    proto, used, notes = _export_fp32(model, args, opts)
    from fp16lens.export._norms import decomposed_norm_warnings  # imports onnx

    names = {n for n, _ in model.named_modules()}
    params = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    origins = map_nodes(proto.graph, names, params)
    for node, origin in zip(proto.graph.node, origins):
        stamp(node, origin)
    notes += decomposed_norm_warnings(proto.graph, origins)
    job = _Job(opts, used, notes, calibration, fp32_outputs(model), evaluation)
    artifact = _typed(proto, path, job)
    if opts.precision == "int8":
        goal = _goal(opts, proto, evaluation, calibration, stored=True)
        first = _checked_int8(model, evaluation, artifact, goal)
        # the islands' modules are stamped on the graph's nodes: the ONNX export reads them
        return _patched_int8(proto, model, path, opts, calibration, evaluation, first)
    if opts.precision != "fp16":
        return artifact
    return _checked_in_fp16(model, [args], artifact, "the example inputs")


UNCHECKED = (
    "the FP16 file was not run in real FP16: an ONNX source has no example inputs; pass "
    "evaluation=[batch] (fp16lens export ... --input batch.npz), or check it with "
    "fp16lens.verify"
)
"""The warning of an FP16 export from an ONNX file given no batches to check it on."""


def _checked_in_fp16(
    reference, batches: list | None, artifact: ExportArtifact, what: str = "the evaluation batches"
):
    """The written FP16 file run in real FP16 on ``batches`` (FP16 storage of every tensor,
    as TensorRT keeps it: verify's ``onnx-fp16`` backend, also without a GPU) against the
    FP32 ``reference`` (the PyTorch model, in eval mode, on its example inputs; or the FP32
    ONNX source on ``evaluation``): ``artifact.parity``, and a warning where it fails,
    naming where the values first go wrong. An FP16 file is never handed over unchecked
    without saying so."""
    if not batches:
        return replace(artifact, warnings=(*artifact.warnings, UNCHECKED))
    result, failed = _run_check(reference, batches, artifact, "onnx-fp16")
    if result is None:
        note = f"the FP16 file was not run in real FP16 on {what} ({failed}); check it with fp16lens.verify"
        return replace(artifact, warnings=(*artifact.warnings, note))
    if result.passed:  # a subnormal weight's loss did not show on these inputs: say so
        seen = (
            f"{MAY_CHANGE} (not on {what}: the FP16 file's check there passed, worst output "
            f"cosine {result.cosine:.6f}; other inputs may differ)"
        )
        warnings = tuple(w.replace(MAY_CHANGE, seen, 1) for w in artifact.warnings)
        return replace(artifact, parity=result, warnings=warnings)
    note = (
        f"the FP16 file fails in real FP16 on {what} (FP16 storage of every "
        f"tensor, as TensorRT keeps it): {_why(result)}; find and fix the cause first "
        f"(fp16lens.scan(model, inputs), then fp16lens.patch), or {keep_fp32(not isinstance(reference, torch.nn.Module))}"
    )
    return replace(artifact, parity=result, warnings=(*artifact.warnings, note))


def _checked_int8(
    reference, evaluation: Iterable | None, artifact: ExportArtifact, goal: _Goal | None = None
):
    """The written INT8 file computed as TensorRT runs its Q/DQ graph (verify's
    ``onnx-int8``) on the held-out ``evaluation`` batches against the FP32 ``reference``
    (the PyTorch model, or the FP32 ONNX source): ``artifact.parity``, and a warning where
    it fails verify's INT8 tolerance. Without evaluation batches, as written (a target
    was checked on the calibration batches). ``goal``: the target given, which the check
    with the float parts in FP16 scores too."""
    if not evaluation:
        return artifact
    graph = artifact.path if isinstance(reference, torch.nn.Module) else reference
    batches, what = _as_declared(evaluation, graph)
    result, failed = _run_check(reference, batches, artifact, "onnx-int8")
    if result is None:
        note = f"the INT8 file was not checked on {what} ({failed}); check it with fp16lens.verify"
        return replace(artifact, warnings=(*artifact.warnings, note))
    if result.passed:  # then also with its float parts in FP16, as some builds run them
        checked = _float_parts_in_fp16(reference, batches, what, artifact, goal)
        return replace(checked, parity=result)
    keep = keep_fp32(not isinstance(reference, torch.nn.Module))
    check = f"{what} (the Q/DQ graph computed as TensorRT runs it): {_why(result)}"
    target = (artifact.int8 or {}).get("target")
    if target is None:
        note = (
            f"the INT8 file fails its check on {check}; give a parity target "
            f"(export(..., target=0.999)) so the costliest layers leave INT8, or {keep}"
        )
    else:  # met (export raises where it is not): the check reads more than the target
        note = (
            f"the INT8 file meets its target ({target['metric']} {target['score']:.4f} >= "
            f"{target['threshold']:g}) but fails verify's check on {check}; outputs the "
            f"target does not read moved: keep the file if {target['metric']} is what your "
            f"task reads, or give a target on the outputs' cosine (export(..., "
            f"target=0.999)), or {keep}"
        )
    return replace(artifact, parity=result, warnings=(*artifact.warnings, note))


def _float_parts_in_fp16(
    reference, batches: list, what: str, artifact: ExportArtifact, goal: _Goal | None = None
):
    """The INT8 file, which passed its check, checked again with every tensor a node
    writes stored in FP16 (its initializers FP32): how a TensorRT build with FP16 beside
    INT8 may compute the parts that are not INT8 (``build_engine`` before TensorRT 10.12,
    weakly typed). With a ``goal`` (the target given) it holds only where that target
    holds too. The file records the verdict (``FP16_REST_KEY``), which ``build_engine``
    follows: where it fails, FP16 stays off. ``artifact.int8["float_parts_fp16"]`` holds
    it as data, and a warning says where it fails."""
    import tempfile

    from fp16lens.export._onnx_meta import FP16_REST_KEY
    from fp16lens.patch.onnx._fp16 import fp16_storage

    onnx = import_optional("onnx", "onnx", "ONNX export")
    written = onnx.load(str(artifact.path))
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / artifact.path.name
        try:
            onnx_large.save(onnx, fp16_storage(written, initializers=False)[0], copy)
        except Exception as exc:  # a graph shape inference cannot read: said, not raised
            said = (str(exc).splitlines() or [""])[0][:160]
            result, failed = None, f"{type(exc).__name__}: {said}"
        else:
            at = replace(artifact, path=copy)
            result, failed = _run_check(reference, batches, at, "onnx-int8")
            score = goal.score(copy) if goal is not None and result is not None else None
    if result is None:
        note = (
            f"the INT8 file was not checked with its float parts in FP16 on {what} ({failed}); "
            "build it strongly typed (TensorRT 10.12 or later), which computes them in FP32"
        )
        return replace(artifact, warnings=(*artifact.warnings, note))
    missed = goal is not None and score is not None and score < goal.target.threshold
    passed = result.passed and not missed
    verdict = "holds" if passed else "fails"
    cosine = result.cosine if result.cosine is not None else float("nan")
    _set_meta(written, {FP16_REST_KEY: f"{verdict} {cosine:.6f}"})
    _save(written, artifact.path)
    rest: dict[str, Any] = {"passed": passed, "cosine": result.cosine}
    if goal is not None:
        rest["target_score"] = score
    artifact = replace(artifact, int8={**(artifact.int8 or {}), "float_parts_fp16": rest})
    if passed:
        return artifact
    if result.passed:  # verify's check holds, the target given does not
        assert goal is not None and score is not None
        first = ((artifact.int8 or {}).get("target") or {}).get("score")
        why = f"misses its target on {what}: {goal.scored(score, first)}"
    else:
        named = re.sub(r"__fp16lens_fp(16|32)_[0-9]+", "", _why(result))  # the node's own name
        why = f"fails verify's check on {what}: {named}"
    note = (
        f"with its float parts in FP16 (as a TensorRT build with FP16 beside INT8 may compute "
        f"them: weakly typed, before 10.12) the INT8 file {why}; build_engine builds it with FP16 off (INT8 and FP32, as checked), and "
        "TensorRT 10.12 or later builds it strongly typed, its float parts in FP32"
    )
    return replace(artifact, warnings=(*artifact.warnings, note))


def _run_check(reference, batches: list, artifact: ExportArtifact, backend: str):
    """``(result, "")``: verify's result of the written file on ``batches`` against
    ``reference`` (a PyTorch model, run in eval mode and left as it was, or an FP32 ONNX
    source); ``(None, why)`` where the check itself failed to run. The file stays written
    either way."""
    from fp16lens.verify import verify

    module = reference if isinstance(reference, torch.nn.Module) else None
    was_training = module.training if module is not None else False
    if module is not None:
        module.eval()
    try:
        return verify(reference, artifact.path, batches, backend=backend), ""
    except Exception as exc:  # the check failed to run: the caller says so
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        return None, f"{type(exc).__name__}: {said}"
    finally:
        if module is not None:
            module.train(was_training)


def _why(result) -> str:
    """Why a failed check failed: inf/NaN, or the worst cosine, and where it starts."""
    where = f", first at {result.first_divergence}" if result.first_divergence else ""
    if result.nonfinite:
        return f"its outputs hold inf/NaN where FP32 is finite{where}"
    changed = [f"{k} ({m.shape_change})" for k, m in result.outputs.items() if m.shape_change]
    if changed:  # a decoder that stops at another step: the result itself differs
        return f"the length of {', '.join(changed)} changes{where}"
    if result.cosine is not None and result.cosine >= result.tolerance.min_cosine:
        return f"{result.failures()[0]}{where}"  # its cosine about FP32's mean, or a max_rel
    return (
        f"its worst output cosine against FP32 is {result.cosine:.6f}, below "
        f"{result.tolerance.min_cosine}{where}"
    )


@dataclass(frozen=True)
class _Goal:
    """The INT8 target given to export, with what it was scored against as written: the
    FP32 graph ``source`` (a ModelProto or path) and ``batches`` (the evaluation batches,
    else the calibration batches). A file with its float parts in FP16 claims the target
    only where it scores so itself."""

    source: Any
    target: Int8Target
    batches: list

    def score(self, path: Path) -> float:
        from fp16lens.export._int8 import target_on_file

        return target_on_file(self.source, path, self.batches, self.target)

    def scored(self, score: float, first: float | None) -> str:
        """``score`` against the target, beside ``first``: the FP32-parts file's."""
        from fp16lens.export._int8_search import shown

        t = self.target
        beside = f" ({shown(first, t.threshold)} with them FP32)" if first is not None else ""
        side = "<" if score < t.threshold else ">="
        return f"{t.name} {shown(score, t.threshold)} {side} {t.threshold:.12g}{beside}"


def _goal(opts: ExportOptions, source, evaluation, calibration, stored=False) -> _Goal | None:
    """The target of an INT8 export (None without one) and what it is scored on.
    ``stored``: for the check with the float parts stored FP16 (a weakly typed build),
    which with ``float_parts="fp16"`` keeps verify's bar alone: those parts are typed
    FP16 in the file, whose own check scores the target (``_typed_float_parts``), and the
    fallback aimed at that form, not this one."""
    from fp16lens.export._int8_search import as_target

    if stored and opts.float_parts == "fp16":
        return None
    target = as_target(opts.target) if opts.precision == "int8" else None
    batches = list(evaluation) if evaluation else list(calibration or [])
    return None if target is None or not batches else _Goal(source, target, batches)


def _as_declared(evaluation: Iterable, graph) -> tuple[list, str]:
    """The evaluation batches as the ONNX ``graph`` takes them (one batch of N items split
    where its first axis is fixed below N), and the words naming them."""
    batches, split = split_to_declared(list(evaluation), declared_batch(graph))
    return batches, f"the evaluation batches ({split})" if split else "the evaluation batches"


def _export_onnx(
    model, path, opts: ExportOptions, calibration, evaluation, check: bool = True
) -> ExportArtifact:
    """An FP32 ONNX graph re-typed (see ``_onnx_in``); ``check`` False: an INT8 file is
    not checked on ``evaluation`` (its target may read them)."""
    from fp16lens.export._onnx_in import prepare

    if opts.dynamic:
        raise ExportError(
            "dynamic= applies to a PyTorch model; an ONNX file keeps the axes it was exported with"
        )
    if opts.opset is not None or opts.exporter != "auto":
        raise ExportError(
            "opset and exporter apply to a PyTorch model; an ONNX source keeps its own opset "
            "(re-export the PyTorch model to change it)"
        )
    path = _check_writable(Path(path))
    calibration = _check_calibration(opts, calibration)
    given = opts
    proto, origins, islands = prepare(model, opts.fp32_nodes, opts.fp32_modules or None)
    recorded = sorted({origins[n].module for n in islands})  # a node is its own module
    opts = replace(opts, fp32_modules=tuple(recorded))
    job = _Job(opts, ONNX_EXPORTER, [], calibration, (), evaluation, source=model)
    artifact = _typed(proto, path, job, islands)
    del proto, job  # written: the check reads the file, and a large graph's weights go first
    if opts.precision == "int8" and not check:
        return artifact
    if opts.precision == "int8":
        first = _checked_int8(
            model, evaluation, artifact, _goal(opts, model, evaluation, calibration, stored=True)
        )
        return _patched_int8(model, model, path, given, calibration, evaluation, first)
    if opts.precision != "fp16":
        return artifact
    if not evaluation:
        return _checked_in_fp16(model, None, artifact)
    batches, what = _as_declared(evaluation, model)
    return _checked_in_fp16(model, batches, artifact, what)


def _patched_int8(source, reference, path: Path, opts, calibration, evaluation, first):
    """``first`` (the checked INT8 file of the FP32 ONNX graph ``source``), or where it
    fails with its float parts in FP16, the INT8 file of ``source`` patched for FP16
    (``_int8_fp16_fix``) where that one holds against ``reference`` (the user's ONNX
    source or PyTorch model) both ways. ``opts``: the export's options as given."""
    from fp16lens.export._int8_fp16_fix import patched_first

    def again(src: str, dst: Path) -> ExportArtifact:
        cache = dst.with_suffix(".cache") if opts.calibration_cache else None
        moved = replace(opts, calibration_cache=cache, opset=None, exporter="auto", dynamic=())
        return _export_onnx(src, dst, moved, calibration, evaluation, check=False)

    goal, stored = (_goal(opts, source, evaluation, calibration, k) for k in (False, True))

    def checked(art: ExportArtifact) -> ExportArtifact:
        return _checked_int8(reference, evaluation, art, stored)

    art = patched_first(source, path, list(calibration), evaluation, first, again, checked)
    if opts.float_parts != "fp16":
        return art
    return _typed_float_parts(reference, evaluation or calibration, art, opts, goal)


def _as_good(typed, first) -> bool:
    """Whether the typed file's check holds: it passes, or the first file (FP32 float
    parts, checked on the same evaluation batches) failed too and FP16 adds at most a tenth
    to INT8's own error (``1 - cosine``), finite where it is: the failure is INT8's, which
    the first file's warning already says."""
    if typed.passed:
        return True
    if first is None or first.passed or typed.nonfinite or typed.cosine is None:
        return False
    return first.cosine is not None and 1 - typed.cosine <= 1.1 * (1 - first.cosine)


def _typed_float_parts(
    reference, batches, art: ExportArtifact, opts, goal: _Goal | None = None
) -> ExportArtifact:
    """The INT8 file ``art`` with its float parts typed FP16 (``_int8_typed``), written over
    it where verify's ``onnx-int8`` check (its FP16 storage made real) passes on
    ``batches`` (the evaluation batches, else the calibration batches) against
    ``reference`` (or fails no worse than the first file did: ``_as_good``), and the
    ``goal`` (the target given) holds on it too; else an ExportError, the FP32 float parts
    left in place."""
    import os

    from fp16lens.export._int8_typed import typed_fp16

    onnx = import_optional("onnx", "onnx", "ONNX export")
    typed, notes = typed_fp16(onnx.load(str(art.path)), opts.io_dtype)
    _finish(typed, {}, None)
    trial = art.path.with_name(art.path.stem + ".fp16-parts" + art.path.suffix)
    _save(typed, trial)
    del typed
    at = replace(art, path=trial)
    graph = art.path if isinstance(reference, torch.nn.Module) else reference
    checked, what = _as_declared(batches, graph)
    result, failed = _run_check(reference, checked, at, "onnx-int8")
    good = result is not None and _as_good(result, art.parity)
    score = goal.score(trial) if good and goal is not None else None
    first = goal.score(art.path) if score is not None and goal is not None else None
    if not good or (score is not None and goal is not None and score < goal.target.threshold):
        trial.unlink(missing_ok=True)
        for extra in trial.parent.glob(trial.name + ".data"):
            extra.unlink()
        if score is not None and goal is not None:
            why = f"it misses its target: {goal.scored(score, first)}"
        else:
            why = failed if result is None else _why(result)
        if (
            not good
            and result is not None
            and art.parity is not None
            and art.parity.cosine is not None
        ):
            why += f" (with its float parts FP32: cosine {art.parity.cosine:.6f})"
        raise ExportError(
            f"float_parts='fp16': the INT8 file with its float parts typed FP16 fails its "
            f"check on {what} (the Q/DQ graph computed as TensorRT runs it, FP16 storage "
            f"made real): {why}; {art.path} keeps them in FP32 (float_parts='fp32', which a "
            "strongly typed TensorRT build computes in FP32)"
        )
    os.replace(trial, art.path)
    data = art.path.parent / (trial.name + ".data")
    if data.exists():  # a large graph's weights beside it
        os.replace(data, art.path.parent / (art.path.name + ".data"))
    written = onnx.load(str(art.path), load_external_data=False)
    data_ = {**(art.int8 or {}), "float_parts": "fp16"}
    if score is not None and goal is not None:  # what the file taken home scores
        said = goal.scored(score, first)
        notes.append(f"with its float parts typed FP16 the file meets its target too: {said}")
        if data_.get("target"):
            data_["target"] = {**data_["target"], "score": score, "score_fp32_parts": first}
    return replace(
        art,
        opset=default_opset(written),
        nodes=records(written.graph),
        warnings=(*art.warnings, *notes),
        parity=result,
        int8=data_,
    )


def _stored_islands_as_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """A loaded program of a patched model (``fp16lens.patch.portable``) stores its islands'
    tensors as int32 bits, read through a dtype view no ONNX exporter takes: a copy with
    those views replaced by FP32 tensors; any other model as it is."""
    stored = any(n.endswith("in_bits") and b.dtype == torch.int32 for n, b in model.named_buffers())
    if not stored:
        return model
    from fp16lens.patch import rehydrate

    copy_ = copy.deepcopy(model)
    rehydrate(copy_)
    return copy_


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ExportError(
            f"export needs a torch.nn.Module, got {type(model).__name__}; pass the model "
            "object itself (to re-type an exported file, use fp16lens.export.retype)"
        )
    why = missing_weights(model)
    if why is not None:
        raise ExportError(f"export cannot trace this model: {why}")
    why = half_model(model)
    if why is not None:  # the FP16 file is checked against the FP32 model's outputs
        raise ExportError(f"export writes FP16 from the FP32 model: {why}")


def _check_writable(path: Path) -> Path:
    """Fail before the (slow) export when ``path`` cannot be written (a probe file, not
    permission bits: root passes those on /proc or a read-only mount)."""
    return check_writable(path, error=ExportError)


def retype(
    src: str | Path,
    dst: str | Path,
    precision: str | None = None,
    *,
    options: ExportOptions | None = None,
    calibration: Iterable | None = None,
    evaluation: Iterable | None = None,
    fp32_modules: Iterable[str] | None = None,
    io_dtype: str | None = None,
    calibration_cache: str | Path | None = None,
    target: float | Int8Target | None = None,
    max_fallback: float | None = None,
    float_parts: str | None = None,
) -> ExportArtifact:
    """Make an FP32 file written by ``export`` FP16 or INT8 without exporting again
    (the node <-> module map is stored in the file). Options as for ``export``."""
    opts = one_form(
        ExportOptions,
        options,
        given(
            precision=precision,
            fp32_modules=fp32_modules,
            io_dtype=io_dtype,
            calibration_cache=calibration_cache,
            target=target,
            max_fallback=max_fallback,
            float_parts=float_parts,
        ),
    )
    if opts.fp32_nodes is not None or opts.opset is not None or opts.dynamic:
        raise ExportError(
            "retype keeps the file's graph: fp32_nodes, opset and dynamic apply to export"
        )
    onnx = import_optional("onnx", "onnx", "converting an exported model")
    proto = onnx.load(str(src))
    meta = {p.key: p.value for p in proto.metadata_props}
    if meta.get(PRECISION_KEY) != "fp32":
        raise ExportError(
            f"{src} is not an FP32 file written by fp16lens export (precision "
            f"{meta.get(PRECISION_KEY)!r}); export the model with precision='fp32' first"
        )
    _check_islands_present(proto.graph, opts.fp32_modules, src)
    calibration = _check_calibration(opts, calibration)
    job = _Job(opts, meta.get(EXPORTER_KEY, "unknown"), [], calibration, (), evaluation)
    artifact = _typed(proto, Path(dst), job)
    if opts.precision == "int8":
        first = _checked_int8(
            str(src), evaluation, artifact, _goal(opts, str(src), evaluation, calibration, True)
        )
        return _patched_int8(str(src), str(src), Path(dst), opts, calibration, evaluation, first)
    if opts.precision != "fp16":
        return artifact
    return _checked_in_fp16(str(src), list(evaluation) if evaluation else None, artifact)


@dataclass(frozen=True)
class _Job:
    options: ExportOptions  # fp32_modules: the islands, resolved
    exporter: str
    notes: list[str]
    calibration: Iterable | None
    fp32_out: tuple[str, ...] = ()  # islands whose outputs stay FP32 (a graph output too)
    evaluation: Iterable | None = None  # INT8: the batches the target is checked on
    source: Any = None  # the ONNX graph exported from (a path or ModelProto); None: PyTorch


def _check_calibration(opts: ExportOptions, calibration) -> list | tuple | None:
    """``calibration`` as a list (an INT8 file may be made twice from it: ``_int8_fp16_fix``),
    where the options take it."""
    if opts.precision == "int8" and calibration is None:
        raise ExportError("precision='int8' needs calibration=<iterable of input batches>")
    if opts.target is not None and opts.precision != "int8":
        raise ExportError(
            f"target= is the INT8 parity target; precision {opts.precision!r} takes none"
        )
    if opts.max_fallback is not None and opts.target is None:
        raise ExportError(
            "max_fallback= is the share of the FLOPs an INT8 target's fallback may keep out "
            "of INT8; give target= too (e.g. target=0.999)"
        )
    if calibration is None or isinstance(calibration, (list, tuple)):
        return calibration
    return list(calibration)


def _check_islands_present(graph, islands: tuple[str, ...], src) -> None:
    origins = map_nodes(graph, set(), [])
    for island in islands:
        if not any(in_islands(o.modules, (island,)) for o in origins):
            raise ExportError(f"fp32_modules names {island!r}, which no node of {src} comes from")


def _typed(proto, path: Path, job: _Job, island_nodes: set[str] | None = None) -> ExportArtifact:
    """Convert the mapped FP32 ``proto`` to the job's precision, then check and save it.
    The FP32 islands are ``island_nodes``, else the nodes of the job's ``fp32_modules``."""
    from fp16lens.export._fp16 import convert_fp16

    options, warnings = job.options, list(job.notes)
    origins = map_nodes(proto.graph, set(), [])
    islands = options.fp32_modules
    if island_nodes is None:
        island_nodes = {
            n.name for n, o in zip(proto.graph.node, origins) if in_islands(o.modules, islands)
        }
    fp32_nodes: list[str] = []
    cache, int8_plan = None, None
    if options.precision == "fp16":
        by_name = {n.name: o for n, o in zip(proto.graph.node, origins)}
        keep = {
            n.name for n, o in zip(proto.graph.node, origins) if in_islands(o.modules, job.fp32_out)
        }
        result = convert_fp16(proto, island_nodes, by_name, options.io_dtype, keep & island_nodes)
        fp32_nodes, warnings = result.fp32_nodes, warnings + result.warnings
    elif options.precision == "int8":
        from fp16lens.export._int8 import quantize_int8

        assert job.calibration is not None  # _check_calibration: INT8 needs calibration

        proto, cache, int8_notes, int8_plan = quantize_int8(
            proto,
            job.calibration,
            sorted(island_nodes),
            path,
            options.calibration_cache,
            target=options.target,
            evaluation=job.evaluation,
            max_fallback=options.max_fallback,
            exported=job.source is None,
            fp16_parts=options.float_parts == "fp16",
        )
        warnings += int8_notes
    for node, origin in zip(proto.graph.node, map_nodes(proto.graph, set(), [])):
        stamp(node, origin)  # Casts and Q/DQ nodes take their neighbours' modules
    meta = {PRECISION_KEY: options.precision, EXPORTER_KEY: job.exporter}
    _finish(proto, {**meta, ISLANDS_KEY: ",".join(islands)}, job.source)
    _save(proto, path)
    return ExportArtifact(
        path=path,
        precision=options.precision,
        exporter=job.exporter,
        opset=default_opset(proto),
        nodes=records(proto.graph),
        fp32_nodes=tuple(fp32_nodes),
        warnings=tuple(warnings),
        calibration_cache=cache,
        int8=int8_plan,
    )


def _export_fp32(model: torch.nn.Module, args: tuple, options: ExportOptions):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            spec = io_spec(model, args, options.dynamic)
            io = spec.kwargs()
            proto, used, notes = export_fp32(model, args, options.exporter, options.opset, io)
            failed = dynamic_failure(proto, model, args, spec) if spec.dynamic_axes else None
    finally:
        model.train(was_training)
    if failed:
        why = "; ".join(n for n in notes if "failed" in n) or f"the {used} exporter"
        raise ExportError(
            f"the exported graph does not take other {' and '.join(options.dynamic)} sizes "
            f"({failed}): {why} fixed them at the example's; export with fixed shapes (leave "
            "out dynamic=) or make the model exportable by torch.export with dynamic shapes"
        )
    _name_nodes(proto.graph)
    return proto, used, notes


def _name_nodes(graph) -> None:
    """Every node gets a unique, non-empty name (the maps are keyed by it)."""
    seen: set[str] = set()
    for i, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        node.name = name
        seen.add(name)


def _finish(proto, meta: dict[str, str], source=None) -> None:
    """IR version ONNX Runtime reads (<= 13; metadata on nodes needs >= 10), provenance,
    check (as strict as the ONNX ``source`` passes: ``check_graph``)."""
    onnx = import_optional("onnx", "onnx", "ONNX export")
    proto.ir_version = max(
        10, onnx.helper.find_min_ir_version_for(list(proto.opset_import), ignore_unknown=True)
    )
    _set_meta(proto, meta)
    check_graph(onnx, proto, source)


def _set_meta(proto, meta: dict[str, str]) -> None:
    """Each ``key: value`` of ``meta`` in ``proto``'s metadata, replacing one there."""
    for key, value in meta.items():
        entry = (
            next((p for p in proto.metadata_props if p.key == key), None)
            or proto.metadata_props.add()
        )
        entry.key, entry.value = key, value


def _save(proto, path: Path) -> None:
    onnx = import_optional("onnx", "onnx", "ONNX export")
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx_large.save(onnx, proto, path)
