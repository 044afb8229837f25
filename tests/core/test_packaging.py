"""The package stays lean, names missing extras, and has a working command line."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest

from fp16lens._core import MissingDependencyError, headroom_bits, import_optional, is_power_of_two


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_is_lean_and_does_not_touch_cuda():
    code = (
        "import sys, torch, fp16lens\n"
        "heavy = [m for m in ('onnxruntime', 'onnx', 'tensorrt', 'torchvision', 'matplotlib',"
        " 'polygraphy', 'torch_tensorrt', 'onnxscript') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('lean')\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "lean"


def test_missing_dependency_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['tensorrt'] = None\n"
        "from fp16lens._core import import_optional, MissingDependencyError\n"
        "try:\n"
        "    import_optional('tensorrt', 'trt', 'building TensorRT engines')\n"
        "except MissingDependencyError as e:\n"
        "    print(e)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "tensorrt is not installed" in proc.stdout
    assert "pip install -e '.[trt]'" in proc.stdout
    with pytest.raises(MissingDependencyError) as info:
        import_optional("fp16lens_no_such_module", "onnx")
    assert isinstance(info.value, ImportError) and info.value.extra == "onnx"


@pytest.mark.parametrize(
    "argv", [[sys.executable, "-m", "fp16lens", "--help"], ["fp16lens", "--help"]]
)
def test_help_works(argv):
    if argv[0] == "fp16lens":
        exe = shutil.which("fp16lens") or os.path.join(os.path.dirname(sys.executable), "fp16lens")
        if not os.path.exists(exe):
            pytest.fail("the fp16lens console script is not installed (pip install -e .)")
        argv = [exe, "--help"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fp16lens" in proc.stdout and "usage" in proc.stdout.lower()


def test_fp16_facts():
    assert is_power_of_two(1) and is_power_of_two(4096) and is_power_of_two(2.0**-3)
    for bad in (0, -2, 3, 1.5, math.inf, math.nan, "8"):
        assert not is_power_of_two(bad)
    assert headroom_bits(65504.0) == 0
    assert headroom_bits(65504.0 / 4) == pytest.approx(2)
    assert headroom_bits(0.0) == math.inf and headroom_bits(math.inf) == -math.inf
