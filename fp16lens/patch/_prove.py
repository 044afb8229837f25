"""patch proves its result: the patched model in real FP16 on the caller's batches.

On the CPU real FP16 is FP16 storage of every stored tensor (parameters, inputs, each
op's output; FP32 islands as ``.half()`` leaves them: ``patch/_emulate.py``, the same
emulation verify's ``torch-emulated`` backend runs); on a GPU it is ``.half()`` itself.
Each float output must be finite where the original's FP32 output is, and within the
parity tolerance of it (``PatchOptions.min_cosine``, ``max_rel``). Where a batch fails,
``next_widening`` says what to keep in FP32 next (``patch/_widen.py``): the span holding
the first non-finite site end to end, then the module enclosing that span, then the
module running the site; the caller plans again and checks again.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fp16lens._core import FP16_MAX, FP16_MIN_NORMAL, PatchError
from fp16lens._core.flush import REL_STEP, small_as_fp16
from fp16lens._core.sites import is_island
from fp16lens._trace import HalfFails, call_model, float_outputs, fp32_compute_ops
from fp16lens.patch._check import relative_error, scale_batch
from fp16lens.patch._emulate import emulated_copy, run_emulated
from fp16lens.patch._options import PatchOptions
from fp16lens.patch._plan import BatchProof, Plan
from fp16lens.patch._trace import SiteTracer, Trace, traced
from fp16lens.patch._widen import enclosing, host
from fp16lens.report import Report

_HOW = "pass batches=[x], batches=[(x1, x2)], batches=[{'input_ids': ids}] or a DataLoader"


def as_batches(batches: Any) -> list:
    """The batches as a list (each a tensor, a tuple/list of positional inputs or a dict)."""
    if torch.is_tensor(batches):
        raise PatchError(
            f"batches= got a bare tensor (it would be iterated over its first axis); {_HOW}"
        )
    if isinstance(batches, Mapping):
        raise PatchError(f"batches= got a dict: one batch of keyword inputs is batches=[d]; {_HOW}")
    if not isinstance(batches, Iterable) or isinstance(batches, (str, bytes)):
        raise PatchError(
            f"batches= needs an iterable of batches, got {type(batches).__name__}; {_HOW}"
        )
    out = list(batches)
    if not out:
        raise PatchError(f"batches= holds no batch; {_HOW}")
    return out


def _device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _to(batch, dtype=None, device=None):
    def cast(a):
        if not torch.is_tensor(a):
            return a
        a = a.to(device) if device is not None else a
        return a.to(dtype) if dtype is not None and a.is_floating_point() else a

    if isinstance(batch, dict):
        return {k: cast(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return tuple(cast(a) for a in batch)
    return cast(batch)


class Parity(NamedTuple):
    """FP16 outputs against FP32 ones (``Fp16Runner.parity``)."""

    finite: bool
    cosine: float
    max_rel: float
    shape: str = ""  # an output whose shape FP16 changed, else ""


class Fp16Runner:
    """The patched model in real FP16: ``.half()`` on a GPU, FP16 storage emulated on the CPU."""

    def __init__(self, patched: nn.Module):
        self.device = _device(patched)
        self.gpu = self.device.type == "cuda"
        if self.gpu:
            self.model = copy.deepcopy(patched).eval().half()
        else:
            self.model = emulated_copy(patched)
        self.fp32_ops: set[int] | None = None

    def run(self, batch) -> tuple[list[torch.Tensor], str]:
        """The float outputs and the first site whose output is non-finite ("" if none)."""
        trace = Trace(keep=False)
        if self.gpu:
            with torch.no_grad(), traced(self.model, SiteTracer(trace)):
                out = call_model(self.model, _to(batch, torch.float16, self.device))
        else:
            if self.fp32_ops is None:
                x = _to(_to(batch, torch.float16), torch.float32)
                args, kwargs = (
                    ((), x) if isinstance(x, dict) else ((x if isinstance(x, tuple) else (x,)), {})
                )
                try:  # one meta trace: the ops .half() runs in FP32, or why it cannot run
                    found = fp32_compute_ops(self.model, args, kwargs, refuse_mixed=True)
                except HalfFails as exc:
                    return [], exc.words()
                self.fp32_ops = found or set()
            out = run_emulated(self.model, _to(batch, device=self.device), trace, self.fp32_ops)
        return [t.float() for t in float_outputs(out)], trace.first_nonfinite or ""

    @staticmethod
    def parity(want: list[torch.Tensor], got: list[torch.Tensor]) -> Parity:
        """FP16 outputs ``got`` against FP32 outputs ``want``, where FP32 is finite. Outputs
        both below FP16's normal range count as equal (a score of 0 against 6e-8), and the
        cosine reads FP32 below 2^-14 as FP16 holds it. An output whose shape FP16 changed
        (a decoder's loop stopping at another step) has no cosine: -1, and ``shape`` says
        which. The one comparison of patch's proofs (torch and ONNX) and of the verdict's
        check in real FP16."""
        if len(got) != len(want):
            return Parity(False, float("nan"), float("inf"))
        cos, rel, shape = 1.0, 0.0, ""
        for i, (a, b) in enumerate(zip(want, got)):
            a, b = a.detach().float(), b.detach().float().to(a.device)
            if a.shape != b.shape:
                if not bool(torch.isfinite(b).all()) and bool(torch.isfinite(a).all()):
                    return Parity(False, float("nan"), float("inf"))
                shape = shape or (
                    f"output {i} is {tuple(b.shape)} in FP16 against {tuple(a.shape)} in FP32"
                )
                cos, rel = -1.0, float("inf")
                continue
            ok = torch.isfinite(a)
            a, b = a[ok], b[ok]
            if not bool(torch.isfinite(b).all()):
                return Parity(False, float("nan"), float("inf"))
            tiny = float(a.abs().max()) < FP16_MIN_NORMAL and float(b.abs().max()) < FP16_MIN_NORMAL
            if not a.numel() or tiny:
                continue
            cos = min(cos, _cosine(small_as_fp16(a), b))
            rel = max(rel, relative_error(a, b))
        return Parity(True, cos, rel, shape)


def _half_fails(model: nn.Module, args, kwargs) -> str:
    """Why ``model.half()`` cannot run at all ("" when it can, or when the forward cannot
    run on ``meta``): an FP32 tensor meeting FP16 weights. Emulated FP16 computes in FP32
    and would not see it; the ``meta`` trace of a ``.half()`` copy does (no arithmetic)."""
    try:
        fp32_compute_ops(model, args, kwargs, refuse_mixed=True)
    except HalfFails as exc:
        return exc.words()
    return ""


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(a @ b) / (na * nb)


@torch.no_grad()
def prove_batches(
    original: nn.Module,
    patched: nn.Module,
    batches: list,
    opts: PatchOptions,
    input_scales: dict[int, float] | None = None,
) -> list[BatchProof]:
    """Per batch: the patched model's FP32 outputs against the original's (rescaling is
    exact), and its real FP16 outputs against the original's FP32 ones (a folded input k
    divided by ``input_scales[k]`` for the patched model, as its caller does)."""
    runner = Fp16Runner(patched)
    device = _device(original)
    out = []
    for k, batch in enumerate(batches):
        want = [t.float() for t in float_outputs(call_model(original, _to(batch, device=device)))]
        scaled = scale_batch(batch, input_scales)
        got32 = float_outputs(call_model(patched, _to(scaled, device=device)))
        fp32_rel = max((relative_error(a, b.float()) for a, b in zip(want, got32)), default=0.0)
        got16, first = runner.run(scaled)
        p = runner.parity(want, got16)
        first = first if not p.finite else ""
        out.append(BatchProof(k, p.finite, p.cosine, p.max_rel, fp32_rel, first, p.shape))
    return out


def fp16_rounded(batch):
    """``batch`` with each float input rounded to FP16 and back, as an FP16 run receives it
    (an input FP16 cannot hold, beyond 65504, keeps its values)."""
    from torch.utils._pytree import tree_map

    def rounded(t):
        if not (torch.is_tensor(t) and t.is_floating_point()):
            return t
        r = t.to(torch.float16).to(t.dtype)
        return r if bool((torch.isfinite(r) | ~torch.isfinite(t)).all()) else t

    return tree_map(rounded, batch)


@torch.no_grad()
def input_rounding_cosine(model: nn.Module, batch) -> float:
    """The original in FP32 on ``batch`` rounded to FP16 against it on ``batch`` (worst
    float output): what rounding the input alone costs any FP16 run, which no patch changes
    (PESTO on a gated tone: 0.998 with the whole model in FP32)."""
    device = _device(model)
    want = float_outputs(call_model(model, _to(batch, device=device)))
    got = float_outputs(call_model(model, _to(fp16_rounded(batch), device=device)))
    cos = 1.0
    for a, b in zip(want, got):
        if a.shape != b.shape:  # the rounding alone changes an output's length
            return -1.0
        ok = torch.isfinite(a) & torch.isfinite(b)
        cos = min(cos, _cosine(a[ok].float(), b[ok].float()))
    return cos


JITTER_DRAWS = 4  # draws of the input moved by FP16's resolution, for a changed length


def shape_reason(proof: BatchProof, jittered: int = 0) -> str | None:
    """Why a proof whose output changed its shape in FP16 fails (None where none did);
    ``jittered``: of ``JITTER_DRAWS`` draws of the input moved by FP16's resolution, how
    many change the length in FP32 itself (``shape_jitter``)."""
    if not proof.shape:
        return None
    if jittered:
        return (
            f"{jitter_words(jittered)}, so no FP16 run can follow it; feed the inputs the model "
            "expects (its preprocessing), check the task metric in FP16 (fp16lens.verify), or "
            "run it in FP32"
        )
    return (
        "FP16's rounding changes a decision that sets an output's length (a decoder's stop, "
        "a data-dependent shape), so no cosine can compare it; check the task metric in "
        "FP16 (fp16lens.verify), or run it in FP32"
    )


def jitter_words(jittered: int) -> str:
    """What ``jittered`` draws (of ``JITTER_DRAWS``) changing FP32's length say."""
    return (
        f"FP32 itself gives another length on {jittered} of {JITTER_DRAWS} draws of this input "
        f"moved by FP16's resolution ({REL_STEP:.2g} of each value): a decision that "
        "sets the length sits on an edge for this input"
    )


