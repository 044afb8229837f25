"""The verdict of a torch scan checked in real FP16 (``watch/_fp16run.py``), as an ONNX
scan's is (``test_watch_onnx_fp16run.py``): a model whose values all fit FP16 and whose
flushed values reach no log or divide can still be wrong in FP16. Ground truth is the
model's own ``.half()`` on the CPU, run without fp16lens; a clean model keeps its clean
verdict, and what the finding advises (and patch does by itself) fixes the model in
real FP16, also in the file ``fp16lens patch -o`` writes."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp16lens
from fp16lens.cli import main
from fp16lens.report._sections import verdict
from fp16lens.report._triage import next_step


class Squares(nn.Module):
    """lin(x) * 1e-4, squared, times 6e4: most squares fall below 2^-24, and FP16 stores
    them as 0 (no log, no divide after them: only the output misses them)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x) * 1e-4
        return (y * y) * 6e4


class Flushing(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Squares()
        self.head = nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.head(self.block(x))


class Cancelling(nn.Module):
    """(lin(x) + 1000) - 1000: FP16 holds 1000 + y to 0.5, so y keeps about one bit."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return (self.lin(x) + 1000.0) - 1000.0


class Mixed(nn.Module):
    """A tensor made in FP32 inside forward meets the FP16 weights: .half() cannot run."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) @ torch.eye(16)


class Stops(nn.Module):
    """Keeps the scores of lin(x) + 1000 above 1000.3: FP16 holds them to 0.5 and reads the
    threshold as 1000.5, so its output has another length (as a decoder stops elsewhere)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 64)

    def forward(self, x):
        s = self.lin(x) + 1000.0
        return s[s > 1000.3] - 1000.0


class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


def _verdict(report) -> str:
    """The report's verdict line as the terminal shows it (one wide line)."""
    import io

    from rich.console import Console

    console = Console(width=400, record=True, file=io.StringIO())
    console.print(verdict(report))
    return console.export_text()


def _build(cls):
    torch.manual_seed(0)
    return cls().eval(), [torch.randn(4, 16), torch.randn(4, 16)]


@torch.no_grad()
def _real_fp16_cosine(model: nn.Module, x: torch.Tensor) -> float:
    """Ground truth: the model's own .half() on the CPU against its FP32 output."""
    want = model(x).double().flatten()
    got = copy.deepcopy(model).half()(x.half()).double().flatten()
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    return float(F.cosine_similarity(want, got, dim=0))


def test_flushes_that_reach_the_outputs_are_no_clean_verdict_and_patch_follows_the_advice():
    model, batches = _build(Flushing)
    truth = min(_real_fp16_cosine(model, x) for x in batches)
    assert truth < 0.9  # ground truth: real FP16 loses the small squares
    report = fp16lens.scan(model, batches, progress=False)
    assert not report.clean
    (f,) = [f for f in report.findings if f.kind == "fp16-run"]
    assert f.site == "block:mul#2" and f.tensor == "values flushed to 0"
    assert f.peak == pytest.approx(truth, abs=0.02)  # emulated storage against .half()
    assert "fp32_modules=['block']" in f.fix
    assert "fp32_modules=['block']" in next_step(report)  # what the report leads with
    assert _verdict(report).startswith("✗ Flushing: values FP16 flushes to 0: cosine")
    # patch follows the advice by itself: block in FP32, nothing else, proven
    patched = fp16lens.patch(model, report, batches=batches)
    plan = fp16lens.get_plan(patched)
    assert plan.proven and [m for w in plan.widened for m in w.modules] == ["block"]
    assert all(_real_fp16_cosine(patched, x) >= 0.999 for x in batches)
    assert bool((model(batches[0]) == patched(batches[0])).all())  # FP32 unchanged


def test_the_saved_patched_model_keeps_the_fix_in_real_fp16(tmp_path, capsys, monkeypatch):
    """The CLI journey: scan fails the underflow gate, patch -o with the batches writes a
    file that keeps the fix when torch alone loads it and runs it in FP16."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    src = tmp_path / "flushing.py"
    src.write_text(
        "import torch\nfrom test_watch_fp16run import Flushing\n\n\n"
        "def build():\n    torch.manual_seed(0)\n    return Flushing().eval()\n"
    )
    model, batches = _build(Flushing)  # the same weights: the same seed
    torch.save(batches[0], tmp_path / "x.pt")
    x, report, out = str(tmp_path / "x.pt"), str(tmp_path / "r.json"), tmp_path / "fixed.pt"
    scan = ["scan", f"{src}:build", "--input", x, "--save", report]
    assert main([*scan, "--fail-on", "underflow", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert any(line.startswith("fp16-run at block:mul#2") for line in data["failed"])
    assert main(["patch", f"{src}:build", "--report", report, "--input", x, "-o", str(out)]) == 0
    capsys.readouterr()
    saved = torch.jit.load(str(out))
    with torch.no_grad():  # the file the user takes home, run by torch alone in FP16
        got = saved.half()(batches[0].half()).double().flatten()
        want = model(batches[0]).double().flatten()
    assert float(F.cosine_similarity(want, got, dim=0)) >= 0.999


def test_precision_loss_is_named_as_precision():
    model, batches = _build(Cancelling)
    assert _real_fp16_cosine(model, batches[0]) < 0.99
    report = fp16lens.scan(model, batches, progress=False)
    (f,) = [f for f in report.findings if f.kind == "fp16-run"]
    assert f.tensor == "precision" and "11 significant bits" in f.detail


def test_a_forward_that_half_cannot_run_is_no_clean_verdict():
    model, batches = _build(Mixed)
    with pytest.raises(RuntimeError):  # ground truth
        copy.deepcopy(model).half()(batches[0].half())
    report = fp16lens.scan(model, batches, progress=False)
    (f,) = [f for f in report.findings if f.kind == "fp16-run"]
    assert "cannot run in FP16" in f.detail and "dtype=x.dtype" in f.fix
    assert f.tensor == "half fails"  # what the verdict line reads, not the detail's words
    assert _verdict(report).startswith("✗ Mixed: cannot run in FP16,")


class MadeInForward(nn.Module):
    """``lin(x)`` through one op that also reads a float tensor the forward makes in FP32
    (``torch.tensor``, ``torch.ones``): under ``.half()`` the op meets FP16 and FP32."""

    def __init__(self, op):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.op = op

    def forward(self, x):
        return self.op(self.lin(x))


def _grid(y):
    grid = torch.zeros(4, 2, 2, 2)  # FP32 sampling positions
    return F.grid_sample(y.view(4, 1, 4, 4), grid, align_corners=False).flatten(1)


def _lstm_cell(y):
    w_ih, w_hh = torch.full((16, 16), 0.01), torch.full((16, 4), 0.01)
    return torch.lstm_cell(y, (y[:, :4], y[:, :4]), w_ih, w_hh)[0]


MIXED_OPS = {  # op: whether the CPU's .half() refuses it (checked against .half() below)
    "prelu": (lambda y: F.prelu(y, torch.tensor([0.25])), True),
    "grid_sample": (_grid, True),
    "index_add": (lambda y: y.index_add(0, torch.tensor([0]), torch.ones(1, 16)), True),
    "lstm_cell": (_lstm_cell, True),
    "where": (lambda y: torch.where(y > 0, y, torch.zeros(16)), False),
    "cat": (lambda y: torch.cat([y, torch.ones(4, 16)], 1), False),
    "layer_norm": (lambda y: F.layer_norm(y, (16,), torch.ones(16), torch.zeros(16)), False),
    "mul": (lambda y: y * torch.full((16,), 2.0), False),
}


@pytest.mark.parametrize("name", list(MIXED_OPS))
def test_an_op_that_refuses_two_dtypes_under_half_is_found_as_half_finds_it(name):
    """Meta kernels accept what real ones refuse (prelu, grid_sample, index_add,
    lstm_cell with FP32 operands made in forward): the verdict's check says "cannot run
    in FP16" exactly where the model's own ``.half()`` raises, and keeps a clean verdict
    where ``.half()`` promotes and runs."""
    op, refuses = MIXED_OPS[name]
    torch.manual_seed(0)
    model, x = MadeInForward(op).eval(), torch.randn(4, 16)
    try:  # ground truth, without fp16lens
        with torch.no_grad():
            copy.deepcopy(model).half()(x.half())
        raised = False
    except RuntimeError:
        raised = True
    assert raised is refuses
    report = fp16lens.scan(model, [x], progress=False)
    found = [f for f in report.findings if f.kind == "fp16-run"]
    assert [f.tensor for f in found] == (["half fails"] if refuses else []), found
    assert report.clean is not refuses


def test_an_output_whose_length_fp16_changes_is_named_so_and_patch_proves_the_fix():
    """Not 'inf/NaN at ?': the output's shape, FP16's against FP32's (ground truth: the
    model's own .half()); patch with batches keeps FP32 what it must and the fixed model's
    .half() gives FP32's length."""
    model, batches = _build(Stops)
    with torch.no_grad():
        want, half = model(batches[0]), copy.deepcopy(model).half()(batches[0].half())
    assert want.shape != half.shape  # ground truth
    report = fp16lens.scan(model, batches, progress=False)
    (f,) = [f for f in report.findings if f.kind == "fp16-run"]
    assert f.tensor == "output shape" and "inf/NaN" not in f.detail
    assert f"is {tuple(half.shape)} in FP16 against {tuple(want.shape)} in FP32" in f.detail
    assert _verdict(report).startswith("✗ Stops: an output's length changes in real FP16,")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it says it kept the whole model FP32
        patched = fp16lens.patch(model, report, batches=batches)
    assert fp16lens.get_plan(patched).proven
    with torch.no_grad():
        assert copy.deepcopy(patched).half()(batches[0].half()).shape == want.shape


@pytest.mark.parametrize("training", [False, True])
def test_a_clean_model_keeps_its_clean_verdict(training):
    model, batches = _build(Clean)
    assert all(_real_fp16_cosine(model, x) >= 0.999 for x in batches)  # ground truth
    model.train(training)
    report = fp16lens.scan(model, batches, progress=False)
    assert report.clean and not report.findings
    assert model.training is training  # the check ran on a copy


def test_in_training_mode_the_check_runs_as_deployed():
    """Dropout makes two training-mode runs differ: the check compares eval with eval."""
    model, batches = _build(Flushing)
    model.block = nn.Sequential(nn.Dropout(0.5), model.block)
    model.train()
    report = fp16lens.scan(model, batches, progress=False)
    (f,) = [f for f in report.findings if f.kind == "fp16-run"]
    assert f.site == "block.1:mul#2" and model.training


def test_a_watch_block_checks_its_clean_verdict_and_leaves_nothing_behind():
    model, batches = _build(Flushing)
    with torch.no_grad():
        plain = [model(x) for x in batches]
    with fp16lens.watch(model) as lens, torch.no_grad():
        seen = [model(x) for x in batches]
    assert all(bool((a == b).all()) for a, b in zip(plain, seen))  # bit-identical
    (f,) = [f for f in lens.report.findings if f.kind == "fp16-run"]
    assert f.site == "block:mul#2"
    assert not model._forward_hooks and not model._forward_hooks_with_kwargs
    with pytest.raises(RuntimeError), fp16lens.watch(model):
        model(torch.randn(4, 15))  # the forward raises: the hook goes all the same
    assert not model._forward_hooks and not model._forward_hooks_with_kwargs


def test_a_compiled_scan_checks_its_clean_verdict_too():
    model, batches = _build(Flushing)
    report = fp16lens.scan(model, batches * 2, progress=False, compile=True)
    (f,) = [f for f in report.findings if f.kind == "fp16-run"]
    assert f.site == "block:mul#2" and "fp32_modules=['block']" in f.fix


class OneRun(nn.Module):
    """A forward that refuses a second run (a stateful model): the check cannot run."""

    runs = 0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        OneRun.runs += 1
        if OneRun.runs > 1:
            raise RuntimeError("this model runs once")
        return self.lin(x)


def test_a_verdict_the_check_cannot_run_says_so_and_the_scan_still_ends():
    model, batches = _build(OneRun)
    report = fp16lens.scan(model, batches[:1], progress=False)
    (f,) = report.findings
    assert (f.mechanism, f.kind) == ("note", "unchecked") and "runs once" in f.detail
    assert _verdict(report).startswith("? OneRun: ") and "not checked in real FP16" in (
        _verdict(report)
    )


class Edge(nn.Module):
    """An output length that the inputs' last bits decide (a decoder on inputs it was not
    trained for): FP32 itself changes it when the input moves by FP16's resolution."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        n = 4 + int(y.sum() * 1e4) % 9
        return y.flatten()[:n]


def test_where_fp32_itself_changes_the_length_under_fp16s_resolution_scan_and_patch_say_so():
    model, batches = _build(Edge)
    with torch.no_grad():  # ground truth: real FP16's length is not FP32's
        assert any(model(x).shape != copy.deepcopy(model).half()(x.half()).shape for x in batches)
    calls = []  # True: the user's model itself; False: a copy, which keeps the model's hooks
    hook = model.register_forward_hook(lambda m, *_: calls.append(m is model))
    report = fp16lens.scan(model, batches, progress=False)
    (f,) = [f for f in report.findings if f.kind == "fp16-run"]
    assert f.tensor == "output shape" and "FP32 itself gives another length on" in f.detail
    assert calls.count(True) == len(batches)  # the check and its draws ran on copies
    assert calls.count(False) > 0  # (docs/watch.md: a recording hook sees the check's run)
    hook.remove()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = fp16lens.patch(model, report, batches=batches)
    said = " ".join(str(w.message) for w in caught)
    assert not fp16lens.get_plan(patched).proven
    assert "FP32 itself gives another length on" in said and "in FP16 against" in said


class Drift(nn.Module):
    """``test_watch_onnx_fp16run``'s drift graph as a module: ``sigmoid(40 * (1.001 x - x)
    - 18)`` loses its input to FP16's rounding on raw pixels (and on black pixels the
    sigmoid module's 1.5e-8 flushes to 0: a flush, not what loses the output), and the
    mean over 4096 pixels sums past 65504 first (a risk inside the op, the only thing the
    scan names otherwise)."""

    def __init__(self):
        super().__init__()
        self.act = nn.Sigmoid()

    def forward(self, x):
        return self.act(40 * (x * 1.001 - x) - 18), x.mean(dim=(2, 3))


def test_a_report_of_only_internal_risks_is_checked_in_fp16():
    x = torch.randint(128, 256, (1, 1, 64, 64)).float()
    x[..., :8, :] = 0  # black rows: the sigmoid's outputs there flush to 0 in FP16
    model = Drift().eval()
    with torch.no_grad():
        want = model(x)[0].double()
        half = model.half()(x.half())[0].double()  # ground truth: the model's own .half()
    model.float()
    truth = F.cosine_similarity(want.flatten(), half.flatten(), dim=0).item()
    assert truth < 0.99
    assert (half[..., :8, :] == 0).all() and (want[..., :8, :] > 0).all()  # the flush
    with torch.no_grad():
        kept = torch.sigmoid(40 * (x.half() * 1.001 - x.half()).double() - 18)
    assert F.cosine_similarity(want.flatten(), kept.flatten(), dim=0).item() < 0.99  # not it
    with fp16lens.watch(model) as lens:
        model(x)
    kinds = sorted(f.kind for f in lens.report.findings)
    assert kinds == ["fp16-run", "sum-before-mean"], kinds
    (run,) = [f for f in lens.report.findings if f.kind == "fp16-run"]
    assert run.tensor == "precision" and run.peak == pytest.approx(truth, abs=1e-2)
    assert "the input reaches 255" in run.detail and "inside ops" in run.detail
    assert "rescale" not in next_step(lens.report)


def test_the_input_peak_reads_float_inputs_only():
    """Token ids reach 30000 and are no unnormalized input: only float inputs count."""
    from fp16lens.watch.onnx._fp16run import input_peak

    ids, x = torch.tensor([[101, 30000]]), torch.tensor([[0.5, -1.5]])
    assert input_peak([ids, x]) == 1.5
    assert input_peak([ids.numpy(), x.numpy(), x.bfloat16()]) == 1.5
    assert input_peak([ids]) == 0.0
