"""policy/kvgate.py: kvgate's default policy on hand-made cases, one rule per case."""

from __future__ import annotations

import dataclasses
import random

import pytest

from policy.config import (
    ColdStartConfig,
    ConfigError,
    ReplicaConfig,
    RoutingConfig,
    StickyConfig,
    TtftModelConfig,
)
from policy.index import PrefixIndex
from policy.kvgate import KvgatePolicy, build_policy
from policy.profile import Profile
from policy.state import RoutingState
from policy.types import Decision, RequestView, WorkerView

# 1000 prefill tokens/s, no decode slowdown, no overhead: predicted TTFT is easy to compute by hand
CONFIG = RoutingConfig(
    ttft=TtftModelConfig(
        prefill_tokens_per_s=1000.0,
        decode_slowdown=0.0,
        overhead_s=0.0,
        attention_s_per_token_ctx=0.0,
        miss_weight=0.0,
    ),
    cold_start=ColdStartConfig(period_s=0.0),
)
POLICY = KvgatePolicy(CONFIG)


def req(hits: dict[str, int] | None = None, **kw: object) -> RequestView:
    base: dict[str, object] = {
        "id": "r",
        "prefix_hashes": (1, 2, 3, 4),
        "block_tokens": (500, 500, 500, 500),
        "prompt_tokens": 2000,
        "prefix_hits": hits or {},
    }
    base.update(kw)
    return RequestView(**base)  # type: ignore[arg-type]


def w(wid: str, queued: int = 0, **kw: object) -> WorkerView:
    return WorkerView(id=wid, pending_prefill_tokens=queued, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_view", "workers", "winner", "reason"),
    [
        pytest.param(req(), [w("a", 1000), w("b", 0)], "b", "miss", id="miss: least queued prefill"),
        pytest.param(
            req({"a": 4}), [w("a", 1000), w("b", 0)], "a", "prefix 1.00", id="hit worth 2 s beats 1 s queue"
        ),
        pytest.param(
            req({"a": 4}), [w("a", 3000), w("b", 0)], "b", "miss", id="queue of 3 s beats a 2 s hit"
        ),
        pytest.param(
            req({"a": 1}),
            [w("a", 100), w("b", 0)],
            "b",
            "miss",
            id="25 % hit is below the 30 % min gain: ignored",
        ),
        pytest.param(req({"a": 2}), [w("a", 900), w("b", 0)], "a", "prefix 0.50", id="50 % hit counts"),
        pytest.param(
            req({"a": 4}), [w("a", draining=True), w("b", 5000)], "b", "miss", id="never a draining worker"
        ),
        pytest.param(
            req({"a": 4}), [w("a", healthy=False), w("b", 5000)], "b", "miss", id="never an unhealthy worker"
        ),
        pytest.param(
            req({"a": 4}, sticky_worker="a", sticky_since_s=0.0),
            [w("a", 1500), w("b", 0)],
            "a",
            "sticky",
            id="sticky within window under overload",
        ),
        pytest.param(
            req({}, sticky_worker="a", sticky_since_s=0.0),
            [w("a", 900), w("b", 0)],
            "b",
            "miss",
            id="sticky released: its 2.9 s exceed the 2 s of serving it on b (although < 2 × 2 s)",
        ),
        pytest.param(
            req({}, sticky_worker="a", sticky_since_s=0.0),
            [w("a", 900, overdue_s=1.5), w("b", 900)],
            "b",
            "miss",
            id="sticky released: its queue already runs 1.5 s late (3.5 s > 2.9 s on b)",
        ),
        pytest.param(
            req({}, sticky_worker="a", sticky_since_s=0.0),
            [w("a", 5000), w("b", 0)],
            "b",
            "miss",
            id="sticky worker overloaded (7 s > 1 s and > 2 × 2 s): released",
        ),
        pytest.param(
            req({}, sticky_worker="a", sticky_since_s=-31.0),
            [w("a", 900), w("b", 0)],
            "b",
            "miss",
            id="sticky window over",
        ),
    ],
)
def test_kvgate_decisions(
    request_view: RequestView, workers: list[WorkerView], winner: str, reason: str
) -> None:
    d = POLICY.decide(request_view, workers, random.Random(0), now_s=0.0)
    assert d.worker == winner
    assert reason in d.reason
    assert set(d.scores) <= {x.id for x in workers}
    assert set(d.scores[winner]) == {
        "prefix-match",
        "predicted-ttft",
        "queue-wait",
        "dispatched-wait",
        "miss-work",
        "cold-start",
        "cost",
    }