@torch.no_grad()
def shape_jitter(model: nn.Module, batch) -> int:
    """Of ``JITTER_DRAWS`` draws of ``batch`` with each float value moved by up to FP16's
    resolution (seeded), how many change an output's shape in FP32 itself."""
    from torch.utils._pytree import tree_map

    device = _device(model)
    shapes = [t.shape for t in float_outputs(call_model(model, _to(batch, device=device)))]

    def moved(t, g: torch.Generator):
        if not (torch.is_tensor(t) and t.is_floating_point()):
            return t
        r = torch.rand(t.shape, generator=g, dtype=torch.float64) * 2 - 1
        return (t.double().cpu() * (1 + REL_STEP * r)).to(t.dtype).to(device)

    changed = 0
    for seed in range(JITTER_DRAWS):
        g = torch.Generator().manual_seed(seed)
        draw = tree_map(lambda t, g=g: moved(t, g), _to(batch, device=device))
        changed += [t.shape for t in float_outputs(call_model(model, draw))] != shapes
    return changed


def rounding_reason(inherent: float, min_cosine: float, reached: float) -> str | None:
    """Why no FP16 run passes a batch whose FP16-rounded input alone gives ``inherent``
    (``input_rounding_cosine``); None when the rounding alone meets ``min_cosine``.
    ``reached``: the cosine the widest patch got, which the advised tolerance admits."""
    if inherent >= min_cosine:
        return None
    return (
        f"rounding the inputs to FP16 alone gives cosine {inherent:.6f} (the original in "
        f"FP32 on FP16-rounded inputs), so no FP16 run meets min_cosine {min_cosine} on this "
        f"batch; patch(..., min_cosine={admitting(inherent, reached)}) accepts what the "
        "input's rounding costs"
    )


