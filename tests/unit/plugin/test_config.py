"""Gateway config: defaults, the shipped example, and errors that name the key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin.config import ConfigError, GatewayConfig, config_from_dict, key_digest, load_config

EXAMPLE = Path(__file__).parents[3] / "examples" / "kvgate.toml"


def test_defaults_without_a_file() -> None:
    assert load_config(None) == GatewayConfig()
    assert load_config("") == GatewayConfig()


def test_shipped_example_loads() -> None:
    config = load_config(EXAMPLE)
    assert config.priority.header == "x-kvgate-priority"
    assert config.key_to_tenant()  # the example documents a tenant with a key


def test_tenants_and_models() -> None:
    config = config_from_dict(
        {
            "auth": {"enabled": True},
            "tenants": {"acme": {"api_keys": ["k1", "k2"], "max_band": "normal"}},
            "models": {"llama": {"total": 8}},
            "admission": {"default_total": 100000},
        }
    )
    assert config.key_to_tenant() == {key_digest("k1"): "acme", key_digest("k2"): "acme"}
    assert config.models["llama"].total == 8
    assert (config.models["llama"].on_worker_full, config.models["llama"].reroute_attempts) == ("reroute", 8)


def test_prefix_mode_per_model_overrides_the_routing_default() -> None:
    config = config_from_dict(
        {
            "routing": {"prefix_mode": "exact"},
            "models": {"a": {"prefix_mode": "approximate"}, "b": {"total": 2}},
        }
    )
    assert config.routing.prefix_mode == "exact"
    assert config.prefix_modes() == {"a": "approximate"}  # b (and unlisted models) use the default
    assert GatewayConfig().routing.prefix_mode == "approximate"


@pytest.mark.parametrize(
    ("data", "path"),
    [
        pytest.param({"nope": 1}, "nope", id="unknown top-level key"),
        pytest.param(
            {"limits": {"max_bodybytes": 1}}, "limits.max_bodybytes", id="unknown nested key (typo)"
        ),
        pytest.param({"limits": {"max_messages": 0}}, "limits.max_messages", id="limit below 1"),
        pytest.param({"limits": {"max_messages": "9"}}, "limits.max_messages", id="string for an integer"),
        pytest.param({"limits": {"max_n": True}}, "limits.max_n", id="bool is not an integer"),
        pytest.param({"gateway": {"response_headers": 1}}, "gateway.response_headers", id="int for a bool"),
        pytest.param({"limits": []}, "limits", id="array for a table"),
        pytest.param({"routing": {"chunk_chars": 4}}, "routing.chunk_chars", id="chunk below 16 chars"),
        pytest.param({"routing": {"refresh_ms": 0}}, "routing.refresh_ms", id="refresh below 50 ms"),
        pytest.param(
            {"admission": {"shed_low_after_ms": -1}}, "admission.shed_low_after_ms", id="negative shed"
        ),
        pytest.param({"tenants": {"a": {"max_band": "urgent"}}}, "tenants.a.max_band", id="unknown band"),
        pytest.param({"tenants": {"a": {"api_keys": "k"}}}, "tenants.a.api_keys", id="string for an array"),
        pytest.param(
            {"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}},
            "tenants.b.api_keys[0]",
            id="one key for two tenants",
        ),
        pytest.param({"routing": {"policy": "random"}}, "routing.policy", id="unknown policy"),
        pytest.param(
            {"models": {"m": {"on_worker_full": "drop"}}},
            "models.m.on_worker_full",
            id="unknown full-worker mode",
        ),
        pytest.param(
            {"models": {"m": {"reroute_attempts": -1}}}, "models.m.reroute_attempts", id="negative reroutes"
        ),
        pytest.param(
            {"admission": {"lease_ms": 1000, "renew_every_ms": 900}},
            "admission.renew_every_ms",
            id="renewal slower than half the lease",
        ),
        pytest.param({"priority": {"header": "x kvgate"}}, "priority.header", id="header name with a space"),
        pytest.param({"models": {"m": {"total": -1}}}, "models.m.total", id="negative model quota"),
        pytest.param(
            {"routing": {"prefix_mode": "precise"}}, "routing.prefix_mode", id="unknown prefix mode"
        ),
        pytest.param(
            {"models": {"m": {"prefix_mode": "tokens"}}},
            "models.m.prefix_mode",
            id="unknown model prefix mode",
        ),
        pytest.param(
            {"routing": {"tokenize_timeout_ms": 0}}, "routing.tokenize_timeout_ms", id="zero tokenize timeout"
        ),
        pytest.param({"routing": {"exact_block_size": -16}}, "routing.exact_block_size", id="negative block"),
        pytest.param(
            {"models": {"m": {"tokens_per_seat": 0}}}, "models.m.tokens_per_seat", id="zero seat size"
        ),
        pytest.param({"models": {"m": {"max_seats": 0}}}, "models.m.max_seats", id="zero max seats"),
        pytest.param(
            {"admission": {"queue_signal": "overdue"}}, "admission.queue_signal", id="unknown queue signal"
        ),
    ],
)
def test_invalid_config_names_the_key(data: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert str(info.value).startswith(f"{path}:")


@pytest.mark.parametrize(
    ("model", "uncached", "max_tokens", "seats"),
    [
        pytest.param({}, 90_000, 4_000, 1, id="requests counted by default: 1 seat"),
        pytest.param({"count_seats": True}, 3_000, 1_000, 1, id="4096-token seats: a chat request is 1"),
        pytest.param({"count_seats": True}, 90_000, 4_000, 16, id="4096-token seats: capped at 16"),
        pytest.param(
            {"count_seats": True, "tokens_per_seat": 512}, 3_000, 1_000, 8, id="512-token seats: 4000 is 8"
        ),
        pytest.param(
            {"count_seats": True, "tokens_per_seat": 512, "max_seats": 64},
            90_000,
            4_000,
            64,
            id="512-token seats: capped at max_seats",
        ),
    ],
)
def test_model_seats_follow_its_seat_size(
    model: dict[str, object], uncached: int, max_tokens: int, seats: int
) -> None:
    section = config_from_dict({"models": {"m": model}}).models["m"]
    assert section.seats(uncached, max_tokens) == seats


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[limits\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
