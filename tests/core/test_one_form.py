"""One shape for every entry point: ``options=XOptions(...)`` or the same fields as
keywords, the same result either way, and one error (naming the fix) for both at once or
for a keyword that is not an option."""

from __future__ import annotations

import pytest

import fp16lens
from fp16lens import ExportOptions, PatchOptions, VerifyOptions, WatchOptions
from fp16lens._core import Fp16LensError, OptionError

from models import gelu_span

pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def case():
    model, (x,) = gelu_span()
    x = x * 3000  # the GELU span overflows FP16
    report = fp16lens.scan(model, [x], progress=False)
    assert report.spans
    return model, x, report


def _same_reports(a, b) -> bool:
    return a.to_dict() == b.to_dict()


def test_watch_and_scan_take_either_form(case, tmp_path):
    model, x, _ = case
    by_kw = fp16lens.scan(model, [x], progress=False, threshold=0.25)
    by_opt = fp16lens.scan(model, [x], progress=False, options=WatchOptions(threshold=0.25))
    assert _same_reports(by_kw, by_opt) and by_kw.meta.threshold == 0.25
    with fp16lens.watch(model, options=WatchOptions(threshold=0.25)) as lens:
        model(x)
    assert lens.report.meta.threshold == 0.25
    # an ONNX file takes the same form (it raised TypeError once)
    path = tmp_path / "g.onnx"
    fp16lens.export(model, (x,), path, "fp32")
    on_kw = fp16lens.scan(str(path), [x.numpy()], progress=False, threshold=0.25)
    on_opt = fp16lens.scan(
        str(path), [x.numpy()], progress=False, options=WatchOptions(threshold=0.25)
    )
    assert _same_reports(on_kw, on_opt)


def test_patch_and_plan_take_either_form(case):
    model, _, report = case
    a = fp16lens.plan(model, report, factor=16.0)
    b = fp16lens.plan(model, report, options=PatchOptions(factor=16.0))
    assert a.regions and [r.factor for r in a.regions] == [r.factor for r in b.regions] == [16.0]


def test_export_and_retype_take_either_form(case, tmp_path):
    model, x, _ = case
    a = fp16lens.export(model, (x,), tmp_path / "a.onnx", "fp16", fp32_modules=["act"])
    b = fp16lens.export(
        model, (x,), tmp_path / "b.onnx", options=ExportOptions("fp16", fp32_modules=("act",))
    )
    assert a.node_map == b.node_map and a.fp32_nodes == b.fp32_nodes and a.fp32_nodes
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    src = fp16lens.export(model, (x,), tmp_path / "src.onnx", "fp32").path
    c = fp16lens.export.retype(src, tmp_path / "c.onnx", fp32_modules=["act"])
    d = fp16lens.export.retype(
        src, tmp_path / "d.onnx", options=ExportOptions(fp32_modules=("act",))
    )
    assert c.fp32_nodes == d.fp32_nodes == a.fp32_nodes


def test_verify_takes_either_form(case):
    model, x, _ = case
    a = fp16lens.verify(model, model, [x], "torch-fp16", 0.99)
    b = fp16lens.verify(model, model, [x], options=VerifyOptions("torch-fp16", 0.99))
    assert not a.passed and not b.passed  # the span overflows in real FP16
    assert a.to_dict() == b.to_dict() and a.tolerance.min_cosine == 0.99


ENTRY_CALLS = {
    "watch": lambda m, x, r, p, o: fp16lens.watch(m, options=o(WatchOptions), threshold=0.5),
    "scan": lambda m, x, r, p, o: fp16lens.scan(m, [x], options=o(WatchOptions), threshold=0.5),
    "scan(compile=True)": lambda m, x, r, p, o: fp16lens.scan(
        m, [x], compile=True, options=o(WatchOptions), threshold=0.5
    ),
    "scan(onnx)": lambda m, x, r, p, o: fp16lens.scan(
        "m.onnx", [x], options=o(WatchOptions), threshold=0.5
    ),
    "plan": lambda m, x, r, p, o: fp16lens.plan(m, r, options=o(PatchOptions), factor=2.0),
    "patch": lambda m, x, r, p, o: fp16lens.patch(m, r, options=o(PatchOptions), factor=2.0),
    "export": lambda m, x, r, p, o: fp16lens.export(
        m, (x,), p, options=o(ExportOptions), io_dtype="fp16"
    ),
    "retype": lambda m, x, r, p, o: fp16lens.export.retype(
        p, p, options=o(ExportOptions), io_dtype="fp16"
    ),
    "verify": lambda m, x, r, p, o: fp16lens.verify(
        m, m, [x], options=o(VerifyOptions), fusions=True
    ),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_CALLS))
def test_both_forms_at_once_is_one_error_naming_the_fix(case, tmp_path, entry):
    model, x, report = case
    with pytest.raises(
        Fp16LensError,
        match=r"pass either options=\w+Options\(\.\.\.\) or keyword options, not both",
    ):
        ENTRY_CALLS[entry](model, x, report, tmp_path / "m.onnx", lambda cls: cls())


@pytest.mark.parametrize(
    ("call", "cls"),
    [
        (lambda m, x, r, p: fp16lens.scan(m, [x], progress=False, treshold=0.5), "WatchOptions"),
        (lambda m, x, r, p: fp16lens.patch(m, r, factr=2.0), "PatchOptions"),
        (
            lambda m, x, r, p: fp16lens.export(m, (x,), p, options=ExportOptions(precsion="fp16")),
            "ExportOptions",
        ),
    ],
)
def test_a_misspelt_option_names_the_options_class(case, tmp_path, call, cls):
    model, x, report = case
    with pytest.raises((Fp16LensError, TypeError), match=cls):
        call(model, x, report, tmp_path / "m.onnx")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: VerifyOptions(tolerance="high"), "tolerance must be"),
        (lambda: VerifyOptions(metric=0.5), "metric must be a function"),
        (lambda: VerifyOptions(backend=3), "backend must be a backend name"),
        (lambda: ExportOptions(fp32_nodes="Gelu_0"), "list of node names"),
    ],
)
def test_bad_option_values_are_option_errors(make, match):
    with pytest.raises(OptionError, match=match):
        make()


def test_every_entry_point_has_an_options_parameter():
    import inspect

    for fn in (
        fp16lens.watch,
        fp16lens.scan,
        fp16lens.plan,
        fp16lens.patch,
        fp16lens.export,
        fp16lens.export.retype,
        fp16lens.verify,
    ):
        assert "options" in inspect.signature(fn).parameters, fn
