"""The built-in demo: a small text detector that overflows FP16, and the whole journey on it.

Needs no download and no torchvision. ``build_demo_model()`` returns ``(model, inputs)``;
``run_demo(out_dir, console)`` runs watch -> report -> plan -> patch -> parity -> export
and returns a summary dict.
"""

from fp16lens.demo._build import OVERFLOW_SITE, SPAN_END, build_demo_model, document_pages
from fp16lens.demo._journey import run_demo

__all__ = ["OVERFLOW_SITE", "SPAN_END", "build_demo_model", "document_pages", "run_demo"]
