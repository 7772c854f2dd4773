"""The agent's lease decisions, one heartbeat period at a time (pure: no I/O, no clock).

Each period the agent probes its worker (/health, /metrics, in-flight ids) and hands the result to
`LeaseKeeper.observe`, which answers with the actions to take, in order:

- `register`    first contact, the registry lost the worker, or the worker restarted (a new
                registration starts a new epoch and rewrites capacity); comes with `clear_index`;
- `clear_index` drop the worker's prefix-index entries (its cache is not what the index says);
- `heartbeat`   renew the lease with the latest load (the last good load while a failure is young);
- `suspend`     renewal ended by the liveness rule (policy/liveness.py, the same rule the gateway
                applies to static workers: a refused connection at once, `fail_periods` failed
                probes in a row otherwise): stop renewing, let the lease expire, so gateways take
                it out of the pool and reclaim its slots;
- `finish`      draining and the worker has been idle (running + waiting = 0, no in-flight ids) for
                `drain_quiet_periods` probes: deregister and exit.

A worker restart is detected from: a Prometheus counter going backwards, a changed cache config
(block size, block count), recovery after the worker refused connections (process down), or
recovery after suspension. Parameters: fail_periods >= 1 (default 3), drain_quiet_periods >= 1
(default 2: a request routed just before gateways saw the drain flag gets a period to show up).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.scrape import WorkerLoad, counters_went_backwards
from policy.liveness import Liveness, ProbeOutcome


@dataclass(frozen=True, slots=True)
class Probe:
    """What one period's probe of the worker found."""

    healthy: bool  # /health answered 2xx
    load: WorkerLoad | None  # parsed /metrics, None if the scrape failed
    inflight_ids: tuple[str, ...] | None = None  # None: the worker does not report them
    down: bool = False  # the worker refused the connection (process not running)
    timed_out: bool = False  # no answer within the probe's timeout

    @property
    def outcome(self) -> ProbeOutcome:
        if self.healthy and self.load is not None:
            return ProbeOutcome.HEALTHY
        if self.down:
            return ProbeOutcome.REFUSED
        return ProbeOutcome.SLOW if self.timed_out else ProbeOutcome.FAILED


@dataclass
class LeaseKeeper:
    fail_periods: int = 3
    drain_quiet_periods: int = 2
    registered: bool = False
    draining: bool = False
    quiet: int = 0
    was_down: bool = False
    last_load: WorkerLoad | None = None
    last_inflight: tuple[str, ...] = ()
    restarts: int = 0
    last_restart_reason: str = ""
    _counters: Mapping[str, float] = field(default_factory=dict)
    liveness: Liveness = field(init=False)

    def __post_init__(self) -> None:
        if self.fail_periods < 1 or self.drain_quiet_periods < 1:
            raise ValueError("fail_periods and drain_quiet_periods must be >= 1")
        self.liveness = Liveness(fail_periods=self.fail_periods, slow_periods=self.fail_periods)

    @property
    def renewing(self) -> bool:
        return self.liveness.renewing

    @property
    def failures(self) -> int:
        """Unhealthy probes in a row."""
        return self.liveness.failures

    def observe(self, probe: Probe) -> list[str]:
        """The actions for this period, in order."""
        if probe.load is None or probe.outcome is not ProbeOutcome.HEALTHY:
            return self._failed(probe)
        load = probe.load
        reason = self._restart_reason(load)
        self.liveness.observe(ProbeOutcome.HEALTHY)
        self.was_down = False
        self._counters = load.counters
        self.last_load = load
        self.last_inflight = probe.inflight_ids or ()
        actions: list[str]
        if reason:
            self.restarts += 1
            self.last_restart_reason = reason
            actions = ["register", "clear_index"]
        elif not self.registered:
            actions = ["register", "clear_index"]
        else:
            actions = ["heartbeat"]
        if self.draining and not reason:
            idle = load.running + load.waiting == 0 and not self.last_inflight
            self.quiet = self.quiet + 1 if idle else 0
            if self.quiet >= self.drain_quiet_periods:
                actions.append("finish")
        return actions

    def _failed(self, probe: Probe) -> list[str]:
        self.quiet = 0
        self.was_down = self.was_down or probe.down
        was_renewing = self.liveness.renewing
        if not self.liveness.observe(probe.outcome):
            return ["suspend"] if was_renewing else []
        # a young failure: keep the lease alive with the last good load
        return ["heartbeat"] if self.registered and self.last_load is not None else []

    def _restart_reason(self, load: WorkerLoad) -> str:
        if not self.registered or self.last_load is None:
            return ""
        if self.was_down:
            return "worker came back after refusing connections"
        if not self.renewing:
            return "worker recovered after failing probes"
        if backwards := counters_went_backwards(self._counters, load.counters):
            return f"counters went backwards: {', '.join(backwards)}"
        if self.last_load.cache_config != load.cache_config:
            return f"cache config changed: {self.last_load.cache_config} -> {load.cache_config}"
        return ""

    def registered_now(self) -> None:
        self.registered = True

    def heartbeat_reply(self, draining: bool | None) -> None:
        """Feed the registry's answer to a heartbeat: the drain flag, or None if not registered."""
        if draining is None:
            self.registered = False  # pruned or deregistered by someone else: register next period
            return
        if draining and not self.draining:
            self.quiet = 0
        self.draining = draining