def test_dispatched_wait_counts_the_queued_prefill_and_not_the_lateness() -> None:
    # a worker whose queue runs 5 s late with about 1 s of prefill dispatched there: the lateness signal
    # says 5 s, the dispatched one only what this gateway sent
    model = POLICY.ttft.model
    worker = w("a", int(model.prefill_tokens_per_s), overdue_s=5.0)
    d = POLICY.decide(req(), [worker], random.Random(0), now_s=0.0)
    assert d.scores["a"]["queue-wait"] == pytest.approx(model.overhead_s + 5.0)
    queued_s = int(model.prefill_tokens_per_s) / model.prefill_tokens_per_s * model.slowdown(worker)
    assert d.scores["a"]["dispatched-wait"] == pytest.approx(model.overhead_s + queued_s)
    assert d.scores["a"]["dispatched-wait"] < 1.1


def test_below_min_gain_is_a_tie_broken_by_seed() -> None:
    picks = {POLICY.decide(req({"a": 1}), [w("a"), w("b")], random.Random(s), 0.0).worker for s in range(20)}
    assert picks == {"a", "b"}, "a 25 % hit is ignored, so the two workers cost the same"


def test_replica_cap_keeps_a_prefix_on_its_holders() -> None:
    policy = KvgatePolicy(
        RoutingConfig(
            ttft=dataclasses.replace(CONFIG.ttft, miss_weight=1.0),
            cold_start=ColdStartConfig(period_s=60.0, discount=0.5),
            replicas=ReplicaConfig(cap=2, hot_rate_per_s=1.0),
            sticky=StickyConfig(window_s=0.0),
        )
    )
    held = req({"a": 4, "b": 4}, prefix_rate=0.2)
    # a, b: 2.5 s; c, new: 2 s + 2 s of miss work = 4 s, halved by its cold-start discount to 2 s
    workers = [w("a", 2500), w("b", 2500), w("c", 0, joined_s=100.0)]
    d = policy.decide(held, workers, random.Random(0), 100.0)
    assert d.worker in {"a", "b"} and "replicas" in d.reason
    hot = req({"a": 4, "b": 4}, prefix_rate=5.0)  # hot and the holders' best TTFT 2.5 s ≥ 1 s: may replicate
    assert policy.decide(hot, workers, random.Random(0), 100.0).worker == "c"
    # not hot, but the holders' 4.5 s exceed the 4 s of serving it on c: the cap does not hold
    slow = [w("a", 4500), w("b", 4500), w("c", 0, joined_s=100.0)]
    assert policy.decide(held, slow, random.Random(0), 100.0).worker == "c"


def test_cold_start_discount_attracts_a_new_worker() -> None:
    policy = KvgatePolicy(
        RoutingConfig(ttft=CONFIG.ttft, cold_start=ColdStartConfig(period_s=60, discount=0.5))
    )
    workers = [w("old", 100, joined_s=0.0), w("new", 1000, joined_s=100.0)]
    # old: 2.1 s; new: 3.0 s × (1 − 0.5 × 50/60) = 1.75 s
    d = policy.decide(req(), workers, random.Random(0), now_s=110.0)
    assert d.worker == "new" and "cold-start" in d.reason
    assert policy.decide(req(), workers, random.Random(0), now_s=200.0).worker == "old"


def test_miss_weight_charges_uncached_work_twice() -> None:
    weighted = KvgatePolicy(
        dataclasses.replace(CONFIG, ttft=dataclasses.replace(CONFIG.ttft, miss_weight=1.0))
    )
    workers = [w("a", 3000), w("b", 0)]  # a: 3 s queue, hit; b: idle, 2 s miss (+2 s with miss weight 1)
    assert POLICY.decide(req({"a": 4}), workers, random.Random(0), 0.0).worker == "b"
    d = weighted.decide(req({"a": 4}), workers, random.Random(0), 0.0)
    assert d.worker == "a" and d.scores["b"]["miss-work"] == pytest.approx(2.0)


