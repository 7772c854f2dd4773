"""The gateway's configuration: one TOML file, validated at start, errors that name the key path.

Sections and defaults live in the dataclasses below (the one place defaults are written); the
documented example is examples/kvgate.toml. Unknown keys are rejected, a bad value is an error and
never a quiet default. Per-process knobs (config path, Redis URL, gateway id) are mitmproxy `--set`
options declared by the addon, not settings here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy.ab import SPLIT_KEYS
from policy.admission import (
    DEFAULT_MAX_QUEUE_MS,
    DEFAULT_MAX_SEATS,
    DEFAULT_QUEUE_SIGNAL,
    DEFAULT_TOKENS_PER_SEAT,
    QUEUE_SIGNALS,
    seat_count,
)
from policy.config import POLICIES, RoutingConfig, load_routing_config
from policy.config import ConfigError as PolicyConfigError
from policy.types import Band
from policy.worker_auth import secret_from_env

PREFIX_MODES = ("approximate", "exact")
BAND_NAMES = tuple(b.name.lower() for b in Band)


class ConfigError(ValueError):
    """A config value is invalid; the message starts with the key path (`limits.max_messages: ...`)."""

    def __init__(self, path: str, value: object, reason: str) -> None:
        super().__init__(f"{path}: {value!r}: {reason}")
        self.path = path


@dataclass(frozen=True)
class GatewaySection:
    response_headers: bool = field(default=True, metadata={"help": "send x-kvgate-worker / -queued-ms"})
    drain_timeout_ms: int = field(default=30_000, metadata={"help": "SIGTERM: how long live streams may run"})
    upstream_scheme: str = field(default="http", metadata={"help": "scheme used when a worker URL has none"})
    # the client's Authorization is never forwarded; workers started with an API key (vLLM --api-key)
    # get this one instead: per worker id, else the default ("env:NAME" reads the environment)
    upstream_api_key: str = ""
    upstream_api_keys: dict[str, str] = field(default_factory=dict)
    # shared secret of the worker plane (policy/worker_auth.py): only workers whose agents sign with it
    # are routable; "" = $KVGATE_WORKER_SECRET, and with neither the worker plane is not authenticated
    worker_secret: str = ""
    # what Redis being unreachable means for a request: "closed", 503 + Retry-After; "open", admitted
    # within this gateway's local share of the quota and routed on the mirror (plugin/open_admission.py)
    redis_failure: str = "closed"
    redis_timeout_ms: int = 2000  # a Redis reply slower than this counts as a failure

    def __post_init__(self) -> None:
        _at_least("gateway.drain_timeout_ms", self.drain_timeout_ms, 0)
        _one_of("gateway.upstream_scheme", self.upstream_scheme, ("http", "https"))
        _one_of("gateway.redis_failure", self.redis_failure, ("closed", "open"))
        _at_least("gateway.redis_timeout_ms", self.redis_timeout_ms, 1500)  # the index tail blocks 1 s
        secret_value("gateway.worker_secret", self.worker_secret)
        secret_value("gateway.upstream_api_key", self.upstream_api_key)
        for worker, key in self.upstream_api_keys.items():
            secret_value(f"gateway.upstream_api_keys.{worker}", key)

    def worker_secret_bytes(self) -> bytes:
        """The worker-plane secret: this section's, else $KVGATE_WORKER_SECRET (b"" = none)."""
        return secret_value("gateway.worker_secret", self.worker_secret).encode() or secret_from_env()

    def upstream_key(self, worker_id: str) -> str:
        """The API key sent to `worker_id` ("" = none)."""
        return secret_value("", self.upstream_api_keys.get(worker_id, self.upstream_api_key))


@dataclass(frozen=True)
class LimitsSection:
    max_body_bytes: int = 4_000_000
    max_messages: int = 2_048
    max_prompt_chars: int = 2_000_000
    max_tokens: int = 131_072  # upper bound accepted for max_tokens / max_completion_tokens
    default_max_tokens: int = 256  # assumed output length when the request gives none (seats, routing)
    max_n: int = 16
    # a client must hand over a complete request (headers and body) this soon after its connection
    # opens or its previous answer ends; slower ones are cut off (plugin/client_deadline.py)
    client_request_timeout_ms: int = 60_000

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_prompt_chars", "max_tokens", "max_n"):
            _at_least(f"limits.{name}", getattr(self, name), 1)
        _at_least("limits.client_request_timeout_ms", self.client_request_timeout_ms, 100)
        _at_least("limits.default_max_tokens", self.default_max_tokens, 1)
        if self.default_max_tokens > self.max_tokens:
            raise ConfigError(
                "limits.default_max_tokens", self.default_max_tokens, "must be <= limits.max_tokens"
            )


