"""Calibration candidates from a real histogram: max, percentiles, and TensorRT's entropy.

Each activation to quantize gets a 2048-bin histogram of |x| over the calibration batches
(range [0, max]). From it come the candidate ranges (amax, the INT8 scale being amax/127):

- ``max``: the largest |x| seen (nothing clipped);
- ``percentile``: the amax below which that share of |x| falls (99.9 ... 99.999);
- ``entropy``: TensorRT's entropy calibration (KL divergence between the histogram clipped
  at each candidate bin and its 128-level quantization, the minimum kept), on 2048 bins.

Which one a tensor keeps is not decided here: the search measures each candidate at the
model's output (``_int8_search``), because a clip that looks free in the histogram can
break a threshold downstream (the detector's sigmoid map).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BINS = 2048
LEVELS = 128  # symmetric INT8: 127 steps each side, 128 magnitude bins as TensorRT counts
PERCENTILES = (99.9, 99.99, 99.999)


@dataclass
class Histogram:
    """|x| of one tensor over the calibration batches: its max, then its histogram."""

    amax: float = 0.0
    counts: np.ndarray = field(default_factory=lambda: np.zeros(BINS, dtype=np.float64))

    def see_max(self, x: np.ndarray) -> None:
        if x.size:
            self.amax = max(self.amax, float(np.nanmax(np.abs(x))))

    def add(self, x: np.ndarray) -> None:
        if x.size and self.amax > 0:
            h, _ = np.histogram(np.abs(x), bins=BINS, range=(0.0, self.amax))
            self.counts += h

    @property
    def width(self) -> float:
        return self.amax / BINS

    def percentile(self, p: float) -> float:
        total = self.counts.sum()
        if total == 0:
            return self.amax
        cdf = np.cumsum(self.counts) / total
        return float((np.searchsorted(cdf, p / 100.0) + 1) * self.width)

    def entropy(self, stride: int = 4) -> float:
        return (entropy_bin(self.counts, stride=stride) + 1) * self.width if self.amax else 0.0

    def candidates(self) -> dict[str, float]:
        """Method name -> amax, the methods whose ranges differ by less than 1% merged."""
        found = {"max": self.amax}
        for p in PERCENTILES:
            found[f"percentile-{p:g}"] = self.percentile(p)
        found["entropy"] = self.entropy()
        kept: dict[str, float] = {}
        for name, amax in found.items():
            if amax > 0 and all(abs(amax - v) > 0.01 * v for v in kept.values()):
                kept[name] = amax
        return kept or {"max": max(self.amax, 1e-8)}


def entropy_bin(hist: np.ndarray, levels: int = LEVELS, stride: int = 1) -> int:
    """The last bin index (inclusive) of TensorRT's entropy calibration: over each candidate
    end ``i`` (from ``levels`` to all bins), the reference is ``hist[:i]`` with the mass
    beyond folded into its last bin, the candidate is ``hist[:i]`` merged into ``levels``
    bins and spread back over the non-empty bins; the ``i`` of least KL divergence wins."""
    hist = np.asarray(hist, dtype=np.float64)
    n = len(hist)
    if n <= levels or hist.sum() == 0:
        return n - 1
    tail = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # tail[i] = hist[i:].sum()
    best, best_i = np.inf, n
    for i in range(levels, n + 1, stride):
        ref = hist[:i].copy()
        ref[-1] += tail[i]
        nonzero = hist[:i] != 0
        merged = i // levels
        starts = np.arange(levels) * merged
        sums = np.add.reduceat(hist[:i], starts)  # the last group takes the remainder
        counts = np.add.reduceat(nonzero.astype(np.float64), starts)
        per = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
        group = np.minimum(np.arange(i) // merged, levels - 1)
        q = np.where(nonzero, per[group], 0.0)
        p_sum, q_sum = ref.sum(), q.sum()
        if q_sum == 0:
            continue
        p, qn = ref / p_sum, q / q_sum
        mask = p > 0
        # a bin the reference fills but the candidate leaves empty costs as ModelOpt counts it
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = float(np.sum(p[mask] * np.log(p[mask] / np.where(qn[mask] > 0, qn[mask], 1e-12))))
        if kl < best:
            best, best_i = kl, i
    return best_i - 1
