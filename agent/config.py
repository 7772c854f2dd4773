"""The node agent's configuration: command-line flags, validated at start with errors naming the flag."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from store import keys


class ConfigError(ValueError):
    def __init__(self, name: str, value: object, reason: str) -> None:
        super().__init__(f"{name}: {value!r}: {reason}")


@dataclass(frozen=True)
class AgentConfig:
    worker_url: str  # http://host:port of the worker (vLLM / SGLang OpenAI server)
    redis_url: str
    model: str | None = None  # pool to register under; None = every model the worker's /v1/models lists
    worker_id: str | None = None  # default: host:port of worker_url
    heartbeat_ms: int = 1000
    lease_periods: int = 4  # lease = heartbeat_ms * lease_periods (design: 3-5)
    fail_periods: int = 3  # failed probes in a row before the agent stops renewing the lease
    drain_quiet_periods: int = 2  # idle probes in a row before a draining worker deregisters
    max_concurrency: int = 0  # requests the worker takes at once; 0 = unknown (gateway default)
    kv_events: str | None = None  # ZMQ endpoint of the worker's KV-event publisher (exact mode)
    # tokens per router block in exact mode (the gateway's block size); 0 = the worker's own block size
    # from `vllm:cache_config_info` (16 when it publishes none)
    router_block_size: int = 16
    kv_events_replay: str | None = None  # the publisher's replay socket (vLLM's replay_endpoint)
    kv_events_dp_size: int = 1  # data-parallel ranks: one subscription each, at the base port + rank
    # bound of this worker's exact index entries in Redis (an LRU set with last-active times); 0 = its
    # KV capacity in router blocks. Smaller keeps the summary small at the cost of forgetting cold blocks
    index_max_blocks: int = 0
    http_timeout_s: float = 2.0
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # the agent's own /healthz and /metrics; 0 = any free port
    inflight_path: str = "/kvgate/inflight"

    def __post_init__(self) -> None:
        url = urlsplit(self.worker_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError("--worker-url", self.worker_url, "must be http(s)://host:port")
        if not self.redis_url:
            raise ConfigError("--redis", self.redis_url, "required (or set KVGATE_REDIS_URL)")
        if self.model is not None:
            try:
                keys.model_key(self.model)
            except ValueError as e:
                raise ConfigError("--model", self.model, str(e)) from None
        if self.worker_id is not None and (not self.worker_id or self.worker_id == "log"):
            raise ConfigError("--worker-id", self.worker_id, "must be non-empty and not 'log'")
        for name, value, low in (
            ("--heartbeat-ms", self.heartbeat_ms, 10),
            ("--lease-periods", self.lease_periods, 2),
            ("--fail-periods", self.fail_periods, 1),
            ("--drain-quiet-periods", self.drain_quiet_periods, 1),
            ("--max-concurrency", self.max_concurrency, 0),
            ("--router-block-size", self.router_block_size, 0),
            ("--kv-events-dp-size", self.kv_events_dp_size, 1),
            ("--index-max-blocks", self.index_max_blocks, 0),
            ("--port", self.listen_port, 0),
        ):
            if value < low:
                raise ConfigError(name, value, f"must be >= {low}")
        if self.http_timeout_s <= 0:
            raise ConfigError("--http-timeout-s", self.http_timeout_s, "must be > 0")
        if self.kv_events is not None and not self.kv_events.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                "--kv-events", self.kv_events, "must be a ZMQ endpoint (tcp://host:port, ipc://...)"
            )
        if self.kv_events_replay is not None and (
            self.kv_events is None or not self.kv_events_replay.startswith(("tcp://", "ipc://", "inproc://"))
        ):
            raise ConfigError(
                "--kv-events-replay", self.kv_events_replay, "must be a ZMQ endpoint, with --kv-events"
            )

    @property
    def id(self) -> str:
        url = urlsplit(self.worker_url)
        return self.worker_id or f"{url.hostname}:{url.port or (443 if url.scheme == 'https' else 80)}"

    @property
    def lease_ms(self) -> int:
        return self.heartbeat_ms * self.lease_periods

    @property
    def base_url(self) -> str:
        return self.worker_url.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvgate agent",
        description="Node agent beside one worker: registers it in Redis, heartbeats its lease with the "
        "load scraped from /metrics, publishes its cache summary, obeys drain.",
    )
    p.add_argument("--worker-url", required=True, help="the worker's base URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--model", help="model pool to register under (default: every model in GET /v1/models)")
    p.add_argument("--worker-id", help="worker id in the registry (default: host:port of --worker-url)")
    p.add_argument(
        "--redis", default=os.environ.get("KVGATE_REDIS_URL"), help="Redis URL (or KVGATE_REDIS_URL)"
    )
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="heartbeat period in ms (default 1000)")
    p.add_argument(
        "--lease-periods", type=int, default=4, help="lease length in heartbeat periods (default 4)"
    )
    p.add_argument("--fail-periods", type=int, default=3, help="failed probes before the lease is let go")
    p.add_argument("--drain-quiet-periods", type=int, default=2, help="idle probes before a drain completes")
    p.add_argument(
        "--max-concurrency", type=int, default=0, help="requests the worker runs at once (0 = unknown)"
    )
    p.add_argument("--kv-events", help="ZMQ endpoint of the worker's KV-event publisher (exact mode)")
    p.add_argument(
        "--router-block-size",
        type=int,
        default=16,
        help="tokens per router block (exact mode); 0 = the worker's block size (vllm:cache_config_info)",
    )
    p.add_argument("--kv-events-replay", help="ZMQ endpoint of the publisher's replay socket (gap resync)")
    p.add_argument(
        "--kv-events-dp-size", type=int, default=1, help="data-parallel ranks publishing (port + rank each)"
    )
    p.add_argument(
        "--index-max-blocks",
        type=int,
        default=0,
        help="bound of the worker's index entries in Redis, LRU (0 = its KV capacity in router blocks)",
    )
    p.add_argument("--http-timeout-s", type=float, default=2.0, help="timeout of each call to the worker")
    p.add_argument("--host", default="127.0.0.1", help="address of the agent's own /healthz and /metrics")
    p.add_argument(
        "--port", type=int, default=0, help="port of the agent's own /healthz and /metrics (0 = any)"
    )
    return p


def parse_args(argv: list[str]) -> AgentConfig:
    """An `AgentConfig` from command-line arguments; raises ConfigError (or exits on --help)."""
    args = build_parser().parse_args(argv)
    return AgentConfig(
        worker_url=args.worker_url,
        redis_url=args.redis or "",
        model=args.model,
        worker_id=args.worker_id,
        heartbeat_ms=args.heartbeat_ms,
        lease_periods=args.lease_periods,
        fail_periods=args.fail_periods,
        drain_quiet_periods=args.drain_quiet_periods,
        max_concurrency=args.max_concurrency,
        kv_events=args.kv_events,
        router_block_size=args.router_block_size,
        kv_events_replay=args.kv_events_replay,
        kv_events_dp_size=args.kv_events_dp_size,
        index_max_blocks=args.index_max_blocks,
        http_timeout_s=args.http_timeout_s,
        listen_host=args.host,
        listen_port=args.port,
    )