@dataclass(frozen=True)
class TenantSection:
    api_keys: list[str] = field(default_factory=list)
    max_band: str = "high"  # the most urgent band this tenant may ask for; higher asks are clamped
    default_band: str = "normal"

    def check(self, path: str) -> None:
        for name in ("max_band", "default_band"):
            try:
                Band.parse(getattr(self, name))
            except ValueError as e:
                raise ConfigError(f"{path}.{name}", getattr(self, name), str(e)) from None


@dataclass(frozen=True)
class AuthSection:
    enabled: bool = False  # on: a request without a known Bearer key gets 401
    default_tenant: str = "default"  # tenant of requests without a key while auth is off


@dataclass(frozen=True)
class PrioritySection:
    header: str = "x-kvgate-priority"
    wait_header: str = "x-kvgate-max-wait-ms"
    # the request's time-to-first-token SLO: refused at the door when the chosen worker's predicted
    # TTFT already misses it, and never queued past it (docs/ADMISSION.md "SLO-aware rejection")
    slo_header: str = "x-kvgate-ttft-slo-ms"

    def __post_init__(self) -> None:
        for name in ("header", "wait_header", "slo_header"):
            value = getattr(self, name)
            if not value or not all(c.isalnum() or c in "-_" for c in value):
                raise ConfigError(
                    f"priority.{name}", value, "must be a header name (letters, digits, - or _)"
                )


@dataclass(frozen=True)
class AdmissionSection:
    max_wait_ms: int = 30_000  # default wait budget in the queue; the wait header may lower it
    lease_ms: int = 10_000
    renew_every_ms: int = 2_000
    # concurrent requests per model across all gateways when [models."<m>"].total is not set;
    # 0 = derive from the workers (sum of their max_concurrency)
    default_total: int = 0
    audit_every_ms: int = 5_000  # leases vs workers' in-flight ids (plugin/audit.py); 0 = off
    drift_warn: int = 1  # log a warning when the audited drift of a model reaches this
    # nominal seats of each band as fractions of a model's total (policy/admission.py default_quota:
    # high and normal may borrow what lower bands leave unused, low may not). {} (the default) = the
    # total only: work-conserving, bands ordered by the queues; the simulator's kvgate gate runs with
    # {high = 0.5, normal = 0.3, low = 0.2} (docs/ADMISSION.md "Band shares")
    band_shares: dict[str, float] = field(default_factory=dict)
    # sustained pressure: once the high/normal queues have had waiters this long, new low-priority
    # requests get 429 `shed` at once (policy/pressure.py); 0 = never shed
    shed_low_after_ms: int = 5_000
    # the engine-queue guard at the door: a request below high priority is refused (429 `queue_too_deep`,
    # Retry-After) when the chosen worker's predicted wait before its own prefill (prompts queued ahead
    # of it, or the lateness that queue already shows) exceeds this; 0 = off (docs/ADMISSION.md; the
    # default is the setting measured live, policy/admission.py DEFAULT_MAX_QUEUE_MS)
    max_queue_ms: int = DEFAULT_MAX_QUEUE_MS
    # which predicted wait the guard compares with max_queue_ms: "lateness" = the queued prefill or the
    # most overdue pending request's lateness, whichever is longer (the kvgate policy's `queue-wait`);
    # "dispatched" = only the prefill this gateway dispatched there and has seen no first token for, at
    # the TTFT model's rate (`dispatched-wait`): no lateness, so a slow machine does not raise it;
    # "dispatched_ttft" = that plus the request's own uncached prefill there (`predicted-ttft`): a miss is
    # refused before a hit at the same queue
    queue_signal: str = DEFAULT_QUEUE_SIGNAL

    def __post_init__(self) -> None:
        _at_least("admission.max_wait_ms", self.max_wait_ms, 0)
        _at_least("admission.audit_every_ms", self.audit_every_ms, 0)
        _at_least("admission.drift_warn", self.drift_warn, 1)
        _at_least("admission.shed_low_after_ms", self.shed_low_after_ms, 0)
        _at_least("admission.max_queue_ms", self.max_queue_ms, 0)
        _one_of("admission.queue_signal", self.queue_signal, tuple(QUEUE_SIGNALS))
        _check_shares("admission.band_shares", self.band_shares)
        _at_least("admission.default_total", self.default_total, 0)
        _at_least("admission.lease_ms", self.lease_ms, 100)
        _at_least("admission.renew_every_ms", self.renew_every_ms, 10)
        if self.renew_every_ms * 2 > self.lease_ms:
            raise ConfigError("admission.renew_every_ms", self.renew_every_ms, "must be <= lease_ms / 2")


