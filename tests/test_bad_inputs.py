"""Bad inputs across the stages: each gives a named error (an Fp16LensError subclass, or
ValueError for option validation) whose message names the problem AND the fix, and each
leaves the user's model exactly as it was (state_dict tensors, hooks, training flag)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import fp16lens
from fp16lens import Report
from fp16lens._core import (
    ExportError,
    Fp16LensError,
    MissingDependencyError,
    PatchError,
    ReportError,
    VerifyError,
    WatchError,
)

import models

# ---- helpers -------------------------------------------------------------------------


def _snapshot(model: nn.Module) -> tuple:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hooks = [
        (n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), m.training)
        for n, m in model.named_modules()
    ]
    return state, hooks, torch._C._len_torch_dispatch_stack()


def _assert_untouched(model: nn.Module, snap: tuple) -> None:
    state, hooks, depth = snap
    now, now_hooks, now_depth = _snapshot(model)
    assert now.keys() == state.keys()
    for k in state:
        assert now[k].dtype == state[k].dtype and torch.equal(now[k], state[k]), k
    assert now_hooks == hooks
    assert now_depth == depth
    assert getattr(model, "_fp16lens_plan", None) is None


def _report(model, inputs) -> Report:
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(*inputs)
    return lens.report


def _leaves(x) -> list:
    return [t for t in torch.utils._pytree.tree_flatten(x)[0] if torch.is_tensor(t)]


def _has_fix(message: str, *words: str) -> None:
    """The message names the problem (``words``) and says what to do."""
    low = message.lower()
    for w in words:
        assert w.lower() in low, f"{w!r} not in {message!r}"
    verbs = (
        "pass ",
        "use ",
        "call ",
        "install",
        "re-create",
        "create ",
        "choose",
        "load ",
        "watch ",
        "such as",
        "check ",
    )
    assert any(v in low for v in verbs), f"no fix named in {message!r}"


@pytest.fixture
def relu_case():
    model, inputs = models.relu_span()
    return model, inputs, _report(model, inputs)


# ---- not a module ----------------------------------------------------------------------


NOT_MODULES = [
    pytest.param(lambda m: m.state_dict(), id="state_dict"),
    pytest.param(lambda m: "model.pt", id="path"),
    pytest.param(lambda m: m.fc1.weight, id="tensor"),
]


@pytest.mark.parametrize("make", NOT_MODULES)
def test_watch_refuses_what_is_not_a_module(make):
    model, _ = models.relu_span()
    with pytest.raises(WatchError) as info:
        fp16lens.watch(make(model))
    _has_fix(str(info.value), "nn.Module")


@pytest.mark.parametrize("make", NOT_MODULES)
def test_patch_and_plan_refuse_what_is_not_a_module(make, relu_case):
    model, _, report = relu_case
    for fn in (fp16lens.patch, fp16lens.plan):
        with pytest.raises(PatchError) as info:
            fn(make(model), report)
        _has_fix(str(info.value), "nn.Module")


@pytest.mark.parametrize("make", NOT_MODULES)
def test_export_refuses_what_is_not_a_module(make, tmp_path, relu_case):
    model, inputs, _ = relu_case
    with pytest.raises(Fp16LensError) as info:
        fp16lens.export(make(model), inputs, tmp_path / "m.onnx")
    _has_fix(str(info.value), "nn.Module")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("make", NOT_MODULES)
def test_verify_refuses_what_is_not_a_module(make, relu_case):
    model, inputs, _ = relu_case
    snap = _snapshot(model)
    with pytest.raises(Fp16LensError) as info:
        fp16lens.verify(make(model), model, inputs)
    _has_fix(str(info.value), "nn.Module")
    with pytest.raises(Fp16LensError) as info:
        fp16lens.verify(model, make(model), inputs, backend="torch-fp16")
    _has_fix(str(info.value), "nn.Module")
    _assert_untouched(model, snap)


# ---- forwards that raise, and odd outputs ---------------------------------------------


class RaisesInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        return self.fc(self.conv(x).relu())  # fc gets 4x4 planes of width 4: shape error


def test_forward_that_raises_keeps_its_error_names_last_site_and_cleans_up():
    model = RaisesInside().eval()
    snap = _snapshot(model)
    with pytest.raises(RuntimeError) as info, torch.no_grad(), fp16lens.watch(model):
        model(torch.rand(1, 3, 4, 4))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "'fc'" in notes, notes  # the module that was running when it raised
    _assert_untouched(model, snap)
    with torch.no_grad(), fp16lens.watch(model) as lens:  # watchable again afterwards
        model.conv(torch.rand(1, 3, 4, 4))
    assert "conv" in lens.report.sites


@dataclasses.dataclass
class Heads:
    logits: torch.Tensor
    boxes: torch.Tensor
    extra: object = None


class OddOutputs(nn.Module):
    """Outputs of every odd kind: None, dict, dataclass, nested lists/tuples, ints, bools,
    complex, empty tensors, and a Python number; integer/bool inputs beside the float one."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, idx=None, mask=None):
        y = self.conv(x).relu()
        z = self.fc(y.mean((2, 3)))
        if idx is not None:
            z = z + idx.float().sum() * 0
        if mask is not None:
            z = torch.where(mask, z, torch.zeros_like(z))
        if self.kind == "none":
            return None
        if self.kind == "dict":
            return {"z": z, "inner": {"y": y, "none": None}}
        if self.kind == "dataclass":
            return Heads(z, y, extra=7)
        if self.kind == "nested":
            return [z, (y, [z * 2, None]), 3.5]
        if self.kind == "odd_dtypes":
            return (
                z.argmax(1),  # int64
                z > 0,  # bool
                torch.complex(z, z),  # complex64
                z[:0],  # empty float
                y.to(torch.int32),
                z,
            )
        raise AssertionError(self.kind)


