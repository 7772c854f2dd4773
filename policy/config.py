"""Routing configuration: frozen dataclasses with their defaults in one place, validated on construction.

`load_routing_config(raw)` builds a `RoutingConfig` from a mapping (the `routing` table of the config file),
rejects unknown keys and reports every error with its path (`routing.sticky.window_s: 0.5: must be ...`).
A bad value is an error, never a quiet default. Ranges and meanings are in docs/ROUTING.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("kvgate", "article")
MISS_LOAD_MODES = ("fixed", "queueing")  # scorers.ServeCost.displaced
YOUNG_BOUNDS = ("gate", "horizon")  # how the young window's reading is bounded (policy/kvgate.py)
YOUNG_REPLICA_GAINS = ("any", "sooner", "wait")  # what a replica priced on the young reading must offer
PROACTIVE_WHEN = ("always", "holders_loaded", "priced")  # when a hot prefix may grow a proactive replica


class ConfigError(ValueError):
    """A configuration value is invalid; `path` names where (e.g. `routing.sticky.window_s`)."""

    def __init__(self, path: str, value: object, reason: str) -> None:
        super().__init__(f"{path}: {value!r}: {reason}")
        self.path = path
        self.value = value
        self.reason = reason


def _within(lo: float, hi: float, default: float, help: str = "") -> Any:
    """A float field whose value must lie in [lo, hi] (checked by `_check_ranges`)."""
    return field(default=default, metadata={"range": (lo, hi), **({"help": help} if help else {})})


def _check_ranges(config: Any) -> None:
    """Every `_within` field of `config` in its range, in declaration order (the first out is the error)."""
    for f in dataclasses.fields(config):
        if "range" in f.metadata:
            lo, hi = f.metadata["range"]
            value = getattr(config, f.name)
            if not lo <= value <= hi:
                raise ConfigError(f.name, value, f"must be between {lo} and {hi}")


@dataclass(frozen=True)
class TtftModelConfig:
    """Predicted time to first token on a worker (scorers.PredictedTtft)."""

    # defaults: Llama-3.1-8B on one H100 (bench/sim/profiles/h100-llama3.1-8b.toml: 22.4 µs/token linear,
    # 1.06e-6 ms per new×context token of attention, ~7 ms per engine step)
    prefill_tokens_per_s: float = _within(1.0, 1e8, 44_600.0, "uncached prompt tokens/s")
    attention_s_per_token_ctx: float = _within(
        0.0, 1e-3, 1.06e-9, "attention time per (new token × context token), seconds"
    )
    decode_slowdown: float = _within(
        0.0, 1.0, 0.005, "prefill slowdown per in-flight request (decodes share steps)"
    )
    overhead_s: float = _within(0.0, 60.0, 0.01, "fixed per-request time (first step)")
    miss_weight: float = _within(
        0.0, 100.0, 1.0, "extra weight of this request's uncached prefill (work others wait for)"
    )
    busy_weight_max: float = _within(
        0.0, 100.0, 4.0, "cap of the extra miss weight when every worker is busy (a hit is capacity)"
    )
    decode_s_per_token: float = _within(
        0.0, 10.0, 1.24e-4, "decode time per output token in a full batch (cluster load only)"
    )
    decode_s_per_token_ctx: float = _within(
        0.0, 1e-3, 5.6e-8, "... plus this per context token (the KV read of every engine step)"
    )
    decode_batch_read: bool = field(
        default=False,
        metadata={
            "help": "the predicted TTFT counts the KV read of the worker's running decodes in the engine "
            "steps before the first token (decode_s_per_token_ctx × their context; off by default: "
            "better p50, worse p99 on the issue-9 grids, docs/BENCHMARKS.md session 10)"
        },
    )
    replica_busy: bool = field(
        default=True,
        metadata={
            "help": "when every worker is busy, busy/(1+busy) of a new replica's prefill is miss work "
            "(false: the replica's prefill is never miss work, as before session 9)"
        },
    )
    miss_load: str = field(
        default="fixed",
        metadata={"help": "how the cluster load scales miss_weight: fixed (default) or queueing (Erlang C)"},
    )

    def __post_init__(self) -> None:
        _check_ranges(self)
        if self.miss_load not in MISS_LOAD_MODES:
            raise ConfigError("miss_load", self.miss_load, f"must be one of {', '.join(MISS_LOAD_MODES)}")


@dataclass(frozen=True)
class StickyConfig:
    """A prefix stays on its worker for `window_s` after it landed there, unless that worker is overloaded."""

    window_s: float = _within(0.0, 3600.0, 30.0, "hold time; 0 = off, article: 10–60")
    overload_ttft_s: float = _within(
        0.0, 3600.0, 1.0, "the sticky worker is overloaded above this predicted TTFT"
    )
    overload_ratio: float = _within(
        1.0, 100.0, 2.0, "... and above this multiple of the best candidate's predicted TTFT"
    )
    bonus: float = _within(0.0, 0.95, 0.0, "cost discount (0–0.95) for the prefix's last worker, any age")
    hot_bonus: bool = field(default=False, metadata={"help": "apply the bonus to hot prefixes too"})

    def __post_init__(self) -> None:
        _check_ranges(self)


@dataclass(frozen=True)
class ColdStartConfig:
    """A worker younger than `period_s` gets its cost multiplied by (1 - discount × remaining share)."""

    period_s: float = _within(0.0, 86_400.0, 60.0, "exploration period after joining; 0 = off")
    discount: float = _within(0.0, 0.95, 0.3, "cost discount at join time, fading to 0")

    def __post_init__(self) -> None:
        _check_ranges(self)


@dataclass(frozen=True)
class ReplicaConfig:
    """At most `cap` workers hold a prefix; more only if it is hot and all its holders are overloaded."""

    cap: int = field(default=3, metadata={"help": "holders of one prefix before new replicas need a reason"})
    hot_rate_per_s: float = _within(0.0, 1e6, 0.3, "a prefix is hot at this request rate")
    overload_ttft_s: float = _within(0.0, 3600.0, 1.0, "holders are overloaded above this predicted TTFT")
    overload_load_ratio: float = _within(
        1.0, 100.0, 1.25, "... or when the least-loaded holder has > this × a non-holder's in-flight + 1"
    )
    proactive: bool = field(
        default=True, metadata={"help": "a hot prefix below the cap replicates onto the least-cost worker"}
    )
    proactive_when: str = field(
        default="always",
        metadata={
            "help": "with proactive on, when a hot prefix may grow a replica: 'always', or "
            "'holders_loaded' (only while no holder serves the request with its hit sooner than its "
            "full prefill on an idle worker, lateness included), or 'priced' (only while what the copy "
            "saves the prefix's later requests exceeds its prefill and the KV it evicts: "
            "policy/replica_price.py)"
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.cap, bool) or not isinstance(self.cap, int) or self.cap < 1:
            raise ConfigError("cap", self.cap, "must be an integer >= 1")
        if self.proactive_when not in PROACTIVE_WHEN:
            raise ConfigError(
                "proactive_when", self.proactive_when, f"must be one of {', '.join(PROACTIVE_WHEN)}"
            )
        _check_ranges(self)


@dataclass(frozen=True)
class SessionConfig:
    """Explicit session affinity (policy/session.py): a client's session id as a soft preference."""

    weight: float = _within(
        0.0, 1.0, 1.0, "share (0–1) of the session worker's believed cache credited to its cost; 0 = off"
    )
    ttl_s: float = _within(1.0, 86_400.0, 600.0, "an idle session's binding expires after this many seconds")

    def __post_init__(self) -> None:
        _check_ranges(self)


