"""Moved to ``fp16lens.patch._emulate`` (patch proves its result with it, and patch is an
earlier layer than verify); this name stays for older imports."""

from fp16lens.patch import StorageRounding, round_fp16_, round_module_

__all__ = ["StorageRounding", "round_fp16_", "round_module_"]