def _odd_inputs():
    g = torch.Generator().manual_seed(0)
    return (
        torch.rand(2, 3, 4, 4, generator=g),
        torch.arange(6).reshape(2, 3),
        torch.tensor([[True, False, True], [False, True, True]]),
    )


def _same_outputs(a, b) -> bool:
    if dataclasses.is_dataclass(a):
        return _same_outputs(dataclasses.asdict(a), dataclasses.asdict(b))
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb)
    )


@pytest.mark.parametrize("kind", ["none", "dict", "dataclass", "nested", "odd_dtypes"])
def test_watch_takes_odd_outputs_and_odd_input_dtypes_bit_identically(kind):
    model = OddOutputs(kind).eval()
    inputs = _odd_inputs()
    snap = _snapshot(model)
    with torch.no_grad():
        ref = model(*inputs)
        with fp16lens.watch(model) as lens:
            got = model(*inputs)
    assert _same_outputs(ref, got)
    _assert_untouched(model, snap)
    report = lens.report
    assert {"conv", "fc"} <= set(report.sites)
    assert report.clean  # nothing here comes near FP16's limits
    assert Report.from_dict(json.loads(report.to_json())) == report


def test_empty_input_tensor_is_watched_not_crashed():
    model, _ = models.relu_span()
    snap = _snapshot(model)
    with torch.no_grad(), fp16lens.watch(model) as lens:
        out = model(torch.rand(0, 16))
    assert out.shape == (0, 8)
    _assert_untouched(model, snap)
    assert lens.report.spans == []  # no values, nothing overflows


def test_complex_and_int_only_model_is_watched():
    class Spectral(nn.Module):
        def forward(self, x, n, z):
            return torch.fft.rfft(x) * 2, n + 1, (z * 1.0e6).abs()

    model = Spectral()
    x, z = torch.rand(2, 8), torch.complex(torch.rand(3), torch.rand(3))
    with torch.no_grad(), fp16lens.watch(model) as lens:
        spec, n, mag = model(x, torch.tensor(3), z)
    assert torch.equal(spec, torch.fft.rfft(x) * 2) and int(n) == 4
    assert torch.equal(mag, (z * 1.0e6).abs())
    # .half() leaves a complex64 input alone, so its magnitude is FP32 there: no overflow
    assert lens.report.spans == []
    # counted as an FP16 tensor (an FP16 graph), the magnitude overflows
    with torch.no_grad(), fp16lens.watch(model, half_dtypes=False) as lens:
        model(x, torch.tensor(3), z)
    assert [s.start for s in lens.report.spans] == [":abs"], lens.report.spans
    half = (z * 1.0e6).abs()  # what .half() computes there: complex64 in, FP32 out
    assert half.dtype == torch.float32 and torch.isfinite(half).all()