@dataclass(frozen=True)
class ModelSection:
    total: int = 0  # concurrent requests (or seats) of this model across all gateways; 0 = default_total
    tenant: int = 0  # cap per tenant; 0 = none
    queue_max: int = 0  # waiters per band queue; 0 = the admission default
    count_seats: bool = False  # true: a request costs seats by its size (policy/admission.py seat_count)
    # with count_seats: KV tokens per seat and the most seats one request takes (size `total` to match:
    # workers x KV tokens per worker / tokens_per_seat); the simulator's KvgateConfig has the same two
    tokens_per_seat: int = DEFAULT_TOKENS_PER_SEAT
    max_seats: int = DEFAULT_MAX_SEATS
    prefix_mode: str = ""  # approximate | exact; "" = routing.prefix_mode
    # exact mode: a local model directory (tokenizer.json, tokenizer_config.json) so the gateway
    # tokenizes and renders the chat template itself; "" = ask the workers' /tokenize
    tokenizer: str = ""
    band_shares: dict[str, float] | None = None  # None = admission.band_shares

    def seats(self, uncached_prompt_tokens: int, max_tokens: int) -> int:
        """Seats one request of this model asks for: by cost with count_seats, else 1."""
        if not self.count_seats:
            return 1
        return seat_count(uncached_prompt_tokens, max_tokens, self.tokens_per_seat, self.max_seats)

    def shares(self, default: Mapping[str, float]) -> dict[Band, float]:
        """Nominal band shares of this model (band -> fraction of total); empty = no band limits."""
        chosen = default if self.band_shares is None else self.band_shares
        return {Band[name.upper()]: share for name, share in chosen.items()}

    # two-step admission, when the chosen worker is at its max_concurrency: "reroute" tries the next
    # best workers (up to reroute_attempts), then waits; "wait" waits for that worker (docs/ADMISSION.md)
    on_worker_full: str = "reroute"
    reroute_attempts: int = 8  # each try is one round trip; 8 covers a small pool whole

    def check(self, path: str) -> None:
        for name in ("total", "tenant", "queue_max", "reroute_attempts"):
            _at_least(f"{path}.{name}", getattr(self, name), 0)
        for name in ("tokens_per_seat", "max_seats"):
            _at_least(f"{path}.{name}", getattr(self, name), 1)
        if self.prefix_mode:
            _one_of(f"{path}.prefix_mode", self.prefix_mode, PREFIX_MODES)
        if self.band_shares is not None:
            _check_shares(f"{path}.band_shares", self.band_shares)
        _one_of(f"{path}.on_worker_full", self.on_worker_full, ("reroute", "wait"))


ROUTING_POLICIES = ("kvgate", "article", "round_robin", "least_loaded")


