"""plan(), patch() and get_plan(): preconditions, the rewrite, and a check after it."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import warnings

from torch import fx, nn

from fp16lens._core import PatchError, StaleReportError
from fp16lens._core.algebra import eps_name
from fp16lens._core.fingerprint import changed
from fp16lens._core.model_dtype import half_model
from fp16lens._core.onnx_types import is_onnx
from fp16lens._core.options import one_form
from fp16lens._core.sites import PLAN_ATTR, FindingKind
from fp16lens.patch._apply import apply_plan
from fp16lens.patch._check import NOT_CHECKED, check_equivalent
from fp16lens.patch._island import Fp32Island
from fp16lens.patch._options import PatchOptions
from fp16lens.patch._plan import (
    INPUT_CAUSE,
    PRECISION_NOTE,
    PROOF_SITE,
    BatchProof,
    Plan,
    Unresolved,
)
from fp16lens.patch._planner import build_plan
from fp16lens.patch._prove import (
    admitting,
    as_batches,
    flush_widening,
    input_range_reason,
    input_rounding_cosine,
    next_widening,
    passes,
    prove_batches,
    rounding_reason,
    shape_jitter,
    shape_reason,
    spans_for_sites,
    standing,
    statistics_problems,
    worst_first,
)
from fp16lens.patch._save import state_dict_note
from fp16lens.patch._warn import PatchWarning
from fp16lens.patch._widen import apply_widened, span_hosts, widen
from fp16lens.report import Report


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
    if is_onnx(model):
        from fp16lens.patch.onnx import plan_onnx

        return plan_onnx(model, report, opts)
    _require(model, report)
    return _build(model, report, opts)


def patch(
    model: nn.Module,
    report: Report,
    inplace: bool = False,
    factor: float | None = None,
    *,
    options: PatchOptions | None = None,
    out=None,
    batches=None,
    **option_fields,
) -> nn.Module:
    """Rescale ``model`` so FP16 holds its values: exact power-of-two rescaling of every
    span, FP32 islands only where no rescaling applies. Returns a new module (a deep copy)
    unless ``inplace``; the plan travels with it as ``_fp16lens_plan`` (see get_plan).

    ``batches`` (an iterable of inputs as scan takes them: each a tensor, a tuple of
    positional inputs or a dict of keywords) proves the result: the patched model runs in
    real FP16 on them (FP16 storage of every stored tensor on the CPU, ``.half()`` on a
    GPU) and in FP32 against the original; where FP16 still fails, patch widens the fix
    (finally keeping the failing span FP32 end to end) and checks again. The plan records
    what the proof found (``plan.proof``, ``plan.proven``). Without batches the FP32 check
    runs on inputs like the report's recorded ones and a PatchWarning says that the FP16
    check did not run. Anything left unresolved gives a PatchWarning naming each site and
    the way out; ``strict=True`` raises PatchError instead.

    ``model`` may be an ONNX file or an ``onnx.ModelProto`` scanned with fp16lens.scan: the
    result is a new ``onnx.ModelProto`` (written to ``out`` when given), its FP32 islands
    named in its ``metadata_props`` (``fp16lens.fp32_nodes``)."""
    opts = _options(options, factor, option_fields)
    batches = as_batches(batches) if batches is not None else None
    if is_onnx(model):
        from fp16lens.patch.onnx import patch_onnx

        if inplace:
            raise PatchError(
                "an ONNX model is never patched in place: use the returned ModelProto or out="
            )
        proto, the_plan = patch_onnx(model, report, opts, out=out, batches=batches)
        finish(the_plan, opts, "nodes")
        return proto
    if out is not None:
        raise PatchError(
            "out= writes a patched ONNX model; save a patched PyTorch module with "
            "fp16lens.patch.save(patched, inputs, 'patched.pt2'), whose file keeps its FP32 "
            "islands under .half(), or `fp16lens patch MODEL -o patched.pt2`"
        )
    _require(model, report)
    patched, the_plan = _proven(model, report, opts, batches)
    if inplace and not isinstance(model, fx.GraphModule) and the_plan.rewrites_root:
        raise PatchError(
            "the fix rewrites the model's own forward (a multiply on an operand, or an activation "
            "made an FP32 island), which turns the model "
            "into a torch.fx GraphModule: call patch(..., inplace=False) and use the result"
        )
    if inplace and any("" in w.modules for w in the_plan.widened):
        raise PatchError(
            "the proof keeps the whole model in FP32 (real FP16 failed otherwise), which wraps "
            "it in an island: call patch(..., inplace=False) and use the result"
        )
    previous = get_plan(model)
    if previous is not None:
        the_plan.kept = [*previous.kept, *previous.islands]
    if inplace:  # the copy passed its check: the same rewrite on the model cannot fail
        patched = apply_widened(apply_plan(model, the_plan), the_plan)
    note = state_dict_note(
        len(the_plan.fp32_modules), len(the_plan.multiplies), _eps_changed(patched, the_plan)
    )
    if note:
        the_plan.notes.append(note)
    object.__setattr__(patched, PLAN_ATTR, the_plan)
    finish(the_plan, opts)
    return patched


def _eps_changed(patched: nn.Module, the_plan: Plan) -> dict[str, float]:
    """Norms (and batch norms whose statistics were scaled) the plan gave eps / p^2: module
    -> the new eps, which a state_dict does not hold."""
    changed = {}
    for r in the_plan.reparametrized:
        if r.rule not in ("norm", "bn-scale") or r.s_in == 1:
            continue
        try:
            mod = patched.get_submodule(r.module)
        except AttributeError:
            continue
        mod = getattr(mod, "module", mod) if isinstance(mod, Fp32Island) else mod
        if (key := eps_name(mod)) is not None:
            changed[r.module] = getattr(mod, key)
    return changed


def _build(model: nn.Module, report: Report, opts: PatchOptions) -> Plan:
    """The planner's plan with the options' spans and modules kept FP32 (``_widen``)."""
    return widen(build_plan(model, report, opts), model, report, opts.fp32_spans, opts.fp32_modules)


def _proven(model: nn.Module, report: Report, opts: PatchOptions, batches: list | None):
    """The plan applied to a copy and checked: in FP32 against the original, and with
    ``batches`` in real FP16, widened until it passes or nothing is left to widen."""
    stats_round, unwidened, first, best, worse = False, None, None, None, ""
    for _ in range(max(1, opts.max_rounds) + 1):
        the_plan, patched, report = _apply_checked(model, report, opts, batches)
        if batches is None and unwidened is not None and _half_breaks(patched, report):
            opts, unwidened = unwidened, None  # the widening would break .half(): not taken
            the_plan, patched, report = _apply_checked(model, report, opts, batches)
        if batches is None:
            wider = _statistics_widening(model, report, opts, the_plan)
            if (
                wider is not None and not stats_round
            ):  # the statistics alone show a failing island: widen once
                stats_round, unwidened, opts = True, opts, wider
                continue
            _statistics_unresolved(the_plan, report)
            if the_plan.changes:
                the_plan.notes.append(
                    "the FP16 check did not run (no batches): the patched model was not run in real "
                    "FP16; pass batches= (fp16lens.patch(model, report, batches=[x])) to prove it"
                )
            return patched, the_plan
        proof = prove_batches(model, patched, batches, opts, the_plan.input_scales)
        the_plan.proof, the_plan.fp16_checked = proof, True
        failed = [b for b in proof if not passes(b, opts)]  # batch order: what widens next
        first = failed if first is None else first
        if not failed:
            _precision_note(the_plan, first, opts)
            return patched, the_plan
        if best is None or standing(proof) <= best[0]:  # ties: the wider, as before
            best = (standing(proof), patched, the_plan, opts, failed)
        worst = min(failed, key=worst_first)
        nxt = None
        if all(b.finite for b in failed):  # off, not broken: what FP16 flushes, kept FP32
            nxt = flush_widening(
                patched, batches[failed[0].batch], opts, model, the_plan.input_scales
            )
        nxt = nxt or next_widening(report, patched, failed, opts, model)
        if nxt is None or _ == opts.max_rounds:
            break
        opts = nxt
    if best is not None and best[1] is not patched:  # wider read worse: the better kept
        _, patched, kept, opts, failed = best
        worse = (
            f"keeping more in FP32 ({_widened(the_plan)}) reads worse in real FP16 "
            f"({worst.failure()} on batch {worst.batch})"
        )
        kept.notes.append(f"{worse}: the narrower patch is returned")
        the_plan, worst = kept, min(failed, key=worst_first)
    _precision_note(the_plan, first, opts)
    assert batches is not None  # the proof ran on them (without, the loop returned)
    # finite, short of the tolerance: is it the input's own rounding?
    rounding = worst.finite and rounding_reason(
        input_rounding_cosine(model, batches[worst.batch]), opts.min_cosine, worst.cosine
    )
    beyond = None if rounding else input_range_reason(batches[worst.batch])
    jittered = shape_jitter(model, batches[worst.batch]) if worst.shape else 0
    why = (
        shape_reason(worst, jittered)
        or rounding
        or beyond
        or "the model is not FP16-safe anywhere; run it in FP32"
    )
    the_plan.unresolved.append(
        Unresolved(
            PROOF_SITE,
            (
                f"real FP16 still fails on batch {worst.batch} after keeping "
                f"{_widened(the_plan)} in FP32 "
                f"({worst.failure()}{'; ' + worse if worse else ''}): "
                f"{why}"
            ),
            INPUT_CAUSE if beyond else "",
        )
    )
    return patched, the_plan


def _widened(the_plan: Plan) -> str:
    """The modules the proof's widening kept FP32, in words ("nothing" when none)."""
    kept = dict.fromkeys(m or "the model" for w in the_plan.widened for m in w.modules)
    return ", ".join(kept) or "nothing"


