"""Every decision carries its reason's class (`Decision.kind`), the one the metrics and records use."""

from __future__ import annotations

import random

from policy.config import ColdStartConfig, RoutingConfig
from policy.kvgate import KvgatePolicy
from policy.types import ReasonKind
from tests.unit.policy.test_kvgate import CONFIG, POLICY, req, w


def test_a_prefix_hit_is_a_cache_hit_and_a_miss_is_load() -> None:
    hit = POLICY.decide(req({"a": 4}), [w("a"), w("b")], random.Random(0), 0.0)
    assert hit.worker == "a" and hit.kind is ReasonKind.CACHE_HIT and hit.reason.startswith("prefix")
    busy_holder = POLICY.decide(req({"a": 4}), [w("a", 100_000), w("b")], random.Random(0), 0.0)
    assert busy_holder.worker == "b" and busy_holder.kind is ReasonKind.LOAD
    assert busy_holder.reason.startswith("miss")


def test_a_new_worker_won_on_its_cold_start_discount_is_exploration() -> None:
    policy = KvgatePolicy(
        RoutingConfig(ttft=CONFIG.ttft, cold_start=ColdStartConfig(period_s=60, discount=0.5))
    )
    workers = [w("old", 100, joined_s=0.0), w("new", 1000, joined_s=100.0)]
    d = policy.decide(req(), workers, random.Random(0), now_s=110.0)
    assert d.worker == "new" and d.kind is ReasonKind.EXPLORATION and "cold-start" in d.reason


def test_a_decision_without_a_kind_is_a_fallback() -> None:
    rejected = POLICY.decide(req(), [w("a", draining=True)], random.Random(0), 0.0)
    assert rejected.worker is None and rejected.kind is ReasonKind.FALLBACK
