"""Agent flags: parsed into AgentConfig, bad values rejected with the flag named."""

from __future__ import annotations

import pytest

from agent.config import AgentConfig, ConfigError, parse_args

BASE = ["--worker-url", "http://127.0.0.1:8001", "--redis", "redis://127.0.0.1:6379/0"]


def test_defaults_and_derived_values() -> None:
    config = parse_args(BASE)
    assert (config.id, config.lease_ms, config.model, config.kv_events) == (
        "127.0.0.1:8001",
        4000,
        None,
        None,
    )
    assert parse_args([*BASE, "--worker-id", "gpu-3", "--heartbeat-ms", "500"]).lease_ms == 2000
    assert parse_args([*BASE, "--worker-id", "gpu-3"]).id == "gpu-3"
    assert parse_args([*BASE, "--index-max-blocks", "5000"]).index_max_blocks == 5000


def test_redis_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_REDIS_URL", "redis://env:1/0")
    assert parse_args(["--worker-url", "http://w:1"]).redis_url == "redis://env:1/0"


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        pytest.param(["--worker-url", "ftp://x"], "--worker-url", id="worker url must be http"),
        pytest.param(["--model", "a{b}"], "--model", id="model with braces"),
        pytest.param(["--worker-id", "log"], "--worker-id", id="reserved worker id"),
        pytest.param(["--heartbeat-ms", "0"], "--heartbeat-ms", id="heartbeat too short"),
        pytest.param(["--lease-periods", "1"], "--lease-periods", id="lease of one period"),
        pytest.param(["--kv-events", "localhost:5557"], "--kv-events", id="kv events not a zmq endpoint"),
        pytest.param(["--http-timeout-s", "0"], "--http-timeout-s", id="zero timeout"),
        pytest.param(["--index-max-blocks", "-1"], "--index-max-blocks", id="negative index bound"),
    ],
)
def test_bad_values_name_the_flag(extra: list[str], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        parse_args([*BASE, *extra])


def test_redis_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_REDIS_URL", raising=False)
    with pytest.raises(ConfigError, match="--redis"):
        parse_args(["--worker-url", "http://w:1"])
    with pytest.raises(ConfigError, match="--redis"):
        AgentConfig(worker_url="http://w:1", redis_url="")
