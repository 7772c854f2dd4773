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


class ConfigError(ValueError):
    """A configuration value is invalid; `path` names where (e.g. `routing.sticky.window_s`)."""

    def __init__(self, path: str, value: object, reason: str) -> None:
        super().__init__(f"{path}: {value!r}: {reason}")
        self.path = path
        self.value = value
        self.reason = reason


def _check_range(path: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ConfigError(path, value, f"must be between {lo} and {hi}")


@dataclass(frozen=True)
class TtftModelConfig:
    """Predicted time to first token on a worker (scorers.PredictedTtft)."""

    # defaults: Llama-3.1-8B on one H100 (bench/sim/profiles/h100-llama3.1-8b.toml: 22.4 µs/token linear,
    # 1.06e-6 ms per new×context token of attention, ~7 ms per engine step)
    prefill_tokens_per_s: float = field(default=44_600.0, metadata={"help": "uncached prompt tokens/s"})
    attention_s_per_token_ctx: float = field(
        default=1.06e-9, metadata={"help": "attention time per (new token × context token), seconds"}
    )
    decode_slowdown: float = field(
        default=0.005, metadata={"help": "prefill slowdown per in-flight request (decodes share steps)"}
    )
    overhead_s: float = field(default=0.01, metadata={"help": "fixed per-request time (first step)"})
    miss_weight: float = field(
        default=1.0,
        metadata={"help": "extra weight of this request's uncached prefill (work others wait for)"},
    )
    busy_weight_max: float = field(
        default=4.0,
        metadata={"help": "cap of the extra miss weight when every worker is busy (a hit is capacity)"},
    )

    def __post_init__(self) -> None:
        _check_range("prefill_tokens_per_s", self.prefill_tokens_per_s, 1.0, 1e8)
        _check_range("attention_s_per_token_ctx", self.attention_s_per_token_ctx, 0.0, 1e-3)
        _check_range("decode_slowdown", self.decode_slowdown, 0.0, 1.0)
        _check_range("overhead_s", self.overhead_s, 0.0, 60.0)
        _check_range("miss_weight", self.miss_weight, 0.0, 100.0)
        _check_range("busy_weight_max", self.busy_weight_max, 0.0, 100.0)


@dataclass(frozen=True)
class StickyConfig:
    """A prefix stays on its worker for `window_s` after it landed there, unless that worker is overloaded."""

    window_s: float = field(default=30.0, metadata={"help": "hold time; 0 = off, article: 10–60"})
    overload_ttft_s: float = field(
        default=1.0, metadata={"help": "the sticky worker is overloaded above this predicted TTFT"}
    )
    overload_ratio: float = field(
        default=2.0, metadata={"help": "... and above this multiple of the best candidate's predicted TTFT"}
    )
    bonus: float = field(
        default=0.0, metadata={"help": "cost discount (0–0.95) for the prefix's last worker, any age"}
    )
    hot_bonus: bool = field(default=False, metadata={"help": "apply the bonus to hot prefixes too"})

    def __post_init__(self) -> None:
        _check_range("window_s", self.window_s, 0.0, 3600.0)
        _check_range("overload_ttft_s", self.overload_ttft_s, 0.0, 3600.0)
        _check_range("overload_ratio", self.overload_ratio, 1.0, 100.0)
        _check_range("bonus", self.bonus, 0.0, 0.95)


@dataclass(frozen=True)
class ColdStartConfig:
    """A worker younger than `period_s` gets its cost multiplied by (1 - discount × remaining share)."""

    period_s: float = field(default=60.0, metadata={"help": "exploration period after joining; 0 = off"})
    discount: float = field(default=0.3, metadata={"help": "cost discount at join time, fading to 0"})

    def __post_init__(self) -> None:
        _check_range("period_s", self.period_s, 0.0, 86_400.0)
        _check_range("discount", self.discount, 0.0, 0.95)


@dataclass(frozen=True)
class ReplicaConfig:
    """At most `cap` workers hold a prefix; more only if it is hot and all its holders are overloaded."""

    cap: int = field(default=3, metadata={"help": "holders of one prefix before new replicas need a reason"})
    hot_rate_per_s: float = field(default=0.3, metadata={"help": "a prefix is hot at this request rate"})
    overload_ttft_s: float = field(
        default=1.0,
        metadata={"help": "holders are overloaded above this predicted TTFT"},
    )
    overload_load_ratio: float = field(
        default=1.25,
        metadata={"help": "... or when the least-loaded holder has > this × a non-holder's in-flight + 1"},
    )
    proactive: bool = field(
        default=True, metadata={"help": "a hot prefix below the cap replicates onto the least-cost worker"}
    )

    def __post_init__(self) -> None:
        if isinstance(self.cap, bool) or not isinstance(self.cap, int) or self.cap < 1:
            raise ConfigError("cap", self.cap, "must be an integer >= 1")
        _check_range("hot_rate_per_s", self.hot_rate_per_s, 0.0, 1e6)
        _check_range("overload_ttft_s", self.overload_ttft_s, 0.0, 3600.0)
        _check_range("overload_load_ratio", self.overload_load_ratio, 1.0, 100.0)


@dataclass(frozen=True)
class SessionConfig:
    """Explicit session affinity (policy/session.py): a client's session id as a soft preference."""

    weight: float = field(
        default=1.0,
        metadata={"help": "share (0–1) of the session worker's believed cache credited to its cost; 0 = off"},
    )
    ttl_s: float = field(
        default=600.0, metadata={"help": "an idle session's binding expires after this many seconds"}
    )

    def __post_init__(self) -> None:
        _check_range("weight", self.weight, 0.0, 1.0)
        _check_range("ttl_s", self.ttl_s, 1.0, 86_400.0)


@dataclass(frozen=True)
class ArticleConfig:
    """The article's score (seed §2.3): W_LOAD·load + W_CACHE·(1 − hit/len) + W_STABLE·stable, lowest wins."""

    w_load: float = 1.2
    w_cache: float = 0.7
    w_stable: float = 0.3
    load_saturate_inflight: int = field(
        default=32, metadata={"help": "in-flight requests at which normalized load reaches 1"}
    )

    def __post_init__(self) -> None:
        for name in ("w_load", "w_cache", "w_stable"):
            _check_range(name, getattr(self, name), 0.0, 100.0)
        if self.load_saturate_inflight < 1:
            raise ConfigError("load_saturate_inflight", self.load_saturate_inflight, "must be >= 1")


@dataclass(frozen=True)
class RoutingConfig:
    """Everything routing needs; `policy` selects kvgate's default or the article's formula."""

    policy: str = "kvgate"
    min_cache_gain: float = field(
        default=0.3, metadata={"help": "cache hits below this share of the prompt are ignored (0–1)"}
    )
    rate_half_life_s: float = field(default=30.0, metadata={"help": "EWMA half-life of prefix request rates"})
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
        _check_range("min_cache_gain", self.min_cache_gain, 0.0, 1.0)
        _check_range("rate_half_life_s", self.rate_half_life_s, 0.001, 86_400.0)
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