def _precision_note(the_plan: Plan, first: list[BatchProof] | None, opts: PatchOptions) -> None:
    """When the whole model ended FP32 although the first plan's real FP16 was finite on
    every batch, only short of the tolerance: say that it is precision, not range."""
    if not first or not all(b.finite and not b.shape for b in first):
        return
    if not any("" in w.modules for w in the_plan.widened):
        return
    worst = min(first, key=lambda b: b.cosine)
    rel = max(b.max_rel for b in first)
    keep = []
    if worst.cosine < opts.min_cosine:
        keep.append(f"min_cosine={admitting(worst.cosine)}")
    if opts.max_rel is not None and rel > opts.max_rel:
        keep.append(f"max_rel={math.ceil(rel * 1e3) / 1e3}")
    tolerance = f"min_cosine {opts.min_cosine}" + (
        f", max_rel {opts.max_rel}" if opts.max_rel is not None else ""
    )
    the_plan.notes.append(
        f"{PRECISION_NOTE} (worst cosine {worst.cosine:.6f}, largest relative error {rel:.3g}; "
        f"asked: {tolerance}): FP16 keeps 11 significant bits at any scale, which rescaling "
        f"does not change; patch(..., {', '.join(keep)}) keeps the rescaled FP16 model, "
        "proven to that tolerance"
    )