def test_hot_prefix_replicates_onto_the_least_loaded_worker() -> None:
    hot = req({"a": 4}, prefix_rate=5.0)
    workers = [w("a", 500, inflight=20), w("b", 0, inflight=0)]
    cold_policy = KvgatePolicy(
        dataclasses.replace(CONFIG, replicas=ReplicaConfig(proactive=False, hot_rate_per_s=1.0))
    )
    assert cold_policy.decide(hot, workers, random.Random(0), 0.0).worker == "a", "a 2 s miss loses to 0.5 s"
    d = POLICY.decide(hot, workers, random.Random(0), 0.0)
    assert d.worker == "b" and "replica" in d.reason
    assert POLICY.decide(req({"a": 4}, prefix_rate=0.1), workers, random.Random(0), 0.0).worker == "a"


@pytest.mark.parametrize(
    ("bonus", "hot_bonus", "rate", "winner"),
    [
        pytest.param(0.0, False, 0.0, "b", id="no bonus: cheaper worker"),
        pytest.param(0.5, False, 0.0, "a", id="bonus keeps the last worker"),
        pytest.param(0.5, False, 5.0, "b", id="no bonus for hot prefixes"),
        pytest.param(0.5, True, 5.0, "a", id="hot bonus"),
    ],
)
def test_soft_sticky_bonus(bonus: float, hot_bonus: bool, rate: float, winner: str) -> None:
    config = dataclasses.replace(
        CONFIG,
        sticky=StickyConfig(window_s=0.0, bonus=bonus, hot_bonus=hot_bonus),
        replicas=ReplicaConfig(proactive=False, hot_rate_per_s=1.0),
    )
    view = req({}, sticky_worker="a", sticky_since_s=0.0, prefix_rate=rate)
    d = KvgatePolicy(config).decide(view, [w("a", 1000), w("b", 0)], random.Random(0), 100.0)
    assert d.worker == winner  # a: 3 s, b: 2 s


def test_reject_when_nobody_is_eligible() -> None:
    d = POLICY.decide(req(), [w("a", draining=True)], random.Random(0), 0.0)
    assert d.worker is None and "eligible" in d.reason


def test_build_policy_selects_by_name() -> None:
    assert isinstance(build_policy(RoutingConfig()), KvgatePolicy)
    article = build_policy(RoutingConfig(policy="article"))
    assert isinstance(article, Profile) and article.name == "article"


WEIGHTED = KvgatePolicy(dataclasses.replace(CONFIG, ttft=dataclasses.replace(CONFIG.ttft, miss_weight=1.0)))


def test_sticky_holds_while_its_wait_is_below_the_recompute_elsewhere() -> None:
    # a: 0.9 s queued + 2 s own prefill = 2.9 s, cost 4.9; b: 2 s TTFT + 2 s miss work = 4 s
    r = req({}, sticky_worker="a", sticky_since_s=0.0)
    assert WEIGHTED.decide(r, [w("a", 900), w("b", 0)], random.Random(0), 0.0).worker == "a"
    # a's queue runs 1.5 s late: the wait is at least that (0.9 -> 1.5 s), 3.5 s TTFT < 4 s: still held
    assert WEIGHTED.decide(r, [w("a", 900, overdue_s=1.5), w("b", 0)], random.Random(0), 0.0).worker == "a"
    # 2.5 s late: 4.5 s TTFT > 4 s elsewhere: released, and the cost model sends it to b
    d = WEIGHTED.decide(r, [w("a", 900, overdue_s=2.5), w("b", 0)], random.Random(0), 0.0)
    assert d.worker == "b" and d.scores["a"]["predicted-ttft"] == pytest.approx(2.9)  # the model alone