@pytest.mark.parametrize("kind", ["dict", "nested"])
def test_patch_takes_a_model_with_structured_outputs(kind):
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, _ = models.relu_span()

        def forward(self, x):
            out = self.inner(x)
            return {"out": out, "none": None} if kind == "dict" else [(out,), None]

    model = Wrapped().eval()
    inputs = (torch.rand(4, 16) * 2 + 1,)
    report = _report(model, inputs)
    assert report.spans
    snap = _snapshot(model)
    patched = fp16lens.patch(model, report)
    _assert_untouched(model, snap)
    with torch.no_grad():
        want, got = _leaves(model(*inputs)), _leaves(patched(*inputs))
        half = _leaves(copy.deepcopy(patched).half()(inputs[0].half()))
    assert fp16lens.patch.relative_error(want[0], got[0]) <= 1e-6
    assert torch.isfinite(half[0]).all()


# ---- non-finite inputs ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_an_input_problem_not_model_overflow(bad):
    model, (x,) = models.relu_span()
    x = x.clone()
    x[0, 3] = bad
    snap = _snapshot(model)
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(x)
    _assert_untouched(model, snap)
    report = lens.report
    inputs = [f for f in report.findings if f.mechanism == "input"]
    assert inputs and inputs[0].site == "input[0]", report.findings
    assert ("nan" if bad != bad else "inf") in (inputs[0].kind + inputs[0].detail).lower()
    # the model's own overflow (fc1 > 65504 on finite rows) is still found, and nothing
    # that only carries the bad value onwards is blamed as overflow of its own
    assert [s.start for s in report.spans] == ["fc1"]
    model_findings = [f for f in report.findings if f.mechanism not in ("input", "note")]
    assert all(f.site in ("fc1",) or f.kind != "nan" for f in model_findings), model_findings


def test_non_finite_input_on_a_clean_model_gives_no_span():
    model, (x,) = models.clean()
    x = x.clone()
    x[0, 1, 2, 2] = float("inf")
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(x)
    assert any(f.mechanism == "input" for f in lens.report.findings)
    assert lens.report.spans == [], lens.report.spans


# ---- patch preconditions ----------------------------------------------------------------


def test_patch_refuses_a_model_in_training_mode():
    model, inputs = models.bn_huge_var()  # a batch norm: training mode changes what it computes
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(*inputs)
    report = lens.report
    model.train()
    snap = _snapshot(model)
    with pytest.raises(PatchError) as info:
        fp16lens.patch(model, report)
    _has_fix(str(info.value), "training")
    assert "model.eval()" in str(info.value) and "((" not in str(info.value)
    _assert_untouched(model, snap)
    assert model.training


def test_every_stage_refuses_a_model_already_in_float16(relu_case, tmp_path):
    model, (x,), report = relu_case
    half = copy.deepcopy(model).half()
    # why: its values are FP16's own, inf where FP32 goes past 65504 (ground truth), so a
    # watch of it would read FP16's result instead of how far FP32 goes
    assert torch.isfinite(model(x)).all() and not torch.isfinite(half(x.half())).all()
    snap = _snapshot(half)
    with pytest.raises(WatchError) as info, fp16lens.watch(half):
        half(x.half())
    _has_fix(str(info.value), "float16", "model.float()")
    with pytest.raises(PatchError) as info:
        fp16lens.patch(half, report)
    _has_fix(str(info.value), "float16", "model.float()")
    with pytest.raises(ExportError) as info:  # its file's FP16 check needs FP32 outputs
        fp16lens.export(half, (x.half(),), tmp_path / "h.onnx", precision="fp16")
    _has_fix(str(info.value), "float16", "model.float()")
    with pytest.raises(VerifyError) as info:  # the reference is the FP32 model
        fp16lens.verify(half, model, [x])
    _has_fix(str(info.value), "float16", "model.float()")
    _assert_untouched(half, snap)
    assert not list(tmp_path.iterdir())
    # a bfloat16 model holds FP32's range: it is watched, and its span found
    bf16 = copy.deepcopy(model).bfloat16()
    assert [s.start for s in _report(bf16, (x.bfloat16(),)).spans] == ["fc1"]


@pytest.mark.parametrize(
    "factor", [0, 0.0, -4.0, float("inf"), -float("inf"), float("nan"), 3.0, 48, 1e-300, True, "64"]
)
def test_patch_refuses_a_bad_factor(factor, relu_case):
    model, _, report = relu_case
    snap = _snapshot(model)
    with pytest.raises((PatchError, ValueError)) as info:
        fp16lens.patch(model, report, factor=factor)
    _has_fix(str(info.value), "factor")
    _assert_untouched(model, snap)