SPARE = 0.1
"""The share of the error an advised tolerance leaves to spare: FP16 runtimes differ in how
they accumulate and round inside an op. On the raw-pixel demo the storage emulation of the
proof gives cosine 0.998159 and an AMD EPYC's ``.half()`` 0.997995 (1 - cosine 9% more)."""


def admitting(*cosines: float) -> float:
    """The tolerance, to 4 decimals, that every one of ``cosines`` meets with ``SPARE`` of
    its error to spare (0.998159 -> 0.9979)."""
    return math.floor((1 - (1 + SPARE) * (1 - min(cosines))) * 1e4) / 1e4


def input_range_reason(batch) -> str | None:
    """Why no FP16 run passes ``batch`` when one of its float inputs (torch tensors, or the
    numpy arrays of an ONNX feed) holds finite values beyond 65504: rounded to FP16 they
    are inf before the first op, whatever runs in FP32 inside. None when every input fits."""
    named = batch.items() if isinstance(batch, Mapping) else enumerate(tree_flatten(batch)[0])
    k = 0
    for key, x in named:
        t = x.detach() if torch.is_tensor(x) else torch.as_tensor(x)  # numpy: an ONNX feed
        if not t.is_floating_point():
            continue
        name = repr(key) if isinstance(batch, Mapping) else str(k)
        k += 1
        finite = t[torch.isfinite(t)].abs()
        peak = float(finite.max()) if finite.numel() else 0.0
        if peak > FP16_MAX:
            return (
                f"input {name} holds values up to {peak:.3g}, beyond FP16's largest value 65504, "
                "so no FP16 run can take it as it is; scale it into "
                "range before the model, or run the model in FP32"
            )
    return None


