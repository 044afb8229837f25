"""The site contract every stage shares: how a site is named and parsed, how an FP32 island
and a patch plan are marked on a model, and how mechanisms, finding kinds and backends
are spelled.

A site is a module's qualified name as ``named_modules()`` gives it (``layer4.1.bn2``), or
a functional op inside a module's forward: ``module:op`` (``layer4.1:add``; ``:mul`` in
the root), numbered from the second call in one forward (``layer4.1:add#2``). Parameter
findings name ``module`` and carry the tensor apart; input findings are ``input[k]``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

ISLAND_ATTR = "fp16lens_fp32"
"""Class attribute that marks a module as an FP32 island (see ``fp16lens.patch``)."""
PLAN_ATTR = "_fp16lens_plan"
"""Attribute under which a patched model carries its plan (``fp16lens.patch.get_plan``)."""


def is_island(module: Any) -> bool:
    """Whether ``module`` runs in FP32 inside an FP16 model (an island made by patch)."""
    return bool(getattr(module, ISLAND_ATTR, False))


class SiteName(NamedTuple):
    """A site name taken apart: ``module:op#nth`` (``op`` empty for a module site)."""

    module: str
    op: str = ""
    nth: int = 1

    @property
    def is_op(self) -> bool:
        return bool(self.op)

    def __str__(self) -> str:
        return site_name(self.module, self.op, self.nth)


def site_name(module: str, op: str = "", nth: int = 1) -> str:
    """The site of ``module`` (``op`` empty) or of its ``nth`` call of ``op`` in one forward."""
    if not op:
        return module
    return f"{module}:{op}#{nth}" if nth > 1 else f"{module}:{op}"


def parse_site(site: str) -> SiteName:
    """``"layer4.1:add#2"`` -> ``SiteName("layer4.1", "add", 2)``; a module site has no op."""
    module, sep, rest = site.partition(":")
    if not sep:
        return SiteName(site)
    op, _, nth = rest.partition("#")
    return SiteName(module, op, int(nth) if nth.isdigit() else 1)


def site_module(site: str) -> str:
    """The qualified name of the module that owns ``site`` (itself for a module site)."""
    return site.partition(":")[0]


INPUT_WORDS = "model input "  # how an input finding's detail and patch name its input


def input_label(index: int, name: str = "") -> str:
    """``1``, or ``1 (scale)`` where the input has a name of its own (a keyword argument,
    an ONNX graph input) beside its position; a positional argument's name is its own
    position among the arguments, not a name."""
    return f"{index} ({name})" if name and not name.isdigit() else str(index)


IF_BRANCHES = {True: "then", False: "else"}  # an ONNX If's branch by its condition


def branch_site(if_site: str, cond: bool, site: str) -> str:
    """An ONNX node that the scan inlined from the branch of the If ``if_site`` taken when
    its condition is ``cond``: ``If_0/then//stft/Conv``."""
    return f"{if_site}/{IF_BRANCHES[cond]}/{site}"


def in_branch(site: str) -> bool:
    """Whether ``site`` has the form ``branch_site`` gives (a node inlined from an If)."""
    return any(f"/{b}/" in site for b in IF_BRANCHES.values())


def branch_owner(site: str, if_sites) -> str | None:
    """The If (of ``if_sites``, a main graph's) whose inlined branch holds ``site``, or None."""
    return next(
        (s for s in if_sites for c in IF_BRANCHES if site.startswith(branch_site(s, c, ""))), None
    )


class _Names(str, Enum):
    """An enum whose members are their strings: equal to them, formatted and JSON-dumped as them."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str(self), spec)


class Mechanism(_Names):
    """How a finding's values leave FP16 range."""

    OUTPUT = "output"  # a stored op output (spans)
    INTERNAL = "internal"  # inside an op, never at its output
    PARAMETER = "parameter"  # a parameter or buffer
    INPUT = "input"  # the model's input
    UNDERFLOW = "underflow"  # values FP16 flushes to zero reach an op where zero is singular
    NOTE = "note"  # advice; does not make a report unclean


class FindingKind(_Names):
    """What exactly a finding is; each has its advice in ``report/_advice.py``."""

    OVERFLOW = "overflow"
    NONFINITE = "nonfinite"
    PARAM_OVERFLOW = "param-overflow"
    PARAM_SUBNORMAL = "param-subnormal"
    PARAM_UNDERFLOW = "param-underflow"
    NORM_VARIANCE = "norm-variance"
    RMS_SQUARE = "rms-square"
    SUM_BEFORE_MEAN = "sum-before-mean"
    SUM_OF_SQUARES = "sum-of-squares"
    ATTENTION_SCORES = "attention-scores"
    SOFTMAX_EXP = "softmax-exp"
    MASK_CONSTANT = "mask-constant"
    FLUSH_SINGULAR = "flush-singular"  # a flushed value makes log/div/rsqrt non-finite
    FP32_UPCAST = "fp32-upcast"
    UNSCANNED = "unscanned"  # values the scan could not see (ONNX If/Loop/Scan bodies)
    INLINED = "inlined-branch"  # ONNX If branches the scan saw inlined into the main graph
    COMPILE_FALLBACK = "compile-fallback"  # scan(compile=True) watched batches eagerly
    FP16_RUN = "fp16-run"  # the graph in real FP16 fails though no value leaves range
    UNCHECKED = "unchecked"  # the clean verdict could not be run again in real FP16
    FP16_FILE = "fp16-file"  # an ONNX file already in float16, scanned as its FP32 twin
    CONVERTER_CLAMP = "converter-clamp"  # an FP16 file's constants at a converter's bound
    FP16_INSIDE = "fp16-inside"  # an FP32 model's forward computes some sites in float16


FP16_RUN_FLUSHED = "values flushed to 0"
"""An ``fp16-run`` finding's ``tensor`` where FP16 storage flushes what the outputs need
(else "precision"): ``--fail-on underflow`` fails on it."""
FP16_RUN_SHAPE = "output shape"
"""An ``fp16-run`` finding's ``tensor`` where FP16 changes an output's shape (a loop's length)."""
FP16_RUN_HALF_FAILS = "half fails"
"""An ``fp16-run`` finding's ``tensor`` where the model's ``.half()`` cannot run at all."""


class Backend(_Names):
    """Where ``verify`` runs a candidate."""

    TORCH_FP16 = "torch-fp16"
    TORCH_EMULATED = "torch-emulated"
    ONNX_FP16 = "onnx-fp16"
    ONNX_INT8 = "onnx-int8"
    TENSORRT = "tensorrt"
    TORCH_TENSORRT = "torch-tensorrt"