def test_patch_refuses_a_report_from_another_model(relu_case):
    model, _, _ = relu_case
    other, inputs = models.bn_huge_var()
    snap = _snapshot(model)
    with pytest.raises(PatchError) as info:
        fp16lens.patch(model, _report(other, inputs))
    _has_fix(str(info.value), "another model")
    _assert_untouched(model, snap)


def test_patch_refuses_a_report_of_a_renamed_model(relu_case):
    model, _, report = relu_case
    data = json.loads(report.to_json())
    renamed = json.loads(json.dumps(data).replace('"fc1"', '"encoder.fc1"'))
    snap = _snapshot(model)
    with pytest.raises(PatchError) as info:
        fp16lens.patch(model, Report.from_dict(renamed))
    _has_fix(str(info.value), "another model")
    _assert_untouched(model, snap)


def test_patch_refuses_what_is_not_a_report(relu_case):
    model, _, report = relu_case
    with pytest.raises(PatchError) as info:
        fp16lens.patch(model, report.to_dict())
    _has_fix(str(info.value), "Report")


# ---- report files ---------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path, relu_case):
    _, _, report = relu_case
    return report, report.save(tmp_path / "r.json")


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.99])
def test_truncated_report_is_named(saved, keep):
    _, path = saved
    text = path.read_text()
    path.write_text(text[: int(len(text) * keep)])
    with pytest.raises(ReportError) as info:
        Report.load(path)
    _has_fix(str(info.value), str(path))


EDITS = {
    "missing_sites": lambda d: d.pop("sites"),
    "unknown_field": lambda d: d["sites"][0].update(colour="red"),
    "dropped_field": lambda d: d["sites"][0].pop("name"),
    "absmax_text": lambda d: d["sites"][0].update(absmax="huge"),
    "calls_text": lambda d: d["sites"][0].update(calls="many"),
    "span_unknown_site": lambda d: d["spans"][0].update(start="nowhere"),
    "span_sites_not_list": lambda d: d["spans"][0].update(sites=5),
    "edge_of_three": lambda d: d["edges"].append(["fc1", "act", "fc2"]),
    "edge_unknown_site": lambda d: d["edges"].append(["fc1", "ghost"]),
    "sites_not_list": lambda d: d.update(sites={"fc1": 1}),
    "meta_null": lambda d: d.update(meta=None),
    "schema_text": lambda d: d.update(schema_version="two"),
    "top_level_list": None,
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_hand_edited_report_is_named(saved, edit):
    _, path = saved
    data = json.loads(path.read_text())
    if EDITS[edit] is None:
        data = [data]
    else:
        EDITS[edit](data)
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError) as info:
        Report.load(path)
    _has_fix(str(info.value))


def test_missing_report_file_is_named(tmp_path):
    with pytest.raises(ReportError) as info:
        Report.load(tmp_path / "nope.json")
    _has_fix(str(info.value), "nope.json")


