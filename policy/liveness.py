"""Whether a worker's lease is renewed after a health probe: the one rule for both lease holders.

Two kinds of process keep a worker's lease in the registry: the node agent beside the worker
(agent/lease.py) and the gateway itself for static workers given by URL (plugin/static_workers.py).
Both probe once a period and ask `Liveness.observe` whether to renew. The rule:

- a healthy answer renews, and forgets earlier failures;
- a refused connection ends renewal at once: no process is listening, so nothing can be served
  there, and the lease should run out as soon as it can;
- an error answer (an error status, or metrics that cannot be read) is tolerated for
  `fail_periods` probes in a row, then renewal ends;
- no answer within the timeout is tolerated for `slow_periods` probes in a row. A slow answer is
  not a refusal: under load the prober's own event loop is often what is slow, and dropping the
  worker then turns overload into 503s.

The counts are of consecutive unhealthy probes of any kind, each kind judged by its own limit, so a
worker that alternates timeouts and errors is still let go. Once ended, renewal resumes only with a
healthy answer. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ProbeOutcome(Enum):
    HEALTHY = "healthy"
    SLOW = "slow"  # no answer within the timeout
    FAILED = "failed"  # an error status, or unreadable metrics
    REFUSED = "refused"  # the connection was refused: no process is listening


@dataclass
class Liveness:
    fail_periods: int = 3  # error answers in a row that end renewal
    slow_periods: int = 3  # timeouts in a row that end renewal
    failures: int = 0  # unhealthy probes in a row, of any kind
    renewing: bool = True

    def __post_init__(self) -> None:
        if self.fail_periods < 1 or self.slow_periods < 1:
            raise ValueError("fail_periods and slow_periods must be >= 1")

    def observe(self, outcome: ProbeOutcome) -> bool:
        """Record this period's probe; True if the lease is to be renewed now."""
        if outcome is ProbeOutcome.HEALTHY:
            self.failures = 0
            self.renewing = True
            return True
        self.failures += 1
        limit = {ProbeOutcome.REFUSED: 1, ProbeOutcome.FAILED: self.fail_periods}.get(
            outcome, self.slow_periods
        )
        if self.failures >= limit:
            self.renewing = False
        return self.renewing
