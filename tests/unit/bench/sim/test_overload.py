"""The overload scenario's shape, the admission metrics, and `kvgate bench sim --admission` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.sim.cli import main
from bench.sim.cluster import RequestRecord, SimResult
from bench.sim.metrics import admission_metrics
from bench.sim.profiles import load_profile
from bench.sim.scenarios import HALF_LOAD_SCALE, OVERLOAD_PHASES_S, overload_requests
from bench.sim.types import SimRequest
from policy.types import Band

PROFILE = load_profile("h100-llama3.1-8b")


def test_phases_and_the_half_load_reference_have_the_same_streams_but_the_flood() -> None:
    """Their loads against measured capacity: tests/unit/bench/sim/test_capacity.py."""
    assert OVERLOAD_PHASES_S == (60.0, 60.0, 90.0)
    reqs = overload_requests(1, PROFILE, 8)
    half = overload_requests(1, PROFILE, 8, load_scale=HALF_LOAD_SCALE, burst=False)
    assert {r.tenant for r in reqs} - {r.tenant for r in half} == {"api-flood"}
    assert max(r.arrival_s for r in half) > 200.0 and len(half) < len(reqs)


def test_bands_tenants_slos_and_the_flooding_tenant() -> None:
    reqs = overload_requests(1, PROFILE, 8)
    slo = {Band.HIGH: 2.0, Band.NORMAL: 10.0, Band.LOW: 60.0}
    assert all(r.slo_ttft_s == slo[r.band] for r in reqs)
    tenants = {band: {r.tenant for r in reqs if r.band == band} for band in Band}
    assert tenants[Band.HIGH] == {"chat-a", "chat-b", "chat-c"}
    assert tenants[Band.NORMAL] == {"api-1", "api-2", "api-3", "api-flood"}
    assert tenants[Band.LOW] == {"batch-x", "batch-y"}
    flood = [r for r in reqs if r.tenant == "api-flood"]
    assert all(60.0 <= r.arrival_s < 120.0 for r in flood)
    in_burst = [r for r in reqs if 60.0 <= r.arrival_s < 120.0 and r.band == Band.NORMAL]
    assert len(flood) / len(in_burst) > 0.8  # one tenant floods its band
    # online prompts are short and share a per-tenant system prompt; offline ones are long
    assert max(r.input_tokens for r in reqs if r.band == Band.HIGH) <= 2048 + 600
    assert min(r.input_tokens for r in reqs if r.band == Band.LOW) >= 4000
    chat_a = [r.block_ids[0] for r in reqs if r.tenant == "chat-a"]
    assert len(set(chat_a)) == 1


def test_overload_is_deterministic_by_seed() -> None:
    assert overload_requests(4, PROFILE, 2) == overload_requests(4, PROFILE, 2)
    assert overload_requests(4, PROFILE, 2) != overload_requests(5, PROFILE, 2)


def record(
    rid: int, band: Band, arrival: float, dispatch: float | None, first: float | None, **kw: object
) -> RequestRecord:
    finish = None if first is None else first + 1.0
    return RequestRecord(rid, arrival, 10, 10, int(band), "t", "w0", dispatch, first, finish, **kw)  # type: ignore[arg-type]


def test_admission_metrics_goodput_and_per_band_numbers() -> None:
    cases = [  # (band, slo, arrival, dispatch, first token, rejected, good?)
        (Band.HIGH, 2.0, 0.0, 0.0, 1.5, False, True),
        (Band.HIGH, 2.0, 0.0, 1.0, 2.5, False, False),  # over its SLO
        (Band.NORMAL, None, 0.0, 4.0, 30.0, False, True),  # no SLO: finishing is enough
        (Band.LOW, 60.0, 0.0, None, None, True, False),  # rejected never counts
        (Band.LOW, 60.0, 5.0, 17.0, 18.0, False, True),
    ]
    requests = [SimRequest(i, c[2], 10, 10, (i,), (10,), c[0], "t", c[1]) for i, c in enumerate(cases)]
    records = [record(i, c[0], c[2], c[3], c[4], rejected=c[5]) for i, c in enumerate(cases)]
    result = SimResult("p", records, ["w0"], {"w0": 1.0}, {}, {}, 40.0)
    m = admission_metrics(result, requests)
    assert m["goodput"] == pytest.approx(3 / 5)
    by = m["by_priority"]
    assert isinstance(by, dict)
    assert by["high"]["ttft_p50"] == pytest.approx(2.0) and by["high"]["max_wait"] == 1.0
    assert by["normal"]["completed"] == 1 and by["normal"]["max_wait"] == 4.0
    assert (by["low"]["completed"], by["low"]["rejected"], by["low"]["max_wait"]) == (1, 1, 12.0)
    assert math.isclose(by["low"]["ttft_p99"], 13.0)


def test_admission_metrics_by_tenant_shows_whom_a_gate_fails() -> None:
    cases = [("flood", True), ("flood", True), ("flood", False), ("polite", False)]  # (tenant, rejected)
    requests = [
        SimRequest(i, 0.0, 10, 10, (i,), (10,), Band.NORMAL, t, 10.0) for i, (t, _) in enumerate(cases)
    ]
    records = [
        RequestRecord(
            i,
            0.0,
            10,
            10,
            int(Band.NORMAL),
            t,
            None if rej else "w0",
            *((None,) * 3 if rej else (0.0, 1.0, 2.0)),
            rejected=rej,
        )
        for i, (t, rej) in enumerate(cases)
    ]
    m = admission_metrics(SimResult("p", records, ["w0"], {"w0": 1.0}, {}, {}, 2.0), requests)
    assert m["by_tenant"] == {
        "flood": {"requests": 3, "rejected": 2, "goodput": pytest.approx(1 / 3)},
        "polite": {"requests": 1, "rejected": 0, "goodput": 1.0},
    }


def test_cli_admission_runs_one_per_policy_and_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--scenario",
        "overload",
        "--limit",
        "400",
        "--workers",
        "2",
        "--policies",
        "round_robin,least_inflight",
    ]
    assert (
        main([*argv, "--admission", "none,kvgate", "--jobs", "1", "--no-plots", "--out", str(tmp_path)]) == 0
    )
    doc = json.loads((tmp_path / "results.json").read_text())
    pairs = [(r["policy"], r["admission"]) for r in doc["runs"]]
    assert pairs == [
        ("round_robin", "none"),
        ("round_robin", "kvgate"),
        ("least_inflight", "none"),
        ("least_inflight", "kvgate"),
    ]
    for run in doc["runs"]:
        m = run["metrics"]
        assert 0.0 <= m["goodput"] <= 1.0 and m["ttft_p99"] is not None
        assert set(m["by_priority"]) == {"high", "normal", "low"}
        for band in m["by_priority"].values():
            assert {"ttft_p50", "ttft_p99", "completed", "rejected", "max_wait"} <= set(band)
        assert isinstance(m["high_ttft_p99_at_half_load"], float)
    out = capsys.readouterr().out
    assert "goodput" in out and "least_inflight [kvgate]" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        pytest.param(["--admission", "nope"], "unknown admission policy 'nope'", id="unknown gate"),
        pytest.param(["--admission", "none", "--sweep"], "--sweep does not combine", id="sweep with gates"),
    ],
)
def test_cli_admission_bad_input(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--scenario", "overload", "--limit", "50", *extra, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("gate", ["none", "gie_shed", "gie_flow", "probabilistic", "kvgate"])
def test_every_request_completes_or_is_rejected(gate: str) -> None:
    """A burst of long prompts on one worker (low with a 1 s SLO, high without SLO: a 2 s wait budget):
    gates queue, shed, or let waiters time out; the runner must account every request exactly once
    (waiters whose budget ran out count as rejected)."""
    from bench.sim.runner import run_policy

    def make(i: int) -> SimRequest:
        band, slo = (Band.HIGH, None) if i % 3 == 0 else (Band.LOW, 1.0)
        return SimRequest(i, i * 0.001, 12_000, 200, (i,), (12_000,), band, "t", slo)

    reqs = [make(i) for i in range(120)]
    run = run_policy("least_inflight", reqs, "h100-llama3.1-8b", 1, 1, admission=gate)
    m = run.metrics
    by = m["by_priority"]
    assert isinstance(by, dict)
    assert sum(b["completed"] + b["rejected"] for b in by.values()) == len(reqs)
    assert m["rejected"] == sum(b["rejected"] for b in by.values())
    assert m["high_ttft_p99_at_half_load"] is None  # no reference workload given
    if gate == "kvgate":  # low refused at the door (SLO unreachable), high waiters dropped after 2 s
        assert by["low"]["rejected"] > 0 and by["high"]["rejected"] > 0
        assert by["high"]["max_wait"] <= 2.0
