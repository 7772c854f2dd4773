"""LeaseKeeper: the agent's per-period decisions (register, heartbeat, suspend, restart, drain)."""

from __future__ import annotations

import pytest

from agent.lease import LeaseKeeper, Probe
from agent.scrape import WorkerLoad


def load(running: int = 0, waiting: int = 0, blocks: int = 100, prompt_tokens: float = 10.0) -> WorkerLoad:
    return WorkerLoad(
        engine="vllm",
        running=running,
        waiting=waiting,
        block_size=16,
        num_gpu_blocks=blocks,
        capacity_tokens=16 * blocks,
        counters={"vllm:prompt_tokens_total": prompt_tokens},
    )


OK = Probe(healthy=True, load=load())
FAIL = Probe(healthy=False, load=None)
DOWN = Probe(healthy=False, load=None, down=True)
NO_METRICS = Probe(healthy=True, load=None)
SLOW = Probe(healthy=False, load=None, timed_out=True)


def registered_keeper(**kwargs: int) -> LeaseKeeper:
    keeper = LeaseKeeper(**kwargs)
    assert keeper.observe(OK) == ["register", "clear_index"]
    keeper.registered_now()
    return keeper


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        LeaseKeeper(fail_periods=0)


def test_first_contact_registers_then_heartbeats() -> None:
    keeper = registered_keeper()
    assert keeper.observe(OK) == ["heartbeat"]


def test_nothing_happens_before_the_worker_is_reachable() -> None:
    keeper = LeaseKeeper(fail_periods=2)
    assert keeper.observe(FAIL) == []
    assert keeper.observe(FAIL) == ["suspend"]
    assert keeper.observe(OK) == ["register", "clear_index"]


@pytest.mark.parametrize(
    ("probes", "actions"),
    [
        pytest.param([FAIL], [["heartbeat"]], id="young failure keeps the lease with the last load"),
        pytest.param(
            [NO_METRICS] * 3, [["heartbeat"], ["heartbeat"], ["suspend"]], id="scrape failures count"
        ),
        pytest.param(
            [FAIL] * 4, [["heartbeat"], ["heartbeat"], ["suspend"], []], id="suspended once, then silent"
        ),
        pytest.param([DOWN, DOWN], [["suspend"], []], id="a refused connection suspends at once"),
        pytest.param(
            [SLOW] * 3, [["heartbeat"], ["heartbeat"], ["suspend"]], id="timeouts count like failures"
        ),
    ],
)
def test_failures_stop_renewal_after_fail_periods(probes: list[Probe], actions: list[list[str]]) -> None:
    keeper = registered_keeper(fail_periods=3)
    assert [keeper.observe(p) for p in probes] == actions
    assert keeper.renewing is (actions[-1] == ["heartbeat"])


@pytest.mark.parametrize(
    ("before", "after", "reason"),
    [
        pytest.param([FAIL, FAIL, FAIL], OK, "recovered after failing", id="recovery after suspension"),
        pytest.param([DOWN], OK, "refusing connections", id="refused connection then recovery"),
        pytest.param([], Probe(True, load(prompt_tokens=1.0)), "counters went backwards", id="counter reset"),
        pytest.param([], Probe(True, load(blocks=200)), "cache config changed", id="cache config changed"),
    ],
)
def test_worker_restart_registers_anew_and_clears_index(
    before: list[Probe], after: Probe, reason: str
) -> None:
    keeper = registered_keeper(fail_periods=3)
    for probe in before:
        keeper.observe(probe)
    assert keeper.observe(after) == ["register", "clear_index"]
    assert reason in keeper.last_restart_reason
    assert keeper.restarts == 1


def test_a_timeout_that_recovers_with_growing_counters_is_not_a_restart() -> None:
    keeper = registered_keeper(fail_periods=3)
    keeper.observe(FAIL)
    assert keeper.observe(Probe(True, load(prompt_tokens=50.0))) == ["heartbeat"]
    assert keeper.restarts == 0


def test_drain_finishes_after_quiet_periods_with_nothing_in_flight() -> None:
    keeper = registered_keeper(drain_quiet_periods=2)
    keeper.heartbeat_reply(True)
    busy = Probe(True, load(running=2))
    queued = Probe(True, load(waiting=1))
    held = Probe(True, load(), inflight_ids=("r1",))
    assert [keeper.observe(p) for p in (busy, queued, held, OK)] == [["heartbeat"]] * 4
    assert keeper.observe(OK) == ["heartbeat", "finish"]


def test_no_finish_without_drain_and_undrain_resets() -> None:
    keeper = registered_keeper(drain_quiet_periods=1)
    assert keeper.observe(OK) == ["heartbeat"]
    keeper.heartbeat_reply(True)
    keeper.heartbeat_reply(False)
    assert keeper.observe(OK) == ["heartbeat"]


def test_heartbeat_reply_none_means_register_again() -> None:
    keeper = registered_keeper()
    keeper.heartbeat_reply(None)
    assert keeper.observe(OK) == ["register", "clear_index"]
