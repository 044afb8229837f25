"""The verdict checked in real FP16: a scan that finds nothing runs the graph once more per
batch with every stored tensor rounded to FP16 (``patch.onnx._fp16``: FP16 storage,
arithmetic inside an op in FP32, as a GPU's FP16 kernels accumulate), against its FP32
outputs. Where that run is not finite, or its worst output's cosine is below ``MIN_COSINE``,
the report gets a finding instead of "FP16-safe" (a report that names only risks inside ops
is checked too: the check computes inside each op in FP32, so what it finds is another
loss, which rescaling cannot fix): it names the nodes whose FP16 storage
rounds at least 1% of their non-zero outputs to 0 (values below 2^-24 that reach no log or
divide, but whose loss still reaches the outputs), else FP16's precision."""

from __future__ import annotations

from typing import Any

from fp16lens._core.sites import FP16_RUN_FLUSHED, FP16_RUN_SHAPE, FindingKind, Mechanism
from fp16lens.report import Finding, Report
from fp16lens.watch.onnx._graph import OnnxGraph
from fp16lens.watch.onnx._run import feed

MIN_COSINE = 0.999  # patch's default tolerance: what "FP16-safe" promises
MAX_BATCHES = 8  # the first batches are kept for the check (the feeds are held until then)


def flushed_at(flushing: list[tuple[str, float]]) -> str:
    """What an ``fp16-run`` finding says of the sites whose FP16 storage flushes (site,
    share of its non-zero values made 0), the first four named."""
    names = ", ".join(f"{s} ({100 * share:.3g}%)" for s, share in flushing[:4])
    more = f" and {len(flushing) - 4} more" if len(flushing) > 4 else ""
    return (
        f"its FP16 storage rounds non-zero values below 2^-24 to 0 at {names}{more}, and what "
        "they carried reaches the outputs"
    )


def aside(report: Report) -> str:
    """What an ``fp16-run`` finding adds where the report names risks inside ops: the check
    computed inside each op in FP32, so those risks are not what it saw."""
    if report.clean:
        return ""
    return (
        " (the risks inside ops this report names aside: this run computes inside each op in "
        "FP32, so its loss is not theirs, and rescaling or FP32 around them leaves it)"
    )


RAW_INPUT = 32.0
"""An input whose values reach this far is likely raw (0-255 pixels, int16 samples): where
FP16's precision is what a model loses, the finding asks about its preprocessing."""


def input_peak(values) -> float:
    """The largest finite |value| of a batch's float arrays or tensors (0 without any);
    integer inputs (token ids, class indices) are not values a model normalizes."""
    import numpy as np

    peaks = [0.0]
    for v in values:
        if hasattr(v, "detach"):  # a torch tensor (bfloat16 has no numpy dtype)
            if not v.is_floating_point():
                continue
            v = v.detach().cpu().float()
        a = np.asarray(v)
        if a.size and np.issubdtype(a.dtype, np.floating):
            finite = a[np.isfinite(a)]
            peaks.append(float(np.abs(finite).max()) if finite.size else 0.0)
    return max(peaks)


def lost_cause(proof, jittered: int = 0, peak_in: float = 0.0) -> str:
    """What an ``fp16-run`` finding says FP16 loses where nothing flushes: an output's
    length (``proof.shape``; ``jittered``: draws of the input moved by FP16's resolution on
    which FP32 itself changes it, ``fp16lens.patch.shape_jitter``), else precision, with a
    question on the preprocessing where the input reaches ``RAW_INPUT`` (``peak_in``)."""
    if proof.shape and jittered:
        from fp16lens.patch import jitter_words

        return f"{jitter_words(jittered)} (is it preprocessed as the model expects?)"
    if proof.shape:
        return (
            "FP16's rounding changes a decision that sets that length (a decoder's stop, a "
            "data-dependent shape)"
        )
    raw = (
        f"; the input reaches {peak_in:.4g}: is it preprocessed as the model expects? (a "
        "model trained on normalized inputs can hold in FP16 on them and drift on raw "
        "pixels or samples)"
        if peak_in >= RAW_INPUT
        else ""
    )
    return f"FP16's precision (11 significant bits) is what it loses{raw}"


