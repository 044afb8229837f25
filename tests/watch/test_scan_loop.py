"""The one scan loop: every front end (eager, compiled, ONNX) plugs into ``scan_with``
through the ``FrontEnd`` protocol, and Ctrl-C in any of them is a ScanInterrupted carrying
the report of the batches that ran, with the model left as it was."""

from __future__ import annotations

import inspect

import pytest
import torch

import fp16lens
from fp16lens.watch import ScanInterrupted
from fp16lens.watch._compiled_scan import CompiledScan
from fp16lens.watch._loop import FrontEnd
from fp16lens.watch._scan import EagerScan
from fp16lens.watch.onnx._scan import OnnxScan

from models import gelu_span


@pytest.mark.parametrize("front", [EagerScan, CompiledScan, OnnxScan])
def test_every_front_end_has_the_protocols_methods(front):
    for name in ("session", "step", "report"):
        want = list(inspect.signature(getattr(FrontEnd, name)).parameters)
        assert list(inspect.signature(getattr(front, name)).parameters) == want, (front, name)


def _interrupted_after(batches: list, n: int):
    """The batches, with Ctrl-C pressed while the loop asks for batch ``n``."""
    for i, b in enumerate(batches):
        if i == n:
            raise KeyboardInterrupt
        yield b


def _no_hooks(model: torch.nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("how", ["eager", "compiled", "onnx"])
def test_ctrl_c_keeps_the_report_of_what_ran(how, tmp_path):
    model, (x,) = gelu_span()
    x = x * 3000  # the span overflows FP16: the partial report must show it
    batches = [x, x * 0.5, x * 0.25, x]
    target, feed = model, batches
    if how == "onnx":
        target = tmp_path / "g.onnx"
        fp16lens.export(model, (x,), target, "fp32")
        target, feed = str(target), [b.numpy() for b in batches]
    before = model(x)
    with pytest.raises(ScanInterrupted, match="interrupted after 2 of") as stop:
        fp16lens.scan(
            target, _interrupted_after(feed, 2), progress=False, compile=how == "compiled"
        )
    report = stop.value.report
    assert report is not None and report.meta.batches == 2
    assert report.spans, "the partial report shows the span of the batches that ran"
    assert _no_hooks(model) and torch.equal(model(x), before)
    # the same scan run to its end is the complete report, with the plan's advice
    full = fp16lens.scan(target, feed[:2], progress=False, compile=how == "compiled")
    assert full.meta.batches == 2 and full.advice is not None
