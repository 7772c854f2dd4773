"""The cost of one metric observation in this checkout's plugin/metrics.py (counter inc, histogram
observe), timed alone with timeit: run it from two checkouts to compare exposition back-ends.

    python -m bench.metrics_cost [--calls 200000]
"""

from __future__ import annotations

import argparse
import timeit

from plugin.metrics import GatewayMetrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    n = parser.parse_args().calls
    m = GatewayMetrics()
    inc = timeit.timeit(lambda: m.requests.inc("m", "normal", "200", "default"), number=n) / n * 1e6
    observe = (
        timeit.timeit(lambda: m.admission_wait.observe(0.03, "m", "normal", "default"), number=n) / n * 1e6
    )
    print(f"counter inc {inc:.3f} µs, histogram observe {observe:.3f} µs ({n} calls each)")


if __name__ == "__main__":
    main()