def without_batches(model: nn.Module, report: Report, opts: PatchOptions) -> Plan:
    """The plan patch() applies without batches, found without applying it: the planner's
    plan, widened once where the report's statistics show an island handing back values
    beyond FP16, with the unresolved entries patch adds (``advise`` stores it in the report)."""
    the_plan = _build(model, report, opts)
    wider = _statistics_widening(model, report, opts, the_plan)
    if wider is not None:
        the_plan = _build(model, report, wider)
    _statistics_unresolved(the_plan, report)
    return the_plan


def _statistics_widening(
    model: nn.Module, report: Report, opts: PatchOptions, the_plan: Plan
) -> PatchOptions | None:
    """The options keeping FP32 end to end the spans whose island the report's statistics
    show handing back values beyond FP16 (never the whole model); None when there are none."""
    problems = statistics_problems(the_plan, report)
    new = [
        i
        for i in spans_for_sites(report, [s for s, _ in problems])
        if i not in opts.fp32_spans and "" not in span_hosts(report, i, model)[0]
    ]
    return dataclasses.replace(opts, fp32_spans=(*opts.fp32_spans, *new)) if new else None


def _statistics_unresolved(the_plan: Plan, report: Report) -> None:
    for site, value in statistics_problems(the_plan, report):
        if not any(_covers(w.modules, site, report) for w in the_plan.widened):
            the_plan.unresolved.append(
                Unresolved(
                    site,
                    (
                        f"its FP32 island hands back {value:.3g} (the report's range), beyond FP16: "
                        "the island must reach where values are back in range; pass batches= to "
                        "prove and widen the fix"
                    ),
                )
            )


def _half_breaks(patched: nn.Module, report: Report) -> bool:
    """Whether ``patched.half()`` fails on inputs like the recorded ones (on ``meta``)."""
    from fp16lens.patch._check import report_batch
    from fp16lens.patch._prove import _half_fails

    x = report_batch(report)
    if x is None:
        return False
    args, kwargs = ((), x) if isinstance(x, dict) else (x, {})
    return bool(_half_fails(patched, args, kwargs))


def _covers(modules, site: str, report: Report) -> bool:
    from fp16lens.patch._widen import host

    h = host(report, site)
    return any(m == "" or h == m or h.startswith(m + ".") for m in modules)


def _apply_checked(model: nn.Module, report: Report, opts: PatchOptions, batches):
    """The plan applied to a copy, checked for FP32 equivalence (PatchError if it differs).
    Returns the plan, the patched copy and the report it was planned from."""
    try:
        the_plan = _build(model, report, opts)
        return the_plan, _apply_one(model, report, the_plan, opts, batches), report
    except PatchError:
        if not _powers(report):
            raise
    # a report names an op, not its exponent: x ** 3 taken as the square fails the check;
    # plan again with every pow opaque (the rest of the plan is unchanged)
    report = _pow_opaque(report)
    the_plan = _build(model, report, opts)
    return the_plan, _apply_one(model, report, the_plan, opts, batches), report