@dataclass(frozen=True)
class ArticleConfig:
    """The article's score (seed §2.3): W_LOAD·load + W_CACHE·(1 − hit/len) + W_STABLE·stable, lowest wins."""

    w_load: float = _within(0.0, 100.0, 1.2)
    w_cache: float = _within(0.0, 100.0, 0.7)
    w_stable: float = _within(0.0, 100.0, 0.3)
    load_saturate_inflight: int = field(
        default=32, metadata={"help": "in-flight requests at which normalized load reaches 1"}
    )

    def __post_init__(self) -> None:
        _check_ranges(self)
        if self.load_saturate_inflight < 1:
            raise ConfigError("load_saturate_inflight", self.load_saturate_inflight, "must be >= 1")


@dataclass(frozen=True)
class RoutingConfig:
    """Everything routing needs; `policy` selects kvgate's default or the article's formula."""

    policy: str = "kvgate"
    min_cache_gain: float = _within(
        0.0, 1.0, 0.3, "cache hits below this share of the prompt are ignored (0–1)"
    )
    rate_half_life_s: float = _within(0.001, 86_400.0, 30.0, "EWMA half-life of prefix request rates")
    rate_young_window_s: float = _within(
        0.0,
        3600.0,
        0.0,
        "within this of a prefix's first request its rate is at least its later requests ÷ this",
    )
    rate_young_min_requests: int = _within(
        1,
        1_000_000,
        2,
        "the young window's reading needs at least this many requests after the prefix's first",
    )
    rate_young_bound: str = field(
        default="gate",
        metadata={
            "help": "what bounds the young window's reading: 'gate' (it counts only while every holder "
            "is loaded) or 'horizon' (a replica built on it is shared by the requests it has shown)"
        },
    )
    rate_young_replica_gain: str = field(
        default="any",
        metadata={
            "help": "with rate_young_bound = horizon, a replica priced on the young reading must serve "
            "its own request sooner than the best holder ('sooner'), is discounted by at most the "
            "holder's lead ('wait'), or is discounted as the horizon prices it ('any')"
        },
    )
    stats_max_entries: int = field(default=1_000_000, metadata={"help": "prefix stats kept (LRU)"})
    ttft: TtftModelConfig = field(default_factory=TtftModelConfig)
    sticky: StickyConfig = field(default_factory=StickyConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    replicas: ReplicaConfig = field(default_factory=ReplicaConfig)
    article: ArticleConfig = field(default_factory=ArticleConfig)
    session: SessionConfig = field(default_factory=SessionConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError("policy", self.policy, f"must be one of {', '.join(POLICIES)}")
        if self.rate_young_replica_gain not in YOUNG_REPLICA_GAINS:
            raise ConfigError(
                "rate_young_replica_gain",
                self.rate_young_replica_gain,
                f"must be one of {', '.join(YOUNG_REPLICA_GAINS)}",
            )
        if self.rate_young_bound not in YOUNG_BOUNDS:
            raise ConfigError(
                "rate_young_bound", self.rate_young_bound, f"must be one of {', '.join(YOUNG_BOUNDS)}"
            )
        _check_ranges(self)
        if self.stats_max_entries < 1:
            raise ConfigError("stats_max_entries", self.stats_max_entries, "must be >= 1")


def _build(cls: type[Any], raw: object, path: str) -> Any:
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(path, raw, "must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"{path}.{key}", value, f"unknown key (known: {', '.join(fields)})")
        factory = fields[key].default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            kwargs[key] = _build(factory, value, f"{path}.{key}")
            continue
        expected = type(fields[key].default)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise ConfigError(f"{path}.{key}", value, f"must be a {expected.__name__}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path}.{e.path}", e.value, e.reason) from None


def load_routing_config(raw: Mapping[str, object], path: str = "routing") -> RoutingConfig:
    """Validate a raw mapping (parsed TOML/YAML) into a `RoutingConfig`; unknown keys are errors."""
    config: RoutingConfig = _build(RoutingConfig, raw, path)
    return config
