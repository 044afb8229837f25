"""Module tracking shared by watch and verify: frames, hooks, the paused recording mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fp16lens import watch
from fp16lens._core.compat import dispatch_mode_paused
from fp16lens._trace import Frame, ModuleTracker
from fp16lens.patch._trace import SiteTracer, Trace, traced

import models


class _Island(nn.Sequential):
    fp16lens_fp32 = True


class _Adds(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Island(nn.Linear(4, 4), nn.ReLU())
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        y = self.inner(x) + x
        return self.out(y + 1.0)


def _hooks(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def test_frames_are_named_and_see_the_stack_outside_themselves():
    model = _Adds()
    seen = []

    def enter(frame: Frame, args, kwargs):
        seen.append(("enter", frame.name, frame.leaf, frame.island, frame.fp32, len(tracker.stack)))

    def leave(frame: Frame, args, output):
        seen.append(("leave", frame.name, len(tracker.stack)))

    tracker = ModuleTracker(model, enter, leave)
    before = _hooks(model)
    with tracker:
        model(torch.rand(2, 4))
        assert tracker.stack == [] and tracker.top is None
    assert _hooks(model) == before
    assert seen == [
        ("enter", "", False, False, False, 0),
        ("enter", "inner", False, True, True, 1),
        ("enter", "inner.0", True, False, True, 2),  # inherits the island's FP32
        ("leave", "inner.0", 2),
        ("enter", "inner.1", True, False, True, 2),
        ("leave", "inner.1", 2),
        ("leave", "inner", 1),
        ("enter", "out", True, False, False, 1),
        ("leave", "out", 1),
        ("leave", "", 0),
    ]


def test_frame_numbers_its_functional_ops():
    frame = Frame("layer1", nn.Identity(), False, False, False)
    assert [frame.op_site("add"), frame.op_site("mul"), frame.op_site("add")] == [
        "layer1:add",
        "layer1:mul",
        "layer1:add#2",
    ]
    with pytest.raises(AttributeError):
        frame.name = "other"  # frozen: a frame is read by name, never rewritten


def test_hooks_go_and_stack_empties_when_the_forward_raises():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(5, 2))  # 3 != 5: raises in '1'
    left = []
    tracker = ModuleTracker(model, on_leave=lambda f, a, o: left.append(f.name))
    before = _hooks(model)
    with pytest.raises(RuntimeError), tracker:
        model(torch.rand(2, 4))
    assert left == ["0", "1", ""]  # always_call: every frame is left
    assert tracker.stack == [] and _hooks(model) == before


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_paused_only_when_innermost_and_restored_after_a_raise():
    outer, inner = _Count(), _Count()
    with outer, inner:
        with dispatch_mode_paused(outer) as paused:  # not innermost: left alone
            torch.ones(2) + 1
        assert not paused and outer.ops == inner.ops == 2
        with pytest.raises(ValueError), dispatch_mode_paused(inner) as paused:
            assert paused
            torch.ones(2) + 1  # reaches outer only
            raise ValueError
        assert (outer.ops, inner.ops) == (4, 2)
        torch.ones(2) + 1  # inner is back
        assert (outer.ops, inner.ops) == (6, 4)
    assert torch._C._len_torch_dispatch_stack() == 0


def test_watch_and_verify_name_the_same_sites():
    """One tracker, one naming: every site verify's tracer records is a site of watch's report."""
    model, inputs = models.seed_case()
    model.eval()
    with torch.no_grad(), watch(model) as lens:
        model(*inputs)
    trace = Trace(find_nonfinite=False)
    with torch.no_grad(), traced(model, SiteTracer(trace)):
        model(*inputs)
    names = [s for s, _ in trace.records]
    assert names and set(names) <= set(lens.report.sites)
    assert ":add" in "".join(names)  # functional ops included, not only modules


def test_linear_output_is_recorded_at_its_boundary_and_outputs_stay_identical():
    torch.manual_seed(0)
    model = _Adds().eval()
    x = torch.randn(3, 4) * 100
    ref = model(x)
    with watch(model) as lens:
        got = model(x)
    assert torch.equal(ref, got)
    sites = lens.report.sites
    assert {"inner.0", "out"} <= set(sites) and not any("addmm" in s or ":t" in s for s in sites)
    assert sites["out"].absmax == float(ref.detach().abs().max())
    assert [sites[s].calls for s in ("inner.0", "out")] == [1, 1]  # one event per Linear call