def test_a_new_replica_pays_its_prefill_shared_by_the_requests_it_will_serve() -> None:
    # hot at 1 req/s, one holder, 30 s window: a replica expects 1 × 30 / 2 = 15 requests, so b is
    # charged 2 s / 16 = 0.125 s of its 2 s prefill (not 0: replicas are not free)
    hot = req({"a": 4}, prefix_rate=1.0)
    policy = KvgatePolicy(dataclasses.replace(CONFIG, replicas=ReplicaConfig(hot_rate_per_s=1.0)))
    assert policy.decide(hot, [w("a", 100), w("b", 0)], random.Random(0), 0.0).worker == "a"  # 0.1 s wait
    d = policy.decide(hot, [w("a", 200), w("b", 0)], random.Random(0), 0.0)  # 0.2 s wait: replicate
    assert d.worker == "b" and d.scores["b"]["predicted-ttft"] == pytest.approx(2.0)


def test_proactive_when_holders_loaded_copies_a_hot_prefix_only_once_no_holder_serves_it_sooner() -> None:
    # hot at 1 req/s held whole on a; b idle. miss_weight 1: a plain recompute on b costs 2 + 2 = 4 s.
    # A replica on b is priced 2 - 2 x 15/16 = 0.125 s, so "always" copies even while a serves the
    # request in 0.2 s (tenants at 0.8, docs/BENCHMARKS.md session 10: such copies lost 2-4 hit points).
    # "holders_loaded" copies only once no holder serves it sooner than its full 2 s prefill on an
    # idle worker (the test hot_evidence applies to the young reading).
    ttft = dataclasses.replace(CONFIG.ttft, miss_weight=1.0)
    hot = req({"a": 4}, prefix_rate=1.0)

    def policy(when: str) -> KvgatePolicy:
        replicas = ReplicaConfig(hot_rate_per_s=1.0, proactive_when=when)
        return KvgatePolicy(dataclasses.replace(CONFIG, ttft=ttft, replicas=replicas))

    free = [w("a", 200), w("b", 0)]
    d = policy("always").decide(hot, free, random.Random(0), 0.0)
    assert d.worker == "b" and "replica" in d.reason
    d = policy("holders_loaded").decide(hot, free, random.Random(0), 0.0)
    assert d.worker == "a" and "replica" not in d.reason
    assert d.scores["b"]["cost"] == pytest.approx(4.0)  # b is priced as a plain recompute
    # a's queue runs 2.5 s late although only 0.2 s of prefill is queued: loaded, b takes the copy
    late = [w("a", 200, overdue_s=2.5), w("b", 0)]
    d = policy("holders_loaded").decide(hot, late, random.Random(0), 0.0)
    assert d.worker == "b" and "replica" in d.reason
    for loaded in ([w("a", 2000), w("b", 0)], [w("a", 3000), w("b", 0)]):  # a's hit buys nothing
        d = policy("holders_loaded").decide(hot, loaded, random.Random(0), 0.0)
        assert d.worker == "b" and "replica" in d.reason


def test_proactive_when_priced_copies_a_hot_prefix_only_when_its_later_requests_gain_more() -> None:
    # the setting of the test above: a (holding the prefix) serves the request in 0.2 s, b is idle, a
    # copy on b costs its 2 s prefill (policy/replica_price.py)
    ttft = dataclasses.replace(CONFIG.ttft, miss_weight=1.0)
    replicas = ReplicaConfig(hot_rate_per_s=1.0, proactive_when="priced")
    policy = KvgatePolicy(dataclasses.replace(CONFIG, ttft=ttft, replicas=replicas))
    free = [w("a", 200), w("b", 0, capacity_tokens=10_000)]
    # 1 req/s with no decode: it loads a by nothing; the requests of the next 0.2 s gain 0.1 s each
    light = req({"a": 4}, prefix_rate=1.0, prefix_age_s=60.0)
    d = policy.decide(light, free, random.Random(0), 0.0)
    assert d.worker == "a" and d.scores["b"]["cost"] == pytest.approx(4.0)  # a plain recompute
    # 10 req/s decoding 1000 tokens each: 1.24+ engine-s/s, more than a can carry: b takes the copy
    heavy = req({"a": 4}, prefix_rate=10.0, prefix_age_s=60.0, max_tokens=1000)
    d = policy.decide(heavy, free, random.Random(0), 0.0)
    assert d.worker == "b" and "replica" in d.reason
    # a 2 s backlog on a: 1.5 req/s x 2 s x 2 s / 2 = 3 s saved, more than the 2 s prefill: copied...
    backlog = [w("a", 2000), w("b", 0, capacity_tokens=10_000)]
    steady = req({"a": 4}, prefix_rate=1.5, prefix_age_s=1e6)
    assert policy.decide(steady, backlog, random.Random(0), 0.0).worker == "b"
    # ...unless b's KV is full: the 2000 tokens it pushes out cost another 2 s, 4 s > 3 s
    full = dataclasses.replace(steady, cache_fill={"a": 1.0, "b": 1.0})
    d = policy.decide(full, backlog, random.Random(0), 0.0)
    assert d.worker == "a" and d.scores["b"]["cost"] == pytest.approx(4.0)


