"""Moved to ``fp16lens.patch._trace`` (patch proves its result with it, and patch is an
earlier layer than verify); this name stays for older imports."""

from fp16lens.patch import SiteTracer, Trace, traced

__all__ = ["SiteTracer", "Trace", "traced"]