def passes(proof: BatchProof, opts: PatchOptions) -> bool:
    if not proof.finite or not proof.cosine >= opts.min_cosine:
        return False
    return opts.max_rel is None or proof.max_rel <= opts.max_rel


def worst_first(proof: BatchProof) -> tuple:
    """A sort key, worst batch first: an output whose shape FP16 changes, then non-finite
    outputs, then the lowest cosine."""
    return (not proof.shape, proof.finite, proof.cosine)


def standing(proof: list[BatchProof]) -> tuple:
    """How one round's FP16 proof reads, lower is better: batches whose output shape FP16
    changes, then non-finite batches, then the worst cosine of the others (negated: a
    cosine over a non-finite output's finite values says nothing)."""
    return (
        sum(bool(b.shape) for b in proof),
        sum(not b.finite for b in proof),
        -min((b.cosine for b in proof if b.finite and not b.shape), default=1.0),
    )


def _report_name(patched: nn.Module, site: str) -> str:
    """A site of the patched model as the report names it: the ``module`` child of an
    island is not part of the original model's names."""
    mod, sep, op = site.partition(":")
    names = dict(patched.named_modules())
    parts = mod.split(".") if mod else []
    kept, prefix = [], ""
    for p in parts:
        here = f"{prefix}.{p}" if prefix else p
        parent = names.get(prefix) if prefix else patched
        if not (p == "module" and parent is not None and is_island(parent)):
            kept.append(p)
        prefix = here
    name = ".".join(kept)
    return f"{name}{sep}{op}" if sep else name