def test_proactive_when_is_validated() -> None:
    with pytest.raises(ConfigError, match="proactive_when"):
        ReplicaConfig(proactive_when="sometimes")


def test_a_hit_is_capacity_when_every_worker_is_busy() -> None:
    # a holds half the prompt: TTFT 4 s queued + 1 s = 5 s; b: 2.5 s queued + 2 s = 4.5 s (miss_weight 0).
    # Both busy: even b has 1.25 full prefills queued, so each second of recompute counts 1.25 s more:
    # a 5 + 1.25 x 1 = 6.25 s < b 4.5 + 1.25 x 2 = 7 s. The hit wins; load balance would buy nothing.
    r = req({"a": 2})
    assert POLICY.decide(r, [w("a", 4000), w("b", 2500)], random.Random(0), 0.0).worker == "a"
    # the same hit with an idle worker beside it: no busy weight, b's 2 s beat a's 5 s
    assert POLICY.decide(r, [w("a", 4000), w("b", 0)], random.Random(0), 0.0).worker == "b"
    # and with the rule off (busy_weight_max 0), b's lower TTFT wins although every worker is busy
    off = KvgatePolicy(
        dataclasses.replace(CONFIG, ttft=dataclasses.replace(CONFIG.ttft, busy_weight_max=0.0))
    )
    assert off.decide(r, [w("a", 4000), w("b", 2500)], random.Random(0), 0.0).worker == "b"


def test_every_queue_running_late_makes_a_hit_capacity_even_with_little_prefill_queued() -> None:
    # a holds 3 of 4 blocks behind 2 s of queued prefill: TTFT 2 + 0.5 = 2.5 s; b has nothing queued by
    # the model (2 s miss). Cost without a busy weight: a 2.5 s > b 2 s, the prefix moves. But b's queue
    # already runs 2.5 s late (a KV-bound engine admits nothing while its queued prefill looks small),
    # so every worker waits >= 2 s, one full prefill: busy = 1, a 2.5 + 1 x 0.5 = 3 s < b 2 + 1 x 2 = 4 s.
    r = req({"a": 3})
    assert POLICY.decide(r, [w("a", 2000), w("b", 0, overdue_s=2.5)], random.Random(0), 0.0).worker == "a"
    # one late worker alone does not make everyone busy: with b punctual, b's 2 s wins
    assert POLICY.decide(r, [w("a", 2000, overdue_s=5.0), w("b", 0)], random.Random(0), 0.0).worker == "b"


def test_at_overload_a_hot_prefix_stays_on_its_holder_instead_of_copying_its_prefill() -> None:
    # a hot prefix (5 req/s: a replica expects 5 x 30 / 2 = 75 requests) held whole on a, 3.5 s queued;
    # b holds nothing, 2 s queued: a replica there costs 2 s + 2 s of prefill, 98.7 % of it discounted as
    # an investment. Both busy (b has 1 full prefill queued, busy = 1): only 1 / (1 + 1) of the investment
    # is paid by idle capacity, the other half is capacity lost to every queued request (miss work at
    # weight busy): b = 4 - 2 x 0.987 / 2 + 1 x 2 x 1/2 = 4.01 s > a's 3.5 s. Without that, b: 3.01 s.
    hot = req({"a": 4}, prefix_rate=5.0)
    policy = KvgatePolicy(dataclasses.replace(CONFIG, replicas=ReplicaConfig(hot_rate_per_s=1.0)))
    d = policy.decide(hot, [w("a", 3500), w("b", 2000)], random.Random(0), 0.0)
    assert d.worker == "a"
    assert d.scores["b"]["miss-work"] == pytest.approx(1.0)  # half of b's 2 s replica prefill
    assert d.scores["b"]["cost"] == pytest.approx(4.0 - 2.0 * (1 - 1 / 76) / 2 + 1.0)
    # with an idle worker beside it there is capacity to invest: the replica goes to b
    d = policy.decide(hot, [w("a", 3500), w("b", 0)], random.Random(0), 0.0)
    assert d.worker == "b" and "replica" in d.reason and d.scores["b"]["miss-work"] == 0.0
    # routing.ttft.replica_busy = false: the replica's prefill is never miss work (before session 9)
    ttft = dataclasses.replace(CONFIG.ttft, replica_busy=False)
    off = KvgatePolicy(dataclasses.replace(CONFIG, ttft=ttft, replicas=ReplicaConfig(hot_rate_per_s=1.0)))
    assert off.decide(hot, [w("a", 3500), w("b", 2000)], random.Random(0), 0.0).worker == "b"


