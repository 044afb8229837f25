"""Write notebooks/*.ipynb from the cells below, with empty outputs (reproducible in git).

    python scripts/make_notebooks.py          # rewrite the notebooks
    python scripts/make_notebooks.py --check  # exit 1 when a notebook differs from this source

Every notebook uses only the built-in demo model (no download, no torchvision).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

SETUP = """\
import copy

import torch

import fp16lens
from fp16lens.demo import build_demo_model

model, inputs = build_demo_model()
(x,) = inputs
model"""

# The files a notebook writes go to a fresh temporary folder, never next to the notebook.
OUT = """\
import tempfile
from pathlib import Path

out = Path(tempfile.mkdtemp(prefix="fp16lens-"))  # this notebook's files
out"""

FIND = [
    new_markdown_cell(
        "# 1. Find where FP16 overflows\n\n"
        "The built-in demo model is a small text detector (ResNet-style backbone + FPN "
        "neck), shaped like a PANet text detector: in FP32 it is fine, in FP16 "
        "its output turns into NaN. `fp16lens.watch` finds where the values leave the "
        "FP16 range (|x| > 65504) and where they come back."
    ),
    new_code_cell(SETUP),
    new_code_cell(OUT),
    new_markdown_cell("FP32 is finite; the same model in real FP16 (`.half()`) is not:"),
    new_code_cell(
        "with torch.no_grad():\n"
        "    y32 = model(x)\n"
        "    y16 = copy.deepcopy(model).half()(x.half())\n"
        "print('FP32 finite:', bool(torch.isfinite(y32).all()))\n"
        "print('FP16 non-finite outputs:', int((~torch.isfinite(y16)).sum()), 'of', y16.numel())"
    ),
    new_markdown_cell(
        "Watch one FP32 forward pass. Every module and functional op is a *site*; a "
        "*span* starts where in-range inputs give out-of-range outputs and ends where "
        "they come back."
    ),
    new_code_cell(
        "with fp16lens.watch(model) as lens, torch.no_grad():\n"
        "    model(x)\n"
        "report = lens.report\n"
        "report"
    ),
    new_code_cell(
        "for span in report.spans:\n"
        "    print(f'{span.start} -> {span.end}: peak {span.peak:.3g} at {span.peak_site}')\n"
        "    print('  through', ' -> '.join(span.sites))\n"
        "assert report.spans[0].start == 'backbone.layer4.1.bn2'"
    ),
    new_markdown_cell("Each site's largest value against the FP16 limit:"),
    new_code_cell("fig = report.plot()\nfig"),
    new_markdown_cell(
        "Save the report for later (`fp16lens show report.json` prints it again; "
        "`report.html` is a page to open in a browser):"
    ),
    new_code_cell("report.save(out / 'report.json')\nreport.save(out / 'report.html')"),
]

FIX = [
    new_markdown_cell(
        "# 2. Fix the overflow and verify parity\n\n"
        "`fp16lens.patch` rescales the span by a power of two folded into the parameters "
        "(exact: no rounding, no run-time cost); `fp16lens.verify` compares FP32 with real "
        "FP16 before and after."
    ),
    new_code_cell(SETUP),
    new_code_cell(
        "with fp16lens.watch(model) as lens, torch.no_grad():\n"
        "    model(x)\n"
        "report = lens.report\n"
        "print(report.spans[0].start, '->', report.spans[0].end)"
    ),
    new_markdown_cell("The plan: which region is rescaled, by which factor, and how."),
    new_code_cell("the_plan = fp16lens.plan(model, report)\nthe_plan"),
    new_code_cell(
        "patched = fp16lens.patch(model, report)\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(patched(x), model(x), rtol=1e-4, atol=1e-5)  # same FP32 model\n"
        "print('FP32 outputs unchanged')"
    ),
    new_markdown_cell("Parity of real FP16 against FP32, before and after:"),
    new_code_cell(
        "before = fp16lens.verify(model, model, inputs, backend='torch-fp16')\n"
        "after = fp16lens.verify(model, patched, inputs, backend='torch-fp16')\n"
        "print('before:', repr(before))\n"
        "print('after: ', repr(after))\n"
        "assert not before and after"
    ),
    new_code_cell("after"),
    new_markdown_cell("Watching the patched model again finds nothing out of range:"),
    new_code_cell(
        "with fp16lens.watch(patched) as lens, torch.no_grad():\n"
        "    patched(x)\n"
        "print(len(lens.report.spans), 'spans after the fix')\n"
        "lens.report"
    ),
]

DEPLOY = [
    new_markdown_cell(
        "# 3. Deploy: typed FP16 / INT8 ONNX, TensorRT, torch-tensorrt\n\n"
        "TensorRT builds an FP16 engine from an ONNX graph whose tensors already are FP16 "
        "(strongly typed), and an INT8 engine from explicit Q/DQ nodes. The TensorRT and "
        "torch-tensorrt cells need an NVIDIA GPU; without one they say so and skip."
    ),
    new_code_cell(SETUP),
    new_code_cell(OUT),
    new_code_cell(
        "from fp16lens.demo import document_pages\n\n"
        "with fp16lens.watch(model) as lens, torch.no_grad():\n"
        "    model(x)\n"
        "patched = fp16lens.patch(model, lens.report)"
    ),
    new_markdown_cell(
        "Strongly typed FP16 ONNX. ONNX Runtime's CPU provider computes FP16 nodes in FP32 "
        "inside, which hides overflow, so `verify`'s `onnx-fp16` backend forces FP16 "
        "storage after every node."
    ),
    new_code_cell(
        "fp16 = fp16lens.export(patched, inputs, out / 'demo_fp16.onnx', precision='fp16')\n"
        "print(fp16)\n"
        "parity16 = fp16lens.verify(model, out / 'demo_fp16.onnx', inputs, backend='onnx-fp16')\n"
        "parity16"
    ),
    new_markdown_cell("INT8 with explicit Q/DQ nodes, calibrated on a few synthetic pages:"),
    new_code_cell(
        "calibration = [(page.unsqueeze(0),) for page in document_pages(4, seed=7)]\n"
        "int8 = fp16lens.export(\n"
        "    patched, inputs, out / 'demo_int8.onnx', precision='int8', calibration=calibration\n"
        ")\n"
        "print(int8)\n"
        "parity8 = fp16lens.verify(model, out / 'demo_int8.onnx', inputs, backend='onnx-int8')\n"
        "parity8"
    ),
    new_markdown_cell(
        "TensorRT engine from the FP16 ONNX (needs `pip install -e '.[trt]'` and a GPU):"
    ),
    new_code_cell(
        "import importlib.util\n\n"
        "if torch.cuda.is_available() and importlib.util.find_spec('tensorrt'):\n"
        "    engine = fp16lens.build_engine(out / 'demo_fp16.onnx', out / 'demo_fp16.plan', precision='fp16')\n"
        "    print('engine written to', engine)\n"
        "    # the tensorrt backend builds its own strongly typed engine from the same ONNX file\n"
        "    print(fp16lens.verify(model, out / 'demo_fp16.onnx', inputs, backend='tensorrt'))\n"
        "else:\n"
        "    print('skipped: TensorRT needs an NVIDIA GPU and the trt extra '\n"
        "          \"(pip install -e '.[trt]'); the FP16 ONNX above is what it builds from\")"
    ),
    new_markdown_cell(
        "torch-tensorrt, FP16 with explicit typing (needs `pip install -e '.[torchtrt]'` "
        "and a GPU):"
    ),
    new_code_cell(
        "if torch.cuda.is_available() and importlib.util.find_spec('torch_tensorrt'):\n"
        "    compiled = fp16lens.compile_torch_tensorrt(patched, inputs, precision='fp16')\n"
        "    print(type(compiled).__name__, 'ready on', torch.cuda.get_device_name())\n"
        "    print(fp16lens.verify(model, patched, inputs, backend='torch-tensorrt'))\n"
        "else:\n"
        "    print('skipped: torch-tensorrt needs an NVIDIA GPU and the torchtrt extra '\n"
        "          \"(pip install -e '.[torchtrt]')\")"
    ),
]

NOTEBOOK_CELLS = {
    "01_find_overflow.ipynb": FIND,
    "02_fix_and_verify.ipynb": FIX,
    "03_deploy.ipynb": DEPLOY,
}


def build(cells: list) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"  # stable ids: regenerating gives the same file
    return nb


def render(cells: list) -> str:
    return nbformat.writes(build(cells)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name, cells in NOTEBOOK_CELLS.items():
        path, text = NOTEBOOKS / name, render(cells)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
            continue
        NOTEBOOKS.mkdir(exist_ok=True)
        path.write_text(text)
    if stale:
        print(f"stale notebooks: {', '.join(stale)}; run python scripts/make_notebooks.py")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
