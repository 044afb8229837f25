"""patch(): exact power-of-two rescaling of overflow spans; FP32 islands only where no
rescaling applies. ``plan()`` says what ``patch()`` does; the plan travels with the
patched model (``get_plan(model).fp32_modules`` for the exporter).

The module itself is callable, so both spellings of the design work:
``fp16lens.patch(model, report)`` and ``fp16lens.patch.plan(model, report)``.
``advise`` stores the plan in the report it was made for (watch and scan call it), so that
the report's advice is what ``patch`` does.

Later stages also use its per-site tracing and FP16 storage emulation (``SiteTracer``,
``Trace``, ``traced``, ``StorageRounding``, ``round_fp16_``, ``round_module_``: verify's
torch backends; patch's proof runs them on the caller's batches).
"""

from fp16lens._core.callable_module import StageModule, stage_module
from fp16lens.patch._advise import advise
from fp16lens.patch._check import check_equivalent, relative_error
from fp16lens.patch._emulate import (
    StorageRounding,
    emulated_copy,
    flushing_sites,
    round_fp16_,
    round_module_,
)
from fp16lens.patch._island import Fp32Island
from fp16lens.patch._options import PatchOptions
from fp16lens.patch._patch import get_plan, patch, plan
from fp16lens.patch._plan import (
    PRECISION_NOTE,
    PROOF_SITE,
    BatchProof,
    Island,
    Multiply,
    Plan,
    Region,
    Reparam,
    SpanFp32,
    Unresolved,
)
from fp16lens.patch._portable import (
    ISLANDS_FILE,
    PortableIsland,
    islands_metadata,
    mark_islands,
    portable,
    read_islands,
    rehydrate,
)
from fp16lens.patch._prove import Fp16Runner, jitter_words, shape_jitter
from fp16lens.patch._rules import bn_affine, scale_bn, scale_linear, scale_norm_eps
from fp16lens.patch._save import STATE_DICT_NOTE, save
from fp16lens.patch._trace import SiteTracer, Trace, traced
from fp16lens.patch._warn import PatchWarning
from fp16lens.patch._widen import Fp32Span

__all__ = [
    "ISLANDS_FILE",
    "PRECISION_NOTE",
    "PROOF_SITE",
    "STATE_DICT_NOTE",
    "BatchProof",
    "Fp16Runner",
    "Fp32Island",
    "Fp32Span",
    "Island",
    "Multiply",
    "PatchOptions",
    "PatchWarning",
    "Plan",
    "PortableIsland",
    "Region",
    "Reparam",
    "SiteTracer",
    "SpanFp32",
    "StorageRounding",
    "Trace",
    "Unresolved",
    "advise",
    "bn_affine",
    "check_equivalent",
    "emulated_copy",
    "flushing_sites",
    "get_plan",
    "islands_metadata",
    "jitter_words",
    "mark_islands",
    "patch",
    "plan",
    "portable",
    "read_islands",
    "rehydrate",
    "relative_error",
    "round_fp16_",
    "round_module_",
    "save",
    "scale_bn",
    "scale_linear",
    "scale_norm_eps",
    "shape_jitter",
    "traced",
]


class _Patch(StageModule):
    """``fp16lens.patch``: the package, callable as ``patch(model, report, ...)``."""

    __call__ = staticmethod(patch)
    plan = staticmethod(plan)
    get_plan = staticmethod(get_plan)
    PatchOptions = PatchOptions
    PatchWarning = PatchWarning
    Plan = Plan


entry = stage_module(__name__, _Patch, patch)
