"""The torch backends: real FP16 on the model's device (``torch-fp16``), and FP16 storage
emulated in FP32 (``torch-emulated``, see ``_emulate``)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fp16lens._core import VerifyError
from fp16lens._core.sites import Backend
from fp16lens._trace import fp32_compute_ops
from fp16lens.patch import SiteTracer, StorageRounding, Trace, round_module_, traced
from fp16lens.verify._align import first_departure
from fp16lens.verify._batches import cast_floats, model_device
from fp16lens.verify._runner import Runner


def tensor_leaves(output) -> list[torch.Tensor]:
    return [t for t in tree_flatten(output)[0] if torch.is_tensor(t)]


def _device(candidate: nn.Module, device) -> torch.device:
    """Where a backend runs: ``device`` when given (``"cuda"``, ``"cuda:1"``), else the
    candidate's own device."""
    return model_device(candidate) if device is None else torch.device(device)


class TorchFp16(Runner):
    """``copy.deepcopy(candidate).half()`` with half inputs: real FP16 storage between ops.
    Modules that keep themselves FP32 under ``.half()`` (FP32 islands) are honoured as is.
    It runs on ``device`` (default: the candidate's); the candidate itself is not moved."""

    name = Backend.TORCH_FP16

    def __init__(self, candidate: nn.Module, device=None):
        self.reference = candidate
        self.device = _device(candidate, device)
        self.model = copy.deepcopy(candidate).eval().half().to(self.device)

    def run(self, batch: tuple) -> list[torch.Tensor]:
        with torch.no_grad():
            return tensor_leaves(self.model(*self._inputs(batch)))

    def _inputs(self, batch: tuple) -> tuple:
        return cast_floats(batch, torch.float16, self.device)

    def _traced(self, batch: tuple) -> Trace:
        trace = Trace(find_nonfinite=False)
        with torch.no_grad(), traced(self.model, SiteTracer(trace)):
            self.model(*self._inputs(batch))
        return trace

    def locate(self, batch: tuple, site_rel: float) -> tuple[str | None, None]:
        """The first site departing from the candidate's own FP32 run (so a patched
        candidate's rescaled insides compare with themselves, not with the original)."""
        reference = Trace(find_nonfinite=False)
        was_training = self.reference.training
        self.reference.eval()
        try:
            with torch.no_grad(), traced(self.reference, SiteTracer(reference)):
                self.reference(*cast_floats(batch, torch.float32, model_device(self.reference)))
        finally:
            self.reference.train(was_training)
        return first_departure(reference.records, self._traced(batch).records, site_rel), None


class TorchEmulated(TorchFp16):
    """FP32 compute, every stored tensor (parameters, inputs, op outputs) rounded to FP16."""

    name = Backend.TORCH_EMULATED

    def __init__(self, candidate: nn.Module, fusions: bool = False, device=None):
        if isinstance(candidate, torch.jit.ScriptModule):
            raise VerifyError(
                "the torch-emulated backend follows every module with hooks, which a TorchScript "
                "candidate has not; verify it with --backend torch-fp16 (real FP16), or save the "
                "model as a torch.export program (.pt2)"
            )
        self.reference = candidate
        self.device = _device(candidate, device)
        self.fusions = fusions
        self.model = copy.deepcopy(candidate).eval().float().to(self.device)
        round_module_(self.model)
        self.fp32_ops: set[int] | None = None  # found on the first batch (see _halfdtypes)

    def _inputs(self, batch: tuple) -> tuple:
        return cast_floats(cast_floats(batch, torch.float16, self.device), torch.float32)

    def run(self, batch: tuple) -> list[torch.Tensor]:
        return tensor_leaves(self._run(batch, Trace(keep=False, find_nonfinite=False)))

    def _traced(self, batch: tuple) -> Trace:
        trace = Trace(find_nonfinite=False)
        self._run(batch, trace)
        return trace

    def _run(self, batch: tuple, trace: Trace):
        if self.fp32_ops is None:
            self.fp32_ops = fp32_compute_ops(self.model, self._inputs(batch)) or set()
        mode = StorageRounding(trace, fusions=self.fusions, fp32_ops=self.fp32_ops)
        with torch.no_grad():
            with traced(self.model, mode):
                out = self.model(*self._inputs(batch))
            mode.flush(out)
        return out

    def first_nonfinite(self, batch: tuple) -> Trace:
        """A trace (without copies) whose ``first_nonfinite`` names where inf/NaN appears."""
        trace = Trace(keep=False)
        self._run(batch, trace)
        return trace