def next_widening(
    report: Report,
    patched: nn.Module,
    failed: list[BatchProof],
    opts: PatchOptions,
    model: nn.Module,
) -> PatchOptions | None:
    """The options for the next round: one more thing kept FP32, or None when everything
    that could be has been."""
    import dataclasses

    spans, modules = list(opts.fp32_spans), list(opts.fp32_modules)
    names = set(dict(model.named_modules()))
    sites = [_report_name(patched, b.first_nonfinite) for b in failed if b.first_nonfinite]
    candidates = [i for s in sites for i in _spans_of(report, s)]
    if not sites:  # finite but off: every span not yet kept FP32
        candidates = list(range(len(report.spans)))
    new = [i for i in dict.fromkeys(candidates) if i not in spans]
    if new:
        return dataclasses.replace(opts, fp32_spans=(*spans, *new))
    wider = [enclosing(report, i) for i in dict.fromkeys(candidates)]
    wider += [host(report, s) for s in sites]
    wider = [m if m in names else "" for m in wider]
    wider = [m for m in dict.fromkeys(wider) if m not in modules]
    if wider:
        return dataclasses.replace(opts, fp32_modules=(*modules, wider[0]))
    if "" not in modules and failed:
        return dataclasses.replace(opts, fp32_modules=(*modules, ""))
    return None


def flush_widening(
    patched: nn.Module,
    batch,
    opts: PatchOptions,
    model: nn.Module,
    input_scales: dict[int, float] | None = None,
) -> PatchOptions | None:
    """Where real FP16 was finite but off: the modules whose FP16 storage flushes non-zero
    values to 0 on ``batch`` (and which the outputs miss: the proof failed) kept FP32 next,
    as the scan's ``fp16-run`` finding advises; None when no such module is left."""
    import dataclasses

    from fp16lens._core.sites import site_module
    from fp16lens.patch._emulate import flushing_sites

    names = set(dict(model.named_modules()))
    sites = flushing_sites(emulated_copy(patched), scale_batch(batch, input_scales))
    mods = [site_module(_report_name(patched, s)) for s, _ in sites]
    new = [m for m in dict.fromkeys(mods) if m and m in names and m not in opts.fp32_modules]
    return dataclasses.replace(opts, fp32_modules=(*opts.fp32_modules, *new)) if new else None


def _spans_of(report: Report, site: str) -> list[int]:
    """Spans holding ``site``, else those run by its module (or a module around it)."""
    exact = [i for i, s in enumerate(report.spans) if site in s.sites]
    if exact:
        return exact
    mod = host(report, site)
    return [
        i
        for i, s in enumerate(report.spans)
        if any(
            mod and (host(report, x) == mod or host(report, x).startswith(mod + "."))
            for x in s.sites
        )
    ]


def _output_site(report: Report, module: str) -> str | None:
    """The site giving a module's output: the module itself when it is a leaf site, else
    the last site run inside it (its forward's last op)."""
    st = report.sites.get(module)
    if st is not None and st.kind == "module":
        return module
    inside = [
        s
        for s in report.sites.values()
        if host(report, s.name) == module or host(report, s.name).startswith(module + ".")
    ]
    return max(inside, key=lambda s: s.order).name if inside else None


def statistics_problems(plan: Plan, report: Report) -> list[tuple[str, float]]:
    """Without batches, what the report's statistics show about the plan: islands whose
    recorded output (divided by their out_scale) is still beyond FP16, and that hand it
    back in FP16 (site, value)."""
    out = []
    for i in plan.islands:
        if getattr(i, "fp32_out", False):  # it hands its output on in FP32: nothing is stored
            continue
        site = i.site or _output_site(report, i.module)
        st = report.sites.get(site) if site else None
        if not site or st is None:
            continue
        value = st.absmax / (i.out_scale or 1.0)
        if not value <= FP16_MAX and math.isfinite(st.absmax):
            out.append((site, value))
    return out


def spans_for_sites(report: Report, sites: list[str]) -> list[int]:
    return list(dict.fromkeys(i for s in sites for i in _spans_of(report, s)))