def test_a_recompute_is_charged_by_what_it_displaces_at_the_cluster_load() -> None:
    # a holds the prompt behind a 3 s queue; b is idle: a 2 s miss, plus 2 s of miss work at weight 1.
    # Fixed weight: 3 s < 4 s, held on a. Queueing: at rho 0.2 over 16 workers an arrival finds a free
    # worker (Erlang C ~ 0), so nobody waits behind b's recompute: 2 s < 3 s, b. At rho 1 every
    # recompute delays someone: the full weight again, a.
    queueing = KvgatePolicy(
        dataclasses.replace(
            CONFIG, ttft=dataclasses.replace(CONFIG.ttft, miss_weight=1.0, miss_load="queueing")
        )
    )
    workers = [w("a", 3000), w("b", 0)]
    light = req({"a": 4}, cluster_load=0.2, pool_workers=16)
    full = req({"a": 4}, cluster_load=1.0, pool_workers=16)
    assert WEIGHTED.decide(light, workers, random.Random(0), 0.0).worker == "a"
    assert queueing.decide(light, workers, random.Random(0), 0.0).worker == "b"
    assert queueing.decide(full, workers, random.Random(0), 0.0).worker == "a"
    # the guards' limit reads the same weight: a sticky hold on a is released at light load only
    sticky = {"sticky_worker": "a", "sticky_since_s": 0.0, "pool_workers": 16}
    assert (
        queueing.decide(req({"a": 4}, cluster_load=0.2, **sticky), workers, random.Random(0), 0.0).worker
        == "b"
    )
    assert (
        queueing.decide(req({"a": 4}, cluster_load=1.0, **sticky), workers, random.Random(0), 0.0).worker
        == "a"
    )


def test_a_prefix_hot_from_its_first_seconds_replicates_instead_of_being_held() -> None:
    # one shared prompt, 4 requests within 0.3 s, all placed on a: its 4th finds a with 3 s of queued
    # prefill. With the plain EWMA the prefix reads 4 × ln 2 / 30 s = 0.09 req/s (not hot: the sticky
    # window holds it on a, 3 + 0 s < b's 2 s + 2 s recompute); counted from its first request it
    # reads 3 / 2 s (the young window) = 1.5 req/s: hot, so the sticky window leaves it to the replica rules
    # and b, with the replica's prefill shared by the requests it can expect, wins.
    workers = [w("a", 3000), w("b", 0)]
    picks = {}
    for floor in (0.0, 2.0):
        config = dataclasses.replace(
            CONFIG,
            rate_young_window_s=floor,
            ttft=dataclasses.replace(CONFIG.ttft, miss_weight=1.0),
            replicas=ReplicaConfig(hot_rate_per_s=0.3),
        )
        state = RoutingState(config, PrefixIndex(1000))
        view = None
        for i in range(4):
            view = state.prepare(
                request_id=f"r{i}",
                prefix_hashes=[1, 2, 3, 4],
                block_tokens=[500, 500, 500, 500],
                prompt_tokens=2000,
                workers=workers,
                now_s=0.1 * i,
            )
            if i < 3:
                state.commit(view, Decision(worker="a", reason="test"), 0.1 * i)
        assert view is not None
        picks[floor] = KvgatePolicy(config).decide(view, workers, random.Random(0), 0.3)
    assert picks[0.0].worker == "a" and "sticky" in picks[0.0].reason
    assert picks[2.0].worker == "b" and "replica" in picks[2.0].reason