@dataclass(frozen=True)
class RoutingSection:
    policy: str = "kvgate"  # kvgate | article | round_robin | least_loaded
    chunk_chars: int = 512  # approximate mode: characters per hashed block (CPU vs precision)
    refresh_ms: int = 500  # worker registry mirror refresh period
    write_index: bool = True  # approximate mode: write index entries to Redis after routing
    seed: int = 0
    # prefix index of models without their own [models."<m>"].prefix_mode: approximate (text chunks,
    # written by gateways) | exact (token blocks from the workers' /tokenize, written by agents from
    # KV events); docs/ROUTING.md "Exact mode"
    prefix_mode: str = "approximate"
    exact_block_size: int = 0  # tokens per block in exact mode; 0 = the agents' registered router block size
    tokenize_timeout_ms: int = 250  # exact mode: a slower /tokenize answer -> approximate for that request
    tokenize_cache_entries: int = 4096  # exact mode: LRU of request prompt -> token ids (0 = off)
    # exact mode: insert a routed request's blocks into this gateway's mirror at once (not into Redis),
    # until the worker's KV events confirm or remove them; false = only what the agents report
    exact_speculative: bool = True
    # exact mode: how long a speculative entry lives unless the worker's BlockStored confirms it
    # (Dynamo, llm-d and vllm-router use 2-5 s)
    exact_speculative_ttl_ms: int = 3000
    # a routed request whose prefix blocks cover fewer tokens writes no index entry (short prefixes are
    # cheap to prefill again; keeps the per-worker summaries small); 0 = every prefix
    index_min_prefix_tokens: int = 0
    # hit feedback (policy/feedback.py): a worker reporting fewer cached prompt tokens than the index
    # expected drops its entries older than the first block it missed, here and in Redis
    hit_feedback: bool = False
    # fleets above candidates_limit workers: a decision scores the prefix's holders (at most that many)
    # plus candidates_sample random others, not every worker (policy/candidates.py; docs/ROUTING.md)
    candidates_limit: int = 64
    candidates_sample: int = 16
    # tuning of the kvgate / article policy: policy/config.py RoutingConfig fields (docs/ROUTING.md)
    tuning: dict[str, object] = field(default_factory=dict)
    # A/B split (docs/OPERATIONS.md): `ab_share` of the traffic is routed with `ab_policy` (arm
    # "candidate"), assigned by tenant or by the first prefix block so a conversation stays in one arm
    ab_policy: str = ""  # "" = no split
    ab_share: float = 0.0
    ab_by: str = "prefix"  # prefix | tenant

    def __post_init__(self) -> None:
        _one_of("routing.policy", self.policy, ROUTING_POLICIES)
        if self.ab_policy:
            _one_of("routing.ab_policy", self.ab_policy, ROUTING_POLICIES)
        if not 0.0 <= self.ab_share <= 1.0:
            raise ConfigError("routing.ab_share", self.ab_share, "must be between 0 and 1")
        _one_of("routing.ab_by", self.ab_by, SPLIT_KEYS)
        _at_least("routing.chunk_chars", self.chunk_chars, 16)
        _at_least("routing.refresh_ms", self.refresh_ms, 50)
        _one_of("routing.prefix_mode", self.prefix_mode, PREFIX_MODES)
        _at_least("routing.exact_block_size", self.exact_block_size, 0)
        _at_least("routing.tokenize_timeout_ms", self.tokenize_timeout_ms, 1)
        _at_least("routing.exact_speculative_ttl_ms", self.exact_speculative_ttl_ms, 1)
        _at_least("routing.index_min_prefix_tokens", self.index_min_prefix_tokens, 0)
        _at_least("routing.tokenize_cache_entries", self.tokenize_cache_entries, 0)
        _at_least("routing.candidates_limit", self.candidates_limit, 1)
        _at_least("routing.candidates_sample", self.candidates_sample, 1)
        self.policy_config()  # validate the tuning table now

    def policy_config(self, policy: str = "") -> RoutingConfig:
        """The pure policy's config (policy/config.py) for `policy` (default: routing.policy);
        ConfigError names the key path."""
        raw = dict(self.tuning)
        if policy:
            raw["policy"] = policy if policy in POLICIES else "kvgate"
        else:
            raw.setdefault("policy", self.policy if self.policy in POLICIES else "kvgate")
        try:
            return load_routing_config(raw, "routing.tuning")
        except PolicyConfigError as e:
            raise ConfigError(e.path, e.value, e.reason) from None


@dataclass(frozen=True)
class StreamingSection:
    # ask the worker for the usage chunk so cached tokens are measured; removed again from the
    # client's stream when the client did not ask for it
    collect_usage: bool = True


@dataclass(frozen=True)
class DecisionLogSection:
    redis_stream: bool = True  # XADD one record per request to kvg:decisions (capped)
    stream_maxlen: int = 10_000
    log: bool = False  # also write each record to the Python log (INFO, logger plugin.decision_log)
    # also append each record to this JSON-lines file (written from a thread); rotated to PATH.1 once
    # it reaches file_max_mb, so at most twice that is kept; "" = no file
    file: str = ""
    file_max_mb: int = 100
    prompt_text: bool = False  # put the prompt's text in each record (off: only its block hashes)

    def __post_init__(self) -> None:
        _at_least("decision_log.stream_maxlen", self.stream_maxlen, 1)
        _at_least("decision_log.file_max_mb", self.file_max_mb, 1)


