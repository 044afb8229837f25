"""The compiled path of scan(compile=True): the recorder's own statistics, captured once
per input signature into one aten graph with the model's ops, compiled by Inductor.

Capture runs the watched forward once more under ``make_fx`` on real tensors, with the
recorder as the outer dispatch mode: the recorder sees the model's ops (and names their
sites through the module tracker, exactly as the eager path does), and every op it runs
for its statistics (an ``aminmax`` and a strided sample per op output, the internal
checks) reaches the tracer below it. The graph then returns those statistics as its
outputs; Inductor fuses the reductions into the kernels that produce the values.

While capturing, the recorder takes the path it takes off the CPU (``_add_event`` with
tensor extremes, no host sync, no extremes derived from earlier values, every internal
check run): what it computes is then the same for every batch of that signature. The
structure of the events (sites, producers, shapes, FP32 marks, outputs) is kept as a
template; a compiled batch is a ``Forward`` with the template's structure and the
graph's statistics, reduced by the same accumulator as an eager one.

A forward that reads tensor values in Python (``.item()``, ``if tensor:``) or makes
shapes from values (``nonzero``) cannot be captured for other batches: ``Captured.why``
says so, and the caller falls back to the eager path.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fp16lens._core.compat import mha_fast_path_under_make_fx, torch_function_metadata_mode_off
from fp16lens.watch._recorder import Forward, Recorder

_DYNAMIC_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def _reads_values(func) -> str:
    """How an aten op's result depends on tensor values in a way one graph cannot replay
    ("" when it does not): a shape made from values, or a Python number read from a tensor."""
    if any(tag in func.tags for tag in _DYNAMIC_TAGS):
        return "its output shape comes from the values"
    rets = func._schema.returns
    if rets and not any("Tensor" in str(r.type) for r in rets):
        return "a value read into Python: .item(), `if tensor:`"
    return ""


class StaticRecorder(Recorder):
    """The recorder, noting while ``static`` (capturing) the ops whose results depend on
    tensor values (see the module docstring); with ``static`` off it is the eager recorder."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reads: list[str] = []  # while static: "op in module" that read tensor values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        how = self.static and self.stack and self.forward is not None and _reads_values(func)
        if how:
            where = self.stack[-1].name or "the model's own forward"
            self.reads.append(f"{func.overloadpacket.__name__} in {where}: {how}")
        return super().__torch_dispatch__(func, types, args, kwargs)


def signature(batch: Any) -> tuple:
    """What one captured graph is specialised to: the batch's structure, each tensor's
    shape, dtype and device, and every non-tensor value."""
    leaves, spec = tree_flatten(batch)
    key = tuple(
        ("t", tuple(x.shape), x.dtype, x.device.type, x.device.index)
        if torch.is_tensor(x)
        else ("v", type(x).__name__, repr(x))
        for x in leaves
    )
    return (str(spec), key)


@dataclass
class Captured:
    """One input signature's graph: ``template`` (the structure of its events), the
    graph returning the statistics, and the compiled callable once compiled."""

    template: Forward | None = None
    graph: torch.fx.GraphModule | None = None
    run: Callable | None = None
    why: str = ""  # non-empty: this signature runs eagerly, and why
    counts: tuple[int, int] = (0, 0)  # extremes, samples among the graph's outputs


