"""policy/config.py: defaults, validation with paths, unknown keys."""

from __future__ import annotations

import pytest

from policy.config import ConfigError, RoutingConfig, load_routing_config


def test_defaults_match_the_article() -> None:
    c = RoutingConfig()
    assert (c.policy, c.min_cache_gain, c.sticky.window_s, c.replicas.cap) == ("kvgate", 0.3, 30.0, 3)
    assert (c.article.w_load, c.article.w_cache, c.article.w_stable) == (1.2, 0.7, 0.3)


def test_load_builds_nested_tables_and_widens_ints() -> None:
    c = load_routing_config({"policy": "article", "sticky": {"window_s": 10}, "replicas": {"cap": 4}})
    assert c.policy == "article" and c.sticky.window_s == 10.0 and c.replicas.cap == 4
    assert c.ttft == RoutingConfig().ttft


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        pytest.param({"sticky": {"window_s": -1}}, "routing.sticky.window_s", id="negative window"),
        pytest.param({"min_cache_gain": 1.5}, "routing.min_cache_gain", id="gain above 1"),
        pytest.param({"replicas": {"cap": 0}}, "routing.replicas.cap", id="replica cap 0"),
        pytest.param({"policy": "fastest"}, "routing.policy", id="unknown policy"),
        pytest.param({"stickiness": {}}, "routing.stickiness", id="unknown key"),
        pytest.param({"ttft": 3}, "routing.ttft", id="table expected"),
        pytest.param(
            {"ttft": {"prefill_tokens_per_s": "fast"}}, "routing.ttft.prefill_tokens_per_s", id="type"
        ),
        pytest.param({"cold_start": {"discount": 1.0}}, "routing.cold_start.discount", id="discount 1"),
        pytest.param({"replicas": {"cap": True}}, "routing.replicas.cap", id="bool is not an int"),
        pytest.param({"ttft": {"miss_load": "erlang"}}, "routing.ttft.miss_load", id="unknown miss_load"),
        pytest.param({"rate_young_bound": "cap"}, "routing.rate_young_bound", id="unknown young bound"),
        pytest.param(
            {"rate_young_replica_gain": "all"}, "routing.rate_young_replica_gain", id="unknown young gain"
        ),
    ],
)
def test_bad_values_are_errors_with_a_path(raw: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_routing_config(raw)
    assert err.value.path == path
    assert str(err.value).startswith(path + ":")