def _unwritable(tmp_path, suffix: str) -> list:
    """Paths no file can be written to: under a file, an existing folder, a read-only folder."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    paths = [blocker / f"r{suffix}", tmp_path]
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        paths.append(ro / f"r{suffix}")
    return paths


def test_report_save_to_an_unwritable_path_is_named(tmp_path, saved):
    report, _ = saved
    for target in _unwritable(tmp_path, ".json"):
        with pytest.raises(ReportError) as info:
            report.save(target)
        _has_fix(str(info.value), "cannot")
    # a missing folder is made, as export, patch and demo make theirs (one rule for outputs)
    assert Report.load(report.save(tmp_path / "missing_dir" / "r.json")) == report


def test_export_to_an_unwritable_path_is_named_before_exporting(tmp_path, relu_case, monkeypatch):
    pytest.importorskip("onnx")
    import fp16lens.export._export as ex

    model, inputs, _ = relu_case
    snap = _snapshot(model)

    def no_export(*a, **k):
        raise AssertionError("the path is checked before the slow export")

    monkeypatch.setattr(ex, "_export_fp32", no_export)
    for target in _unwritable(tmp_path, ".onnx"):
        with pytest.raises(Fp16LensError) as info:
            fp16lens.export(model, inputs, target)
        _has_fix(str(info.value), str(target), "writable")
    _assert_untouched(model, snap)
    monkeypatch.undo()
    art = fp16lens.export(model, inputs, tmp_path / "new_dir" / "m.onnx")  # a new folder is made
    assert art.path.exists()


# ---- optional dependency missing -------------------------------------------------------


def _run_without(module: str, code: str) -> subprocess.CompletedProcess:
    prelude = f"import sys; sys.modules[{module!r}] = None\n"
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_export_without_onnx_names_the_extra(tmp_path):
    out = tmp_path / "m.onnx"
    proc = _run_without(
        "onnx",
        f"""
        import torch, fp16lens
        from fp16lens._core import MissingDependencyError
        model = torch.nn.Linear(4, 2).eval()
        try:
            fp16lens.export(model, (torch.rand(1, 4),), {str(out)!r})
        except MissingDependencyError as exc:
            print("MDE:", exc)
        else:
            print("NO ERROR")
    """,
    )
    assert proc.returncode == 0, proc.stderr
    assert "MDE:" in proc.stdout, proc.stdout + proc.stderr
    assert "pip install -e '.[onnx]'" in proc.stdout
    assert not out.exists()


def test_verify_onnx_without_onnxruntime_names_the_extra(tmp_path):
    pytest.importorskip("onnx")
    model = nn.Linear(4, 2).eval()
    x = torch.rand(1, 4)
    art = fp16lens.export(model, (x,), tmp_path / "m.onnx")
    torch.save(model, tmp_path / "m.pt")
    proc = _run_without(
        "onnxruntime",
        f"""
        import torch, fp16lens
        from fp16lens._core import MissingDependencyError
        model = torch.load({str(tmp_path / "m.pt")!r}, weights_only=False)
        try:
            fp16lens.verify(model, {str(art.path)!r}, torch.rand(1, 4))
        except MissingDependencyError as exc:
            print("MDE:", exc)
    """,
    )
    assert "MDE:" in proc.stdout, proc.stdout + proc.stderr
    assert "pip install -e '.[" in proc.stdout


def test_missing_dependency_error_is_an_import_error_too():
    exc = MissingDependencyError("onnx", "onnx", "export")
    assert isinstance(exc, ImportError) and isinstance(exc, Fp16LensError)


# ---- watch contexts -----------------------------------------------------------------


def test_nested_watch_on_the_same_model_is_refused_and_outer_survives():
    model, inputs = models.relu_span()
    snap = _snapshot(model)
    with torch.no_grad(), fp16lens.watch(model) as outer:
        with pytest.raises(WatchError) as info, fp16lens.watch(model):
            pass
        _has_fix(str(info.value), "already being watched")
        model(*inputs)
    assert outer.report.spans and outer.report.spans[0].start == "fc1"
    _assert_untouched(model, snap)


def test_watch_of_a_submodule_inside_a_watched_model_is_refused_or_works():
    """Two blocks on different models are independent (statistics of each are its own)."""
    model, inputs = models.relu_span()
    other, other_inputs = models.clean()
    with torch.no_grad(), fp16lens.watch(model) as a, fp16lens.watch(other) as b:
        model(*inputs)
        other(*other_inputs)
    assert set(a.report.sites) >= {"fc1", "act", "fc2"}
    assert "fc1" not in b.report.sites and "fc" in b.report.sites
    assert a.report.spans and not b.report.spans


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_watch_under_grad_modes(mode):
    model, inputs = models.relu_span()
    ctx = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "grad": torch.enable_grad,
    }[mode]
    snap = _snapshot(model)
    with ctx():
        ref = model(*inputs)
        with fp16lens.watch(model) as lens:
            got = model(*inputs)
    assert torch.equal(ref, got)
    assert [s.start for s in lens.report.spans] == ["fc1"]
    _assert_untouched(model, snap)


def test_watch_refuses_a_compiled_model_and_names_orig_mod():
    model, _ = models.relu_span()
    compiled = torch.compile(model)
    with pytest.raises(WatchError) as info:
        fp16lens.watch(compiled)
    _has_fix(str(info.value), "model._orig_mod")
    assert not model._forward_hooks


def test_report_before_the_block_ran_is_named():
    model, _ = models.relu_span()
    lens = fp16lens.watch(model)
    with pytest.raises(WatchError) as info:
        lens.report
    _has_fix(str(info.value), "no report")


def test_watch_option_validation_is_a_value_error():
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError) as info:
            fp16lens.WatchOptions(threshold=bad)
        assert "threshold" in str(info.value)