def _young_view(config: RoutingConfig, workers: list[WorkerView], arrivals: int) -> RequestView:
    """`arrivals` requests of one new prefix 0.1 s apart, all placed on a; the view of the last one."""
    state = RoutingState(config, PrefixIndex(1000))
    view = None
    for i in range(arrivals):
        view = state.prepare(
            request_id=f"r{i}",
            prefix_hashes=[1, 2, 3, 4],
            block_tokens=[500, 500, 500, 500],
            prompt_tokens=2000,
            workers=workers,
            now_s=0.1 * i,
        )
        if i < arrivals - 1:
            state.commit(view, Decision(worker="a", reason="test"), 0.1 * i)
    assert view is not None
    return view


def test_a_young_prefix_is_not_hot_while_its_holder_still_serves_it_sooner_than_a_recompute() -> None:
    # mooncake_arxiv 1.2/8 (docs/BENCHMARKS.md, session 9): a new document's 4th question in 0.3 s reads
    # its 2 committed requests after the first ÷ 2 s = 1 req/s in the young window (hot), while its
    # holder a has only 0.3 s of prefill queued. Read as hot, the sticky hold was skipped and a replica
    # on idle b was priced as shared by 1 req/s × 30 s of future requests: the request paid a full
    # 2 s prefill on b (a flap) instead of 0.3 s on a. The young reading counts only while every
    # holder is loaded.
    config = dataclasses.replace(
        CONFIG,
        rate_young_window_s=2.0,
        ttft=dataclasses.replace(CONFIG.ttft, miss_weight=1.0),
        replicas=ReplicaConfig(hot_rate_per_s=0.3),
    )
    policy = KvgatePolicy(config)
    light = [w("a", 300), w("b", 0)]
    view = _young_view(config, light, 4)
    assert view.prefix_rate >= 0.9 and view.prefix_rate_steady is not None and view.prefix_rate_steady < 0.3
    pick = policy.decide(view, light, random.Random(0), 0.3)
    assert pick.worker == "a" and "sticky" in pick.reason
    assert policy.hot_evidence(view, light).prefix_rate == view.prefix_rate_steady
    # the same burst with 3 s queued on a (its hit now buys nothing): hot, b takes a replica
    loaded = [w("a", 3000), w("b", 0)]
    view = _young_view(config, loaded, 4)
    assert policy.hot_evidence(view, loaded) is view
    pick = policy.decide(view, loaded, random.Random(0), 0.3)
    assert pick.worker == "b" and "replica" in pick.reason


def _horizon_config(replica_gain: str) -> RoutingConfig:
    """The young window (2 s) with `rate_young_bound = "horizon"`, every miss's prefill counted as work
    others wait for, and a prefix hot at 0.3 req/s: the share horizon's tests."""
    return dataclasses.replace(
        CONFIG,
        rate_young_window_s=2.0,
        rate_young_bound="horizon",
        rate_young_replica_gain=replica_gain,
        ttft=dataclasses.replace(CONFIG.ttft, miss_weight=1.0),
        replicas=ReplicaConfig(hot_rate_per_s=0.3),
    )


