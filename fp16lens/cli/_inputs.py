"""Model inputs for the CLI: generated from shape specs, or loaded from .pt/.npz/.npy files.

A batch is a tuple of positional arguments for ``model(*batch)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fp16lens._core import Fp16LensError, OptionError

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
FILE_SUFFIXES = (".pt", ".pth", ".npz", ".npy")
Batch = tuple[torch.Tensor, ...]


def parse_shape(spec: str) -> tuple[int, ...]:
    """``"1x3x224x224"`` -> ``(1, 3, 224, 224)``; ``"8"`` -> ``(8,)``."""
    parts = spec.lower().replace("*", "x").split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise Fp16LensError(
            f"bad input shape {spec!r}: write positive sizes joined by 'x', e.g. 1x3x224x224 "
            "(or give a .pt/.npz/.npy file of batches)"
        )
    return dims


def parse_range(spec: str) -> tuple[float, float]:
    """``"0,255"`` -> ``(0.0, 255.0)``; the low end must be below the high end."""
    parts = spec.split(",")
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        low = high = math.nan
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise Fp16LensError(
            f"bad value range {spec!r}: write two numbers LOW,HIGH with LOW < HIGH, e.g. 0,255"
        )
    return low, high


def parse_dtypes(spec: str, count: int) -> list[torch.dtype]:
    """One dtype for every input, or a comma-separated list with one per input."""
    names = spec.split(",")
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise Fp16LensError(
            f"unknown dtype {unknown[0]!r}; choose from {', '.join(DTYPES)} "
            "(one for all inputs, or one per input separated by commas)"
        )
    if len(names) not in (1, count):
        raise Fp16LensError(
            f"--dtype lists {len(names)} dtypes for {count} inputs; give one, or one per input"
        )
    return [DTYPES[n] for n in (names * count if len(names) == 1 else names)]


@dataclass(frozen=True)
class InputSpec:
    """Random inputs from shapes: ``batches`` batches, each one tensor per shape."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    low: float = 0.0
    high: float = 1.0
    batches: int = 1
    seed: int = 0

    def __post_init__(self):
        if not self.shapes:
            raise OptionError("shapes must name at least one input, e.g. ((1, 3, 224, 224),)")
        if len(self.dtypes) != len(self.shapes):
            raise OptionError(
                f"need one dtype per shape, got {len(self.dtypes)} for {len(self.shapes)}"
            )
        if not isinstance(self.batches, int) or self.batches < 1:
            raise OptionError(f"batches must be an int >= 1, got {self.batches!r}")
        if not self.low < self.high:
            raise OptionError(f"low must be < high, got {self.low}, {self.high}")

    def make(self) -> Batches:
        """The batches, each made when it is read (``--batches 1000`` holds one at a time)."""
        return Batches(self.batches, self.batch)

    def batch(self, i: int) -> Batch:
        """Batch ``i``: the same tensors whenever it is asked for (seeded by seed and i)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return tuple(
            _random(s, d, self.low, self.high, g) for s, d in zip(self.shapes, self.dtypes)
        )


class Batches(Sequence):
    """``count`` batches made on demand by ``make(i)``: a sequence with a length (progress
    bars, ``batches[0]``) that never holds more than the batch in use."""

    def __init__(self, count: int, make: Callable[[int], Batch]):
        self._count, self._make = count, make

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if not -self._count <= i < self._count:
            raise IndexError(i)
        return self._make(i % self._count)

    def map(self, fn: Callable[[Batch], Batch]) -> Batches:
        """The same batches, each passed through ``fn`` when it is made."""
        return Batches(self._count, lambda i: fn(self._make(i)))


def _random(shape, dtype, low: float, high: float, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g) * (high - low) + low).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    # integers are drawn from LOW <= x < HIGH, as torch.randint and range() do: --range 0,100
    # gives valid token ids for a vocabulary of 100
    lo, hi = math.ceil(low), math.ceil(high)
    if hi <= lo:
        raise Fp16LensError(f"--range {low:g},{high:g} holds no integer; write e.g. --range 0,100")
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def is_file_spec(spec: str) -> bool:
    return Path(spec).suffix.lower() in FILE_SUFFIXES
