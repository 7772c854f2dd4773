"""The A/B arm assignment: stable per key, about `share` of the keys, a conversation in one arm."""

from __future__ import annotations

import random

import pytest

from plugin.config import ConfigError, RoutingSection
from policy.ab import CANDIDATE_ARM, DEFAULT_ARM, arm_of


def test_share_of_keys_in_the_candidate_arm() -> None:
    rng = random.Random(3)
    keys = [(rng.getrandbits(64),) for _ in range(20_000)]
    share = sum(arm_of(0.2, "t", k, "prefix") == CANDIDATE_ARM for k in keys) / len(keys)
    assert share == pytest.approx(0.2, abs=0.01)
    assert all(arm_of(0.0, "t", k, "prefix") == DEFAULT_ARM for k in keys[:100])


def test_a_conversation_stays_in_one_arm() -> None:
    first_block = 123456789
    turns = [(first_block, *range(n)) for n in range(1, 10)]  # every turn starts with the same block
    assert len({arm_of(0.5, "t", t, "prefix") for t in turns}) == 1
    tenants = {arm_of(0.5, "acme", (i,), "tenant") for i in range(50)}
    assert len(tenants) == 1  # by tenant: the prefix does not matter


def test_config_checks_the_split() -> None:
    with pytest.raises(ConfigError, match=r"routing\.ab_share"):
        RoutingSection(ab_policy="round_robin", ab_share=1.5)
    with pytest.raises(ConfigError, match=r"routing\.ab_policy"):
        RoutingSection(ab_policy="random", ab_share=0.5)
    with pytest.raises(ConfigError, match=r"routing\.ab_by"):
        RoutingSection(ab_by="session")