@dataclass(frozen=True)
class GatewayConfig:
    gateway: GatewaySection = field(default_factory=GatewaySection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    auth: AuthSection = field(default_factory=AuthSection)
    tenants: dict[str, TenantSection] = field(default_factory=dict)
    priority: PrioritySection = field(default_factory=PrioritySection)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    models: dict[str, ModelSection] = field(default_factory=dict)
    routing: RoutingSection = field(default_factory=RoutingSection)
    streaming: StreamingSection = field(default_factory=StreamingSection)
    decision_log: DecisionLogSection = field(default_factory=DecisionLogSection)

    def __post_init__(self) -> None:
        for name, model in self.models.items():
            model.check(f"models.{name}")
        seen: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            tenant.check(f"tenants.{name}")
            for i, key in enumerate(tenant.api_keys):
                if not key:
                    raise ConfigError(f"tenants.{name}.api_keys[{i}]", key, "must not be empty")
                digest = key_digest(key)
                if digest in seen:
                    raise ConfigError(
                        f"tenants.{name}.api_keys[{i}]", "***", f"already used by {seen[digest]}"
                    )
                seen[digest] = name

    def tokenizers(self) -> dict[str, str]:
        """model -> local tokenizer directory, for the models that name one."""
        return {name: m.tokenizer for name, m in self.models.items() if m.tokenizer}

    def prefix_modes(self) -> dict[str, str]:
        """Models whose prefix mode differs from routing.prefix_mode (the others use that)."""
        return {name: m.prefix_mode for name, m in self.models.items() if m.prefix_mode}

    def key_to_tenant(self) -> dict[str, str]:
        """sha256 hex digest of each API key -> its tenant: keys live in memory hashed only; in the file
        a key may be given as `sha256:<hex>` so it is hashed at rest too."""
        return {key_digest(key): name for name, t in self.tenants.items() for key in t.api_keys}


def key_digest(key: str) -> str:
    """The sha256 hex digest an API key is compared by; `sha256:<hex>` in the config is one already."""
    if key.startswith("sha256:"):
        return key.removeprefix("sha256:").lower()
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()  # a header's raw bytes


def secret_value(path: str, value: str) -> str:
    """A secret as configured: "env:NAME" reads $NAME (ConfigError if unset), else the text itself."""
    if not value.startswith("env:"):
        if "\r" in value or "\n" in value or "\0" in value:
            raise ConfigError(path, "***", "may not contain CR, LF or NUL")
        return value
    name = value.removeprefix("env:")
    found = os.environ.get(name)
    if found is None:
        raise ConfigError(path, value, f"environment variable {name} is not set")
    return found


def load_config(path: str | Path | None) -> GatewayConfig:
    """Read and validate a TOML file; None or "" gives the defaults. Raises ConfigError."""
    if not path:
        return GatewayConfig()
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError("kvgate_config", str(path), f"cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("kvgate_config", str(path), f"invalid TOML: {e}") from None
    return config_from_dict(data)


def config_from_dict(data: Mapping[str, Any]) -> GatewayConfig:
    """Build a GatewayConfig from parsed TOML (tests use this too). Raises ConfigError."""
    config: GatewayConfig = _build(GatewayConfig, data, "")
    return config


def _build(cls: type[Any], data: object, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", data, "must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(_join(path, key), data[key], f"unknown key (known: {', '.join(sorted(names))})")
    kwargs = {key: _convert(hints[key], value, _join(path, key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(path or "<root>", dict(data), str(e)) from None


def _convert(hint: Any, value: object, path: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(typing.cast(type[Any], hint), value, path)
    if origin is dict:
        _, value_hint = typing.get_args(hint)
        if not isinstance(value, Mapping):
            raise ConfigError(path, value, "must be a table")
        return {str(k): _convert(value_hint, v, _join(path, str(k))) for k, v in value.items()}
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(path, value, "must be an array")
        return [_convert(item_hint, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if hint is object:
        return value
    if origin in (typing.Union, types.UnionType):
        present = [h for h in typing.get_args(hint) if h is not type(None)]
        if len(present) != 1:
            raise TypeError(f"unsupported config type {hint} at {path}")
        return _convert(present[0], value, path)  # `X | None`: absent from TOML = None
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "must be true or false")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, value, "must be a number")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, "must be an integer")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "must be a string")
        return value
    raise TypeError(f"unsupported config type {hint} at {path}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _at_least(path: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(path, value, f"must be >= {low}")


def _check_shares(path: str, shares: Mapping[str, float]) -> None:
    for band, share in shares.items():
        _one_of(f"{path}.{band}", band, BAND_NAMES)
        if not 0 <= share <= 1:
            raise ConfigError(f"{path}.{band}", share, "must be between 0 and 1")
    if sum(shares.values()) > 1 + 1e-9:
        raise ConfigError(path, dict(shares), "shares must add up to at most 1")


def _one_of(path: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(path, value, f"must be one of {', '.join(choices)}")
