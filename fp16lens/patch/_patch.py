"""plan(), patch() and get_plan(): preconditions, the rewrite, and a check after it."""

from __future__ import annotations

import copy

from torch import fx, nn

from fp16lens._core import PatchError, StaleReportError
from fp16lens._core.fingerprint import changed
from fp16lens._core.sites import PLAN_ATTR
from fp16lens.patch._apply import apply_plan
from fp16lens.patch._check import check_equivalent
from fp16lens.patch._options import PatchOptions
from fp16lens.patch._plan import Plan
from fp16lens.patch._planner import build_plan
from fp16lens.report import Report
from fp16lens.watch.onnx import is_onnx_model


def plan(
    model: nn.Module,
    report: Report,
    factor: float | None = None,
    *,
    options: PatchOptions | None = None,
    **option_fields,
) -> Plan:
    """What patch() would do to ``model`` for ``report``: regions with their factors,
    re-parametrized modules, FP32 islands. Nothing is changed. ``model`` may be an ONNX
    file or an ``onnx.ModelProto`` (its sites are node names)."""
    opts = _options(options, factor, option_fields)
    if is_onnx_model(model):
        from fp16lens.patch.onnx import plan_onnx

        return plan_onnx(model, report, opts)
    _require(model, report)
    return build_plan(model, report, opts)


def patch(
    model: nn.Module,
    report: Report,
    inplace: bool = False,
    factor: float | None = None,
    *,
    options: PatchOptions | None = None,
    out=None,
    **option_fields,
) -> nn.Module:
    """Rescale ``model`` so FP16 holds its values: exact power-of-two rescaling of every
    span, FP32 islands only where no rescaling applies. Returns a new module (a deep copy)
    unless ``inplace``; the plan travels with it as ``_fp16lens_plan`` (see get_plan).

    ``model`` may be an ONNX file or an ``onnx.ModelProto`` scanned with fp16lens.scan: the
    result is a new ``onnx.ModelProto`` (written to ``out`` when given), its FP32 islands
    named in its ``metadata_props`` (``fp16lens.patch.onnx.fp32_nodes``)."""
    opts = _options(options, factor, option_fields)
    if is_onnx_model(model):
        from fp16lens.patch.onnx import patch_onnx

        if inplace:
            raise PatchError("an ONNX model is never patched in place: use the returned ModelProto or out=")
        return patch_onnx(model, report, opts, out=out)[0]
    if out is not None:
        raise PatchError(
            "out= writes a patched ONNX model; save a patched PyTorch module with "
            "torch.save / torch.export, or `fp16lens patch MODEL -o patched.pt2`"
        )
    _require(model, report)
    the_plan = build_plan(model, report, opts)
    if inplace and not isinstance(model, fx.GraphModule) and the_plan.rewrites_root:
        raise PatchError(
            "the fix rewrites the model's own forward (a multiply on an operand, or an activation "
            "made an FP32 island), which turns the model "
            "into a torch.fx GraphModule: call patch(..., inplace=False) and use the result"
        )
    try:
        patched = _apply_checked(model, report, the_plan, opts)
    except PatchError:
        if not _powers(report):
            raise
        # a report names an op, not its exponent: x ** 3 taken as the square fails the check;
        # plan again with every pow opaque (the rest of the plan is unchanged)
        report = _pow_opaque(report)
        the_plan = build_plan(model, report, opts)
        patched = _apply_checked(model, report, the_plan, opts)
    previous = get_plan(model)
    if previous is not None:
        the_plan.kept = [*previous.kept, *previous.islands]
    if inplace:  # the copy passed its check: the same rewrite on the model cannot fail
        patched = apply_plan(model, the_plan)
    object.__setattr__(patched, PLAN_ATTR, the_plan)
    return patched


def _apply_checked(model: nn.Module, report: Report, the_plan: Plan, opts: PatchOptions) -> nn.Module:
    """The plan applied to a copy, checked for FP32 equivalence (PatchError if it differs)."""
    patched = apply_plan(copy.deepcopy(model), the_plan)
    if opts.check and the_plan.changes:
        the_plan.notes.extend(check_equivalent(model, patched, report, the_plan.input_scales))
    return patched


def _powers(report: Report) -> list[str]:
    """Functional ``pow`` sites: their exponent is taken as 2 by the planner."""
    return [n for n, st in report.sites.items() if st.kind != "module" and st.op == "pow"]


def _pow_opaque(report: Report) -> Report:
    """A copy of ``report`` whose ``pow`` sites no rescaling passes (exponent unknown)."""
    out = copy.deepcopy(report)
    for name in _powers(out):
        out.sites[name].op = "pow (exponent unknown)"
    return out


def get_plan(model: nn.Module) -> Plan | None:
    """The plan patch() applied to ``model``, or None for a model patch() did not return."""
    found = getattr(model, PLAN_ATTR, None)
    return found if isinstance(found, Plan) else None


def _options(options: PatchOptions | None, factor, fields: dict) -> PatchOptions:
    if options is not None:
        if factor is not None or fields:
            raise PatchError("pass either options=PatchOptions(...) or keyword options, not both")
        return options
    try:
        return PatchOptions(factor=factor, **fields)
    except TypeError as exc:
        raise PatchError(f"{exc}; the options are those of fp16lens.patch.PatchOptions") from None


def _require(model: nn.Module, report: Report) -> None:
    if not isinstance(model, nn.Module):
        raise PatchError(
            f"patch needs a torch.nn.Module, got {type(model).__name__}; pass the model "
            "object itself (not its state_dict, a path or a tensor)"
        )
    if not isinstance(report, Report):
        raise PatchError(
            f"patch needs a fp16lens Report, got {type(report).__name__}; create one with "
            "fp16lens.watch(model) or load one with fp16lens.Report.load(path)"
        )
    training = [n or "(the model)" for n, m in model.named_modules() if m.training and _has_modes(m)]
    if training:
        raise PatchError(
            f"the model is in training mode ({training[0]}{' and others' if len(training) > 1 else ''}): "
            "batch-norm statistics would change after the rewrite; call model.eval() first"
        )
    stale = changed(report.meta.weights, model)
    if stale:
        more = f" and {len(stale) - 3} more" if len(stale) > 3 else ""
        raise StaleReportError(
            f"the report was made from other weights than this model's ({', '.join(stale[:3])}"
            f"{more} changed since fp16lens.watch recorded it), so its ranges do not apply: "
            "re-run fp16lens.watch (or `fp16lens scan`) on this model and patch with the new report"
        )


def _has_modes(module: nn.Module) -> bool:
    """Whether train/eval can change what the module computes: not for a GraphModule's
    own graph (fixed when traced; torch.export's modules refuse .eval()), nor for a
    module with no forward of its own (torch.export keeps those to hold parameters)."""
    own_forward = type(module).forward is not nn.Module.forward
    return own_forward and not isinstance(module, fx.GraphModule) and type(module).__name__ != "GuardsFn"
