"""The verdict of a torch watch or scan checked in real FP16, as ``watch/onnx/_fp16run.py``
checks an ONNX scan's: where nothing is found (or only risks inside ops, on the CPU's
emulation, which computes inside each op in FP32), reading the report runs a copy of the model
once more on its first batches in FP16 (``.half()`` on a GPU; on the CPU FP16 storage
emulated, ``patch._emulate``: every stored tensor rounded to FP16, arithmetic inside an op
in FP32) against the FP32 outputs the watched forwards gave. Where that run is not finite,
or its worst output's cosine is below ``MIN_COSINE``, the report gets an ``fp16-run``
finding instead of "FP16-safe": it names the sites whose FP16 storage rounds at least 1% of
their non-zero outputs to 0 (values below 2^-24 that reach no log or divide, but whose loss
still reaches the outputs) and the modules that hold them, else FP16's precision, else a
``.half()`` that cannot run. Where the copy itself cannot run again, a note says the
verdict went unchecked."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from fp16lens._core.sites import (
    FP16_RUN_FLUSHED,
    FP16_RUN_HALF_FAILS,
    FP16_RUN_SHAPE,
    FindingKind,
    Mechanism,
    site_module,
)
from fp16lens._trace import HALF_FAILS, call_model, float_outputs
from fp16lens.report import Finding, Report

if TYPE_CHECKING:
    from fp16lens.patch import BatchProof
from fp16lens.watch.onnx._fp16run import (
    MAX_BATCHES,
    MIN_COSINE,
    aside,
    flushed_at,
    input_peak,
    lost_cause,
    mends,
)


def _islands_mend(model: torch.nn.Module, modules: list[str], kept: tuple, worst) -> bool:
    """Whether keeping the flushing ``modules`` FP32 (islands, on a copy) mends what the
    check saw on the ``kept`` batch: the run passes, or turns finite (a final sigmoid's
    flushed tail is no cause of a loss FP16's precision makes through the whole model)."""
    from fp16lens.patch import Fp16Runner, Fp32Island

    batch = kept[0]
    try:
        want = float_outputs(call_model(copy.deepcopy(model).eval(), batch))
        trial = copy.deepcopy(model).eval()
        for name in modules:
            parent, _, attr = name.rpartition(".")
            owner = trial.get_submodule(parent) if parent else trial
            setattr(owner, attr, Fp32Island(getattr(owner, attr)))
        runner = Fp16Runner(trial)
        got, _ = runner.run(batch)
    except Exception:  # the trial cannot run: the flush stays the named cause
        return True
    return mends(runner.parity(want, got), worst)


def _copy(a: Any) -> Any:
    """A tensor input kept for the check: detached and copied (a loader may reuse it)."""
    return a.detach().clone() if torch.is_tensor(a) else a


class TorchFp16Run:
    """Holds the first ``MAX_BATCHES`` batches (and the FP32 outputs the watched forward
    gave); ``settle`` checks the verdict on them."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.kept: list[tuple[Any, list[torch.Tensor] | None]] = []

    @contextlib.contextmanager
    def kept_from(self, model: torch.nn.Module) -> Iterator[None]:
        """Keep (copies of) the first batches ``model`` is called with inside the block and
        its outputs, through a forward hook on it that is removed on exit, also on an error."""

        def hook(module, args, kwargs, output) -> None:
            if len(self.kept) < MAX_BATCHES and not (args and kwargs):
                batch = kwargs if kwargs else args
                tensors = [t for t in tree_flatten(batch)[0] if torch.is_tensor(t)]
                if not any(t.is_meta for t in tensors):  # not a trace on meta
                    self.step(batch, output)

        handle = model.register_forward_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def step(self, batch: Any, out: Any = None) -> None:
        """Keep ``batch`` and its FP32 outputs ``out`` (None: computed by ``settle``)."""
        if len(self.kept) < MAX_BATCHES:
            outs = None if out is None else [t.detach().clone() for t in float_outputs(out)]
            self.kept.append((tree_map(_copy, batch), outs))

    @torch.no_grad()
    def settle(self, report: Report) -> None:
        """A finding where the report is clean but the model in real FP16 is not. The
        user's model is not run again: what runs is a copy (and its FP16 twin)."""
        kept, self.kept = self.kept, []
        if not kept or not report.stored_in_range():
            return  # a problem is already named (and patch proves its fix in real FP16)
        try:
            worst, runner, model = self._worst(kept)
        except Exception as exc:  # the model's own forward refused a second run
            why = str(exc).splitlines()[0][:160] if str(exc) else ""
            report.findings.append(
                Finding(
                    site="",
                    mechanism=Mechanism.NOTE,
                    kind=FindingKind.UNCHECKED,
                    peak=0.0,
                    detail=(
                        "the clean verdict was not checked in real FP16: running a copy of the "
                        f"model again raised {type(exc).__name__}: {why}"
                    ),
                )
            )
            return
        if worst is None or (worst.finite and worst.cosine >= MIN_COSINE):
            return
        if runner.gpu and not report.clean:
            return  # real FP16 kernels may be what the risks inside ops named
        finite, cos, k, first = worst.finite, worst.cosine, worst.batch, worst.first_nonfinite
        broken = first.startswith(HALF_FAILS)
        what = (
            f"another length ({worst.failure()})"
            if worst.shape
            else f"cosine {cos:.6f} < {MIN_COSINE}"
            if finite
            else f"inf/NaN at the outputs (first at {first or '?'})"
        )
        from fp16lens.patch import emulated_copy, flushing_sites

        emulated = emulated_copy(model) if runner.gpu else runner.model
        try:
            flushing = [] if broken else flushing_sites(emulated, kept[k][0])
        except Exception:  # the verdict stands; only the sites go unnamed
            flushing = []
        modules = list(dict.fromkeys(site_module(s) for s, _ in flushing if site_module(s)))
        if modules and not _islands_mend(model, modules, kept[k], worst):
            flushing, modules = [], []  # they flush, but FP32 there leaves the loss
        if flushing:
            cause = flushed_at(flushing)
        else:
            from fp16lens.patch import shape_jitter

            # on a copy: the user's model is not run again
            mine = model is self.model
            jittered = (
                shape_jitter(copy.deepcopy(model) if mine else model, kept[k][0])
                if worst.shape
                else 0
            )
            peak_in = input_peak(t for t in tree_flatten(kept[k][0])[0] if torch.is_tensor(t))
            cause = lost_cause(worst, jittered, peak_in)
        if modules:
            fix = (
                f"keep {', '.join(modules[:4])} in FP32 (patch(model, batches, "
                f"fp32_modules={modules[:4]!r}) makes them FP32 islands and proves it), or "
                "scale the values up by 2^k before them and down after"
            )
        elif flushing:
            fix = (
                "the flushing ops run in the model's own forward: move them into a submodule "
                "and keep it in FP32 (patch(..., fp32_modules=[it])), or scale the values up "
                "by 2^k before them and down after"
            )
        elif broken:
            fix = (
                "make the forward follow the model's dtype (a tensor it creates in FP32 meets "
                "FP16 weights: create it with dtype=x.dtype, or cast it with .to(x.dtype))"
            )
        else:
            fix = (
                "FP16 keeps 11 significant bits at any scale and a decision near a tie can "
                "flip: check the task metric in FP16 "
                "(fp16lens.verify), or keep in FP32 what the tolerance needs "
                "(patch(model, report, batches=...) widens FP32 until its proof passes)"
            )
        report.findings.append(
            Finding(
                site=flushing[0][0] if flushing else (first if not (finite or broken) else ""),
                mechanism=Mechanism.OUTPUT,
                kind=FindingKind.FP16_RUN,
                peak=cos if finite else float("nan"),
                batch=k,
                tensor=(
                    FP16_RUN_FLUSHED
                    if flushing
                    else FP16_RUN_HALF_FAILS
                    if broken
                    else FP16_RUN_SHAPE
                    if worst.shape
                    else "precision"
                ),
                detail=(
                    f"the model cannot run in FP16 on batch {k}: {first[1:-1]}"
                    if broken
                    else f"the model in FP16 gives {what} on batch {k}, though no value passes "
                    f"65504 and no flushed value reaches a log or divide: {cause}{aside(report)}"
                ),
                fix=fix,
            )
        )

    def _worst(self, kept: list) -> tuple[BatchProof | None, Any, torch.nn.Module]:
        """The worst kept batch's proof (None without batches), the FP16 runner and the
        FP32 model it copies. FP32 outputs are the watched forward's; a model in training
        mode (dropout, batch statistics) is compared as an eval copy with itself, as
        ``.half()`` deploys it. So is a model whose forward does not give the watched
        outputs again (a streaming RNN that keeps its hidden state between calls, BeatNet's
        ``self.hidden``): its copy starts from the state the watched calls left, so FP16 is
        compared with FP32 from that same state, not with the watched calls'."""
        training = any(m.training for m in self.model.modules())
        model = self.model
        fresh = training or any(out is None for _, out in kept)
        if fresh:
            model = copy.deepcopy(self.model).eval()
        worst, runner = self._check(model, kept, None if fresh else [out for _, out in kept])
        failed = worst is not None and not (worst.finite and worst.cosine >= MIN_COSINE)
        if failed and not fresh and not self._replays(kept[0]):
            model = copy.deepcopy(self.model)
            worst, runner = self._check(model, kept, None)
        return worst, runner, model

    @staticmethod
    def _check(model: torch.nn.Module, kept: list, wants: list | None) -> tuple[Any, Any]:
        """The worst batch's proof and the runner, against ``wants`` (None: FP32 outputs of
        ``model`` itself, a copy of the user's, run after the runner took its own copy, so
        both start from the same state)."""
        from fp16lens.patch import BatchProof, Fp16Runner

        runner = Fp16Runner(model)  # copies the model (FP16 storage, or .half() on a GPU)
        if wants is None:
            wants = [float_outputs(call_model(model, batch)) for batch, _ in kept]
        worst = None
        for k, ((batch, _), want) in enumerate(zip(kept, wants)):
            got, first = runner.run(batch)
            p = runner.parity(want, got)
            proof = BatchProof(k, p.finite, p.cosine, p.max_rel, 0.0, first, p.shape)
            if worst is None or (p.finite, p.cosine) < (worst.finite, worst.cosine):
                worst = proof
        return worst, runner

    def _replays(self, first: tuple) -> bool:
        """Whether a copy of the model, run again in FP32 on the first kept batch, gives the
        output the watched call gave (False for a forward whose state or chance moves it)."""
        batch, out = first
        try:
            again = float_outputs(call_model(copy.deepcopy(self.model), batch))
        except Exception:  # it cannot run again: the check's own finding stands
            return True
        return len(again) == len(out) and all(
            a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
            for a, b in zip(again, out)
        )
