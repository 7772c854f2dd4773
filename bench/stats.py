"""Percentile definitions for kvgate's benchmark reports, in one place so each report names the one it uses.

Two definitions are in use, and they differ on small samples, so figures from different reports are
comparable only when they share a definition:

* `percentile` (linear interpolation between the two nearest ranks; Hyndman & Fan type 7, numpy's
  default): position (n - 1)·q/100 in the ascending values. The simulator reports this
  (bench/sim/metrics.py keeps an identical copy for now), and so does the engine microbench.
* `nearest_rank_percentile` (the smallest value with at least q% of the values at or below it): always an
  observed value. The live benchmarks report this (bench/loadgen.py, bench/burst.py, bench/overhead.py,
  bench/demo.py).

For example, of [1, 2, 3, 4] the linear p50 is 2.5 and the nearest-rank p50 is 2; of 20 values the
nearest-rank p99 is the maximum, the linear p99 lies between the two largest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile q in [0, 100] of ascending values; NaN when empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def nearest_rank_percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile q in 0..100 of values in any order; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]