def mends(proof, worst) -> bool:
    """Whether a run with the flushing sites kept FP32 (``proof``) mends what the check saw
    (``worst``): it passes, or turns finite."""
    return proof.finite and (proof.cosine >= MIN_COSINE or not worst.finite)


def _island_mends(proto, island: list[str], feed_: dict, worst) -> bool:
    """Whether the flushing nodes' FP32 island mends what the check saw: the run passes
    with it, or turns finite (a final sigmoid's flushed tail, say, is no cause of a loss
    that FP16's precision makes through the whole network)."""
    from fp16lens.patch.onnx import fp32_nodes
    from fp16lens.patch.onnx._fp16 import prove_graph
    from fp16lens.patch.onnx._patch import set_fp32_nodes

    trial = type(proto)()
    trial.CopyFrom(proto)
    set_fp32_nodes(trial, [*fp32_nodes(proto), *island])
    (proof,) = prove_graph(trial, trial, [feed_])
    return mends(proof, worst)


class Fp16Run:
    """Holds the first ``MAX_BATCHES`` feeds; ``settle`` checks the verdict on them."""

    def __init__(self, graph: OnnxGraph):
        self.graph = graph
        self.feeds: list[dict] = []

    def step(self, batch: Any) -> None:
        if len(self.feeds) < MAX_BATCHES:
            self.feeds.append(feed(self.graph, batch))

    def settle(self, report: Report) -> None:
        """A finding where the report is clean (or names only risks inside ops) but real FP16
        of the stored tensors is not."""
        if not self.feeds or not report.stored_in_range():
            return  # a problem is already named (and patch proves its fix in real FP16)
        from fp16lens.patch.onnx._fp16 import flushing_nodes, prove_graph

        proto = self.graph.proto
        proofs = prove_graph(proto, proto, self.feeds)
        worst = min(proofs, key=lambda p: (p.finite, p.cosine))
        if worst.finite and worst.cosine >= MIN_COSINE:
            return
        got = (
            f"another length ({worst.failure()})"
            if worst.shape
            else f"cosine {worst.cosine:.6f} < {MIN_COSINE}"
            if worst.finite
            else f"inf/NaN at the outputs (first at {worst.first_nonfinite or '?'})"
        )
        flushing, island = flushing_nodes(proto, self.feeds[worst.batch])
        if flushing and not _island_mends(proto, island, self.feeds[worst.batch], worst):
            flushing = []  # they flush, but FP32 there leaves the loss: not its cause
        if flushing:
            cause = (
                f"{flushed_at(flushing)}; in FP32 from there to where the values are back in "
                f"FP16's range: fp32_nodes={island}"
            )
        else:
            from fp16lens.patch.onnx._fp16 import shape_jitter

            jittered = shape_jitter(proto, self.feeds[worst.batch]) if worst.shape else 0
            cause = lost_cause(worst, jittered, input_peak(self.feeds[worst.batch].values()))
        report.findings.append(
            Finding(
                site=flushing[0][0] if flushing else worst.first_nonfinite,
                mechanism=Mechanism.OUTPUT,
                kind=FindingKind.FP16_RUN,
                peak=worst.cosine if worst.finite else float("nan"),
                batch=worst.batch,
                tensor=(
                    FP16_RUN_FLUSHED if flushing else FP16_RUN_SHAPE if worst.shape else "precision"
                ),
                detail=(
                    f"the graph with every stored tensor in FP16 gives {got} on batch "
                    f"{worst.batch}, though no stored value passes 65504 and no flushed value "
                    f"reaches a log or divide: {cause}{aside(report)}"
                ),
            )
        )
