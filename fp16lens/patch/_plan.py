"""The plan: plain data saying what patch() does, printable with rich."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fp16lens._core.sites import site_module

PROOF_SITE = "fp16-proof"
"""The site of an Unresolved entry the proof adds: real FP16 still fails on a batch."""

PRECISION_NOTE = (
    "real FP16 of the rescaled model was finite on every batch, short only in precision"
)
"""How a plan note starts when the proof kept the whole model FP32 although the rescaled
model's real FP16 was finite, short of ``min_cosine`` only (the note names the tolerance
that keeps the rescaled model)."""


def _under(name: str, outer: list[str]) -> bool:
    """Whether module ``name`` is one of ``outer`` or inside one ("" is the whole model)."""
    return any(o == "" or name == o or name.startswith(o + ".") for o in outer)


@dataclass(frozen=True)
class Region:
    """Sites whose outputs are divided by ``factor``: entries absorb 1/factor in their
    parameters, exits absorb factor; inner ops commute with the scale."""

    sites: tuple[str, ...]
    entries: tuple[str, ...]
    exits: tuple[str, ...]
    factor: float
    peak: float  # largest |value| of the region's sites before rescaling
    reasons: tuple[str, ...]  # the spans/findings it fixes


@dataclass(frozen=True)
class Island:
    """A module that runs in FP32: input * in_scale, module in FP32, output / out_scale."""

    module: str  # qualified name in the patched model
    in_scale: float
    out_scale: float
    reason: str
    site: str = ""  # a functional activation's site ("block:silu"): a new child runs it
    fp32_out: bool = False  # hands its output on in FP32 (to islands after it, or the model output)
    fp32_in: bool = False  # fed in FP32 by islands before it: hands back the model's dtype
    nodes: tuple[str, ...] = ()  # ops of the model's own forward (fx node names) a new child runs


@dataclass(frozen=True)
class Reparam:
    """Parameters/buffers of one module rewritten in place (the module stays)."""

    module: str
    rule: str  # "linear" | "bn-scale" | "bn-affine" | "norm" | "parameter" | "input"
    s_in: float  # the module's input arrives divided by s_in
    s_out: float  # its output leaves divided by s_out
    detail: str


@dataclass(frozen=True)
class Multiply:
    """One scalar multiply on the operands of a functional join that come from outside a
    region (``cut``), inserted with torch.fx into the forward of ``owner``."""

    site: str  # the join, "layer4.1:add"
    owner: str  # the module whose forward runs it ("" = the model itself)
    factor: float
    keep: tuple[str, ...]  # operands' producers left as they are
    cut: tuple[str, ...]  # operands' producers whose values are multiplied


@dataclass(frozen=True)
class UnderflowRule:
    """An underflow finding fixed exactly (``_core/algebra/_underflow.py``): the block's
    values are scaled UP by 2^exponent from ``folded`` (a Linear/Conv whose weight and bias
    take the factor; "" for one multiply at the block's input or its own layer), and the
    singular op ends the scale (``rule``: ``underflow-log``, ``-ratio``, ``-power``). The
    forward of ``owner`` is rewritten with torch.fx; ``node`` is the singular op's fx node."""

    site: str  # the singular op ("block:log")
    owner: str  # the module whose forward runs the block
    node: str  # its fx node name in the traced forward of ``owner``
    rule: str
    exponent: int  # j: the block's values are 2^j times their FP32 selves
    folded: str  # the layer whose parameters take 2^j ("" : a multiply)
    detail: str
    source: str = ""  # the fx node the scale starts from (one per owner)


@dataclass(frozen=True)
class Unresolved:
    """A problem patch() cannot fix; ``reason`` says why and what to do, ``cause`` names
    a cause the caller can act on (``INPUT_CAUSE``), "" otherwise."""

    site: str
    reason: str
    cause: str = ""


INPUT_CAUSE = "input beyond FP16"
"""The cause of an Unresolved proof failure where an input holds finite values beyond 65504:
no FP16 run can take it, whatever patch keeps in FP32 (``_prove.input_range_reason``)."""


@dataclass(frozen=True)
class SpanFp32:
    """The last resort for span ``span`` of the report: ``modules`` run in FP32 end to end
    (each an island), those in ``fp32_out`` hand their output onward in FP32 (their values
    are still beyond FP16), the others hand it back in the model's dtype (values in range
    again). Applied after the rest of the plan (``patch/_widen.py``)."""

    span: int  # index into report.spans; -1: not a span (a module kept FP32 whole)
    modules: tuple[str, ...]
    fp32_out: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class BatchProof:
    """What patch's proof found on one batch: the patched model in real FP16 (on the CPU
    FP16 storage of every stored tensor, on a GPU ``.half()``) against the original in FP32."""

    batch: int
    finite: bool  # every float output of the FP16 run is finite where FP32's is
    cosine: float  # of the FP16 run's outputs against the original's FP32 outputs (worst output)
    max_rel: float  # largest |fp16 - fp32| over the FP32 output's largest |value| (worst output)
    fp32_rel: float  # the patched model's FP32 outputs against the original's (rescaling is exact)
    first_nonfinite: str = ""  # the first site whose FP16 output is inf/NaN ("" if none)
    shape: str = ""  # an output whose shape FP16 changes (a loop's length), else ""

    def failure(self) -> str:
        """What failed, in a few words: the output whose shape FP16 changed, the first
        non-finite site, or the cosine."""
        if self.shape:
            return self.shape
        if not self.finite:
            return f"non-finite at {self.first_nonfinite or '?'}"
        return f"cosine {self.cosine:.6f}"


@dataclass
class Plan:
    """What ``patch`` does to a model for a report (``plan()`` returns it, ``get_plan`` reads
    it from a patched model): regions rescaled by their factors, re-parametrized modules,
    exact multiplies, FP32 islands, underflow rules, and what stays unresolved."""

    regions: list[Region] = field(default_factory=list)
    islands: list[Island] = field(default_factory=list)
    reparametrized: list[Reparam] = field(default_factory=list)
    multiplies: list[Multiply] = field(default_factory=list)
    unresolved: list[Unresolved] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kept: list[Island] = field(default_factory=list)  # islands of an earlier patch()
    input_scales: dict[int, float] = field(default_factory=dict)  # input index -> 2^k the caller
    # divides it by: its first layers hold the factor (Reparam rule "input")
    fp16_flops: float = 0.0  # conv/linear FLOPs of the watched forwards left in FP16
    total_flops: float = 0.0  # all conv/linear FLOPs of the watched forwards
    widened: list[SpanFp32] = field(
        default_factory=list
    )  # spans kept FP32 end to end (the proof's last resort)
    underflow_rules: list[UnderflowRule] = field(default_factory=list)  # underflow fixed exactly
    proof: list[BatchProof] = field(default_factory=list)  # per batch, the final check's findings
    aliases: dict[str, str] = field(default_factory=dict)  # a report site -> the site the
    # planner knows it by (ONNX: a decomposed norm's nodes -> its norm site); its reasons name that
    fp16_checked: bool = False  # whether real FP16 ran on the caller's batches
    fp32_checked: bool = (
        False  # whether the FP32 equivalence check ran (batches or recorded inputs)
    )

    @property
    def fp16_flop_share(self) -> float:
        """Conv/linear FLOPs left in FP16 over all of them (1.0 for a model without any)."""
        return self.fp16_flops / self.total_flops if self.total_flops else 1.0

    @property
    def fp32_modules(self) -> list[str]:
        """Qualified names (in the patched model) of the modules that must run in FP32."""
        outer = [m for w in self.widened for m in w.modules]
        if "" in outer:  # the whole model kept FP32 holds every other island
            return [""]
        inside = [i.module for i in [*self.kept, *self.islands] if not _under(i.module, outer)]
        return list(dict.fromkeys([*inside, *outer]))

    @property
    def proven(self) -> bool:
        """Real FP16 ran on the caller's batches and every batch was finite and within the
        tolerance (the plan's ``proof``); False when the check did not run or failed."""
        return (
            self.fp16_checked
            and bool(self.proof)
            and not any(u.site.startswith(PROOF_SITE) for u in self.unresolved)
        )

    @property
    def rewrites_root(self) -> bool:
        """Whether the model's own forward is rewritten with torch.fx (a multiply in it,
        or a functional activation of it made an island): patch returns a GraphModule."""
        return (
            any(m.owner == "" for m in self.multiplies)
            or any((i.site and not site_module(i.site)) or i.nodes for i in self.islands)
            or any(u.owner == "" for u in self.underflow_rules)
        )

    @property
    def changes(self) -> bool:
        return bool(
            self.islands
            or self.reparametrized
            or self.multiplies
            or self.widened
            or self.underflow_rules
        )

    def scale_inputs(self, *inputs):
        """The inputs as the patched model takes them: float input k (counted as the
        report counts them: float tensors only) divided by ``input_scales[k]`` (an exact
        power of two), the others as they are."""
        out, k = [], 0
        for x in inputs:
            if hasattr(x, "is_floating_point") and x.is_floating_point():
                x = x / self.input_scales[k] if k in self.input_scales else x
                k += 1
            out.append(x)
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "regions": [dataclasses.asdict(r) for r in self.regions],
            "islands": [dataclasses.asdict(i) for i in self.islands],
            "kept": [dataclasses.asdict(i) for i in self.kept],
            "reparametrized": [dataclasses.asdict(r) for r in self.reparametrized],
            "multiplies": [dataclasses.asdict(m) for m in self.multiplies],
            "unresolved": [dataclasses.asdict(u) for u in self.unresolved],
            "notes": list(self.notes),
            "input_scales": {str(k): v for k, v in self.input_scales.items()},
            "fp32_modules": self.fp32_modules,
            "fp16_flops": self.fp16_flops,
            "total_flops": self.total_flops,
            "fp16_flop_share": self.fp16_flop_share,
            "widened": [dataclasses.asdict(w) for w in self.widened],
            "underflow_rules": [dataclasses.asdict(u) for u in self.underflow_rules],
            "proof": [dataclasses.asdict(b) for b in self.proof],
            "fp16_checked": self.fp16_checked,
            "fp32_checked": self.fp32_checked,
            "proven": self.proven,
        }

    def __rich_console__(self, console, options):
        from fp16lens.patch._render import render

        yield from render(self)

    def __repr__(self) -> str:
        return (
            f"Plan({len(self.regions)} regions, {len(self.reparametrized)} re-parametrized, "
            f"{len(self.multiplies)} multiplies, {len(self.underflow_rules)} underflow rules, "
            f"{len(self.islands)} FP32 islands, "
            f"{len(self.widened)} spans kept FP32, {len(self.unresolved)} unresolved, "
            f"FP16 FLOP share {self.fp16_flop_share:.2%}, "
            f"{'proven in FP16' if self.proven else 'FP16 not proven'})"
        )