def test_a_replica_built_on_the_young_reading_is_shared_by_the_requests_it_has_shown_only() -> None:
    # `rate_young_bound = "horizon"` (docs/BENCHMARKS.md, the share horizon, session 10): mooncake_arxiv
    # 1.2/8's document had 4 requests in its first 2 s, and the young reading (1.5 req/s) priced a
    # replica on an idle worker as shared by 1.5 × 30 s ÷ 2 = 22.5 later requests. Here 2 requests after
    # the first read 1 req/s; over the stickiness window that is 15 requests per replica (share 0.94,
    # the replica costs 2 s × 0.06 = 0.125 s), over the young window 1 (share 0.5, 1 s): the holder a
    # with 0.5 s queued keeps the request; with 1.5 s queued the replica on b still wins.
    config = _horizon_config("any")
    policy = KvgatePolicy(config)
    light = [w("a", 500), w("b", 0)]
    view = _young_view(config, light, 4)
    assert view.prefix_rate >= 0.9 and view.prefix_rate_steady is not None and view.prefix_rate_steady < 0.3
    pick = policy.decide(view, light, random.Random(0), 0.3)
    assert pick.worker == "a" and "replica" in pick.reason  # hot (no sticky hold), but not copied
    assert pick.scores["b"]["cost"] == pytest.approx(1.0, abs=0.05)
    loaded = [w("a", 1500), w("b", 0)]
    view = _young_view(config, loaded, 4)
    pick = policy.decide(view, loaded, random.Random(0), 0.3)
    assert pick.worker == "b" and "replica" in pick.reason


def test_a_replica_on_the_young_reading_must_serve_its_own_request_sooner_than_the_holder() -> None:
    # rag 1.2/16 (docs/BENCHMARKS.md, the share horizon, session 10): 9 requests lost their document's
    # hit to a copy on an idle worker that served them later than the holder would have (request 78:
    # holder 0.104 s predicted, the copy 0.120 s), priced as shared by the young reading's requests.
    # With `rate_young_replica_gain = "sooner"` such a copy is a plain recompute: holder a with 1.5 s
    # queued (sooner than b's 2 s full prefill) keeps the request; with 2.5 s queued b's replica wins.
    config = _horizon_config("sooner")
    policy = KvgatePolicy(config)
    sooner = [w("a", 1500), w("b", 0)]
    view = _young_view(config, sooner, 4)
    pick = policy.decide(view, sooner, random.Random(0), 0.3)
    assert pick.worker == "a"
    assert pick.scores["b"]["cost"] == pytest.approx(4.0, abs=0.05)  # 2 s prefill + 2 s miss work
    later = [w("a", 2500), w("b", 0)]
    view = _young_view(config, later, 4)
    pick = policy.decide(view, later, random.Random(0), 0.3)
    assert pick.worker == "b" and "replica" in pick.reason


def test_a_replica_on_the_young_reading_is_discounted_by_at_most_the_holders_lead() -> None:
    # `rate_young_replica_gain = "wait"`: a later request of the prefix gains over the holder at most
    # the holder's lead (its predicted TTFT minus the copy's once it holds the prefix), so the share
    # discount per request is capped by it. Holder a with 1.1 s queued: the copy on b (2 s prefill,
    # share 0.5) is discounted by 1.1 × 0.5, not 2 × 0.5, and costs 1.45 s: a keeps the request
    # (without the cap b costs 1.0 s and wins).
    config = _horizon_config("wait")
    policy = KvgatePolicy(config)
    workers = [w("a", 1100), w("b", 0)]
    view = _young_view(config, workers, 4)
    pick = policy.decide(view, workers, random.Random(0), 0.3)
    assert pick.worker == "a"
    assert pick.scores["b"]["cost"] == pytest.approx(1.45, abs=0.05)


def test_a_hit_goes_where_the_running_decodes_read_less_kv_before_its_first_token() -> None:
    # both hold the whole prompt. a has nothing queued but a decode batch of 1M context tokens: every
    # engine step reads their KV (5.6e-8 s per token), 1.5 steps up to the first token = 0.084 s.
    # b has 50 tokens of prefill queued (0.05 s) and nothing decoding: b is sooner. Without the read
    # term a looks free (0 s against 0.05 s).
    hit = req({"a": 4, "b": 4})
    workers = [w("a", 0, inflight=30, decoding_context_tokens=1_000_000), w("b", 50, inflight=1)]
    on = KvgatePolicy(
        dataclasses.replace(CONFIG, ttft=dataclasses.replace(CONFIG.ttft, decode_batch_read=True))
    )
    d = on.decide(hit, workers, random.Random(0), 0.0)
    assert d.worker == "b"
    assert d.scores["a"]["predicted-ttft"] == pytest.approx(1.5 * 5.6e-8 * 1_000_000)
    # the default (routing.ttft.decode_batch_read = false): the running batch is not counted
    assert POLICY.decide(hit, workers, random.Random(0), 0.0).worker == "a"