def capture(
    rec: StaticRecorder,
    model: torch.nn.Module,
    batch: Any,
    call: Callable[[torch.nn.Module, Any], Any],
) -> tuple[Captured, Forward | None]:
    """Trace one watched forward on ``batch`` into a graph; returns the capture and the
    traced forward's own events (real values of this batch), or a capture with ``why``
    set and None when the graph cannot stand for other batches."""
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, spec = tree_flatten(batch)
    slots = [i for i, x in enumerate(leaves) if torch.is_tensor(x)]
    kept = [None if torch.is_tensor(x) else x for x in leaves]
    done: list[Forward] = []

    def forward(*tensors):
        args = list(kept)
        for i, t in zip(slots, tensors):
            args[i] = t
        rec.on_forward_end, end = done.append, rec.on_forward_end
        rec.static, rec.reads = True, []
        try:
            with torch_function_metadata_mode_off(), rec.tracker, rec:
                call(model, tree_unflatten(args, spec))
        finally:
            rec.static, rec.on_forward_end = False, end
        fw = done[-1]
        return [
            *(x for pair in fw.extremes for x in pair),
            *fw.samples,
            *(p for _, _, p, _ in fw.internal),
            *(t for c in fw.flush for t in (c.flushed, c.nonfinite)),
        ]  # underflow counts

    try:
        with mha_fast_path_under_make_fx():
            gm = make_fx(forward, tracing_mode="real")(*(leaves[i] for i in slots))
    except Exception as exc:
        if rec.reads:
            return Captured(why=_reads_why(rec.reads)), None
        return Captured(why=f"capture failed ({type(exc).__name__}: {first_line(exc)})"), None
    if rec.reads:
        return Captured(why=_reads_why(rec.reads)), None
    fw = done[-1]
    template = dataclasses.replace(
        fw,
        extremes=[],
        samples=[],
        internal=[(site, kind, None, ctx) for site, kind, _, ctx in fw.internal],
        flush=[dataclasses.replace(c, flushed=0, nonfinite=0) for c in fw.flush],
    )
    return Captured(template=template, graph=gm, counts=(len(fw.extremes), len(fw.samples))), fw


def _reads_why(reads: list[str]) -> str:
    more = f"; {len(reads) - 1} more such ops" if len(reads) > 1 else ""
    return (
        f"the forward depends on tensor values ({reads[0]}{more}), so one captured graph "
        "cannot stand for every batch"
    )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def compile_graph(cap: Captured, device: torch.device, backend: str = "inductor") -> Callable:
    """Inductor over the captured graph, with the weights frozen into it (a scan never
    changes them; on the CPU the convolutions then run on prepacked oneDNN weights:
    ResNet-50's compiled scan went from 1.07x to 1.03-1.04x a plain forward). On CUDA the graph is replayed as a CUDA graph
    (mode="reduce-overhead", as its option); on the CPU convolutions keep their NCHW layout (the C++
    backend's channels-last rewrite falls back to a slow convolution). ``backend="fx"``
    runs the captured graph as it is (op by op, no compiler: what the tests compare)."""
    assert cap.graph is not None  # compiled only when the capture succeeded (no why)
    if backend == "fx":
        return cap.graph
    if backend != "inductor":
        return torch.compile(cap.graph, backend=backend, fullgraph=True, dynamic=False)
    # torch.compile takes a mode or options, not both: "reduce-overhead" is the option
    # triton.cudagraphs
    options = {"freezing": True, "freezing_discard_parameters": False}  # the user's weights stay
    options.update(
        {"triton.cudagraphs": True} if device.type == "cuda" else {"layout_optimization": False}
    )
    return torch.compile(cap.graph, backend=backend, fullgraph=True, dynamic=False, options=options)


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch, in the order capture() made them graph inputs."""
    return [x for x in tree_flatten(batch)[0] if torch.is_tensor(x)]


def run_compiled(cap: Captured, batch: Any, index: int) -> Forward:
    """One batch through the compiled graph: a Forward with the template's structure."""
    if cap.run is None:
        raise RuntimeError("compile_graph() first")
    template = cap.template
    assert template is not None  # a compiled capture has its template
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    if mark is not None and any(t.is_cuda for t in tensors_of(batch)):
        mark()  # CUDA graphs: the previous outputs were reduced already
    outs = cap.run(*tensors_of(batch))
    n_ext, n_smp = cap.counts
    n_ext *= 2  # a (min, max) pair per event
    n_int = len(template.internal)
    peaks = outs[n_ext + n_smp : n_ext + n_smp + n_int]
    counts = outs[n_ext + n_smp + n_int :]
    fw = copy.copy(template)
    fw.index = index
    fw.extremes = list(zip(outs[0:n_ext:2], outs[1:n_ext:2]))
    fw.samples = list(outs[n_ext : n_ext + n_smp])
    fw.internal = [
        (site, kind, p, ctx) for (site, kind, _, ctx), p in zip(template.internal, peaks)
    ]
    fw.flush = [
        dataclasses.replace(c, flushed=counts[2 * i], nonfinite=counts[2 * i + 1])
        for i, c in enumerate(template.flush)
    ]
    for name in ("exact_over", "saturated", "finite_max"):  # filled per batch by the accumulator
        setattr(fw, name, {})
    return fw
