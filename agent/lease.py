"""The agent's lease decisions, one heartbeat period at a time (pure: no I/O, no clock).

Each period the agent probes its worker (/health, /metrics, in-flight ids) and hands the result to
`LeaseKeeper.observe`, which answers with the actions to take, in order:

- `register`    first contact, the registry lost the worker, or the worker restarted (a new
                registration starts a new epoch and rewrites capacity); comes with `clear_index`;
- `clear_index` drop the worker's prefix-index entries (its cache is not what the index says);
- `heartbeat`   renew the lease with the latest load (the last good load while a failure is young);
- `suspend`     the worker failed `fail_periods` probes in a row: stop renewing, let the lease
                expire, so gateways take it out of the pool and reclaim its slots;
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


@dataclass(frozen=True, slots=True)
class Probe:
    """What one period's probe of the worker found."""

    healthy: bool  # /health answered 2xx
    load: WorkerLoad | None  # parsed /metrics, None if the scrape failed
    inflight_ids: tuple[str, ...] | None = None  # None: the worker does not report them
    down: bool = False  # the worker refused the connection (process not running)


@dataclass
class LeaseKeeper:
    fail_periods: int = 3
    drain_quiet_periods: int = 2
    registered: bool = False
    renewing: bool = True
    draining: bool = False
    failures: int = 0
    quiet: int = 0
    was_down: bool = False
    last_load: WorkerLoad | None = None
    last_inflight: tuple[str, ...] = ()
    restarts: int = 0
    last_restart_reason: str = ""
    _counters: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fail_periods < 1 or self.drain_quiet_periods < 1:
            raise ValueError("fail_periods and drain_quiet_periods must be >= 1")

    def observe(self, probe: Probe) -> list[str]:
        """The actions for this period, in order."""
        if not probe.healthy or probe.load is None:
            return self._failed(probe)
        load = probe.load
        reason = self._restart_reason(load)
        self.failures = 0
        self.renewing = True
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
        self.failures += 1
        self.quiet = 0
        self.was_down = self.was_down or probe.down
        if self.failures >= self.fail_periods:
            if self.renewing:
                self.renewing = False
                return ["suspend"]
            return []
        # a young failure: keep the lease alive with the last good load
        return ["heartbeat"] if self.registered and self.last_load is not None else []

    def _restart_reason(self, load: WorkerLoad) -> str:
        if not self.registered or self.last_load is None:
            return ""
        if not self.renewing:
            return "worker recovered after failing probes"
        if self.was_down:
            return "worker came back after refusing connections"
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