def _apply_one(
    model: nn.Module, report: Report, the_plan: Plan, opts: PatchOptions, batches
) -> nn.Module:
    patched = apply_widened(apply_plan(copy.deepcopy(model), the_plan), the_plan)
    if opts.check and the_plan.changes:
        notes = check_equivalent(model, patched, report, batches, the_plan.input_scales)
        the_plan.notes.extend(notes)
        the_plan.fp32_checked = not notes
    return patched


def finish(the_plan: Plan, opts: PatchOptions, unit: str = "modules") -> None:
    """Never silent: what is unresolved, or was not checked, becomes a PatchWarning (with
    ``strict``, unresolved problems raise PatchError). ``unit``: what the user keeps FP32,
    the modules of a PyTorch model or the nodes of an ONNX graph (``fp32_<unit>``)."""
    if the_plan.unresolved:
        lines = [f"  {u.site}: {u.reason}" for u in the_plan.unresolved]
        where = (
            "yet real FP16 of the patched model passed on every batch given (worst cosine "
            f"{min(b.cosine for b in the_plan.proof):.6f}), so on those batches they did no "
            "harm; inputs unlike them may differ (fp16lens.verify checks them)"
            if the_plan.proven
            else "the patched model is not FP16-safe there"
        )
        msg = (
            f"patch left {len(the_plan.unresolved)} problem(s) unresolved; {where}:\n"
            + "\n".join(lines)
            + f"\nKeep those {unit} in FP32 (export(..., fp32_{unit}=[...])) or follow each "
            "reason; patch(..., strict=True) raises instead of warning"
        )
        if opts.strict:
            raise PatchError(msg)
        warnings.warn(PatchWarning(msg), stacklevel=3)
    if any("" in w.modules for w in the_plan.widened):
        precision = [n for n in the_plan.notes if n.startswith(PRECISION_NOTE)]
        beyond = any(u.cause == INPUT_CAUSE for u in the_plan.unresolved)
        why = (
            precision[0]
            if precision
            else "an input is out of FP16 range (see the unresolved reason)"
            if beyond
            else "move the failing ops into their own nn.Modules so that patch can keep only "
            "them FP32, then scan and patch again"
        )
        warnings.warn(
            PatchWarning(
                "real FP16 failed until the whole model was kept FP32 (plan.widened): the patched model "
                f"runs no FP16 arithmetic; {why}"
            ),
            stacklevel=3,
        )
    unchecked = [
        n
        for n in the_plan.notes
        if n.startswith(NOT_CHECKED) or n.startswith("the FP16 check did not run")
    ]
    if unchecked:
        warnings.warn(PatchWarning("; ".join(unchecked)), stacklevel=3)


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
    if factor is not None:
        fields = {**fields, "factor": factor}
    return one_form(PatchOptions, options, fields, PatchError)


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
    why = half_model(model)
    if why is not None:
        raise PatchError(f"patch rescales a model in FP32: {why}")
    inside = [f.site for f in report.findings if f.kind == FindingKind.FP16_INSIDE]
    if inside:
        raise PatchError(
            f"the report was watched while the forward computed in float16 (from {inside[0]}: "
            "torch.autocast or a .half() inside forward), so its values are FP16's own and no "
            "rescaling can be read from them; watch the forward with FP32 there (take autocast "
            "out while watching) and patch with that report"
        )
    training = [
        n or "the model itself" for n, m in model.named_modules() if m.training and _has_modes(m)
    ]
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
    module with no forward of its own (torch.export keeps those to hold parameters), nor
    for one whose class never reads ``training`` (a cache a forward builds after .eval(),
    torchfcpe's window holder)."""
    own_forward = type(module).forward is not nn.Module.forward
    return (
        own_forward
        and not isinstance(module, fx.GraphModule)
        and type(module).__name__ != "GuardsFn"
        and _reads_training(type(module))
    )


_READS_TRAINING: dict[type, bool] = {}


def _reads_training(cls: type) -> bool:
    """Whether the code of ``cls`` or of a base below nn.Module mentions ``training`` (its
    forward or a helper reads the mode: batch norms, dropout, RNNs, attention); True
    where the source cannot be read."""
    if cls not in _READS_TRAINING:
        _READS_TRAINING[cls] = any(_mentions_training(k) for k in cls.__mro__)
    return _READS_TRAINING[cls]


def _mentions_training(klass: type) -> bool:
    if klass is nn.Module or not issubclass(klass, nn.Module):
        return False
    try:
        return "training" in inspect.getsource(klass)
    except (OSError, TypeError):  # no source (built at run time, compiled): assume it does
        return True
