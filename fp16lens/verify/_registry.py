"""The verify backends by name: what each needs as candidate, whether it is INT8, its
default tolerance, and the factory that builds its runner. ``verify()`` and the CLI read
names from here only; a new backend is one ``register_backend(BackendSpec(...))``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from fp16lens._core import VerifyError, import_optional
from fp16lens._core.errors import UnknownBackendError
from fp16lens._core.sites import Backend
from fp16lens.verify._options import Tolerance
from fp16lens.verify._runner import Runner

MODULE, PATH = "module", "path"
# factory(candidate, model, *, fusions, device) -> Runner; model is the FP32 reference
Factory = Callable[..., Runner]


@dataclass(frozen=True)
class BackendSpec:
    """One backend: ``candidate`` is ``"module"`` (an nn.Module) or ``"path"`` (an ONNX
    file); ``int8`` makes a failed check name the layers quantization hurts most (read from
    the runner's Q/DQ graph: an ``OnnxInt8``); ``tolerance`` applies when the caller gives
    none; ``factory(candidate, model, *, fusions, device)`` builds the ``Runner``."""

    name: str
    candidate: str
    factory: Factory
    int8: bool = False
    tolerance: Tolerance = field(default_factory=Tolerance)

    def __post_init__(self):
        if not (isinstance(self.name, str) and self.name and self.name != "auto"):
            raise ValueError(
                f"a backend name must be a non-empty string other than 'auto', got {self.name!r}"
            )
        if self.candidate not in (MODULE, PATH):
            raise ValueError(f"candidate must be {MODULE!r} or {PATH!r}, got {self.candidate!r}")
        if not callable(self.factory):
            raise ValueError(f"factory must be callable, got {type(self.factory).__name__}")
        if not isinstance(self.tolerance, Tolerance):
            raise ValueError(f"tolerance must be a Tolerance, got {type(self.tolerance).__name__}")

    def accepts(self, candidate) -> bool:
        if isinstance(candidate, (str, Path)):
            return self.candidate == PATH
        return self.candidate == MODULE and isinstance(candidate, nn.Module)

    def runner(self, candidate, model: nn.Module, *, fusions: bool = False, device=None) -> Runner:
        """This backend's runner for ``candidate``, after checking it is the kind it needs."""
        if not self.accepts(candidate):
            need = "an ONNX file path" if self.candidate == PATH else "an nn.Module"
            raise VerifyError(
                f"backend {str(self.name)!r} needs {need} as candidate, got "
                f"{type(candidate).__name__}; pass a model (or a patched copy) with backend "
                f"{_quoted(MODULE)}, or an exported ONNX path with {_quoted(PATH)}"
            )
        made = self.factory(candidate, model, fusions=fusions, device=device)
        if not isinstance(made, Runner):
            raise TypeError(
                f"the factory of backend {str(self.name)!r} returned {type(made).__name__}, "
                "not a fp16lens.verify.Runner"
            )
        return made


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    """Make ``spec`` available to ``verify(..., backend=spec.name)`` and the CLI."""
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"backend {str(spec.name)!r} is already registered; pass replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_backend(name: str) -> None:
    """Remove the backend registered under ``name`` (nothing when there is none)."""
    _REGISTRY.pop(name, None)


def backends() -> tuple[str, ...]:
    """The registered backend names, built-in ones first."""
    return tuple(_REGISTRY)


def backend_spec(name: str) -> BackendSpec:
    """The registered backend called ``name``; an UnknownBackendError listing the others."""
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise UnknownBackendError(
            f"backend must be one of {', '.join(backends())} (or 'auto'); got {name!r}"
        )
    return spec


def pick_backend(candidate, backend: str | None) -> BackendSpec:
    """``backend`` by name; None or "auto": torch-fp16 for a module, onnx-int8 for an ONNX
    file with QuantizeLinear/DequantizeLinear nodes, onnx-fp16 for any other ONNX file."""
    if backend is not None and backend != "auto":
        return backend_spec(backend)
    if not isinstance(candidate, (str, Path)):
        return backend_spec(Backend.TORCH_FP16)
    return backend_spec(Backend.ONNX_INT8 if is_qdq(candidate) else Backend.ONNX_FP16)


def is_qdq(path: str | Path) -> bool:
    """Whether an ONNX file holds QuantizeLinear/DequantizeLinear nodes (an INT8 graph)."""
    from fp16lens.verify._int8_advice import QDQ_OPS

    if not Path(path).is_file():
        return False  # the runner names the missing file
    onnx = import_optional("onnx", "onnx", "running an ONNX candidate")
    proto = onnx.load(str(path), load_external_data=False)
    return any(n.op_type in QDQ_OPS for n in proto.graph.node)


def _quoted(kind: str) -> str:
    return "/".join(repr(str(s.name)) for s in _REGISTRY.values() if s.candidate == kind)


# ---- the built-in backends (imported when a run needs them) ------------------------------
def _torch_fp16(candidate, model, *, fusions, device):
    from fp16lens.verify._torch import TorchFp16

    return TorchFp16(candidate, device)


def _torch_emulated(candidate, model, *, fusions, device):
    from fp16lens.verify._torch import TorchEmulated

    return TorchEmulated(candidate, fusions=fusions, device=device)


def _onnx_fp16(candidate, model, *, fusions, device):
    from fp16lens.verify._onnx import OnnxRunner

    return OnnxRunner(candidate, model)


def _onnx_int8(candidate, model, *, fusions, device):
    from fp16lens.verify._onnx import OnnxInt8

    return OnnxInt8(candidate, model)


def _tensorrt(candidate, model, *, fusions, device):
    from fp16lens.verify._tensorrt import TensorRTRunner

    return TensorRTRunner(candidate, model)


def _torch_tensorrt(candidate, model, *, fusions, device):
    from fp16lens.verify._tensorrt import TorchTensorRTRunner

    return TorchTensorRTRunner(candidate)


# INT8: cosine >= 0.99 (quantization noise is larger than FP16 rounding)
_INT8_TOLERANCE = Tolerance(min_cosine=0.99, site_rel=0.2, about_mean=True)
for _spec in (
    BackendSpec(Backend.TORCH_FP16, MODULE, _torch_fp16),
    BackendSpec(Backend.TORCH_EMULATED, MODULE, _torch_emulated),
    BackendSpec(Backend.ONNX_FP16, PATH, _onnx_fp16),
    BackendSpec(Backend.ONNX_INT8, PATH, _onnx_int8, int8=True, tolerance=_INT8_TOLERANCE),
    BackendSpec(Backend.TENSORRT, PATH, _tensorrt),
    BackendSpec(Backend.TORCH_TENSORRT, MODULE, _torch_tensorrt),
):
    register_backend(_spec)
BACKENDS = tuple(Backend)
"""The backends fp16lens ships (``backends()`` lists every registered one)."""
