"""The plain values that flow through routing and admission decisions.

A `WorkerView` is what a router knows about one worker at decision time (possibly stale); a
`RequestView` is one request reduced to what policies need, with the prefix match against every
worker computed once beforehand (llm-d's split: scorers read matches, they never search an index).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum


class Band(IntEnum):
    """Priority bands, most important last so that `max()` picks the most urgent."""

    LOW = 0  # offline / batch: shed first
    NORMAL = 1
    HIGH = 2  # online, latency-sensitive

    @classmethod
    def parse(cls, value: str | int) -> Band:
        """`high` / `normal` / `low`, or an integer (> 0 high, 0 normal, < 0 low; GIE: < 0 is sheddable)."""
        if isinstance(value, int):
            return cls.HIGH if value > 0 else cls.NORMAL if value == 0 else cls.LOW
        text = value.strip().lower()
        try:
            return cls[text.upper()]
        except KeyError:
            pass
        try:
            return cls.parse(ascii_int(text))
        except ValueError:
            raise ValueError(f"priority must be high, normal, low or an integer, not {value!r}") from None


def ascii_int(text: str, max_digits: int = 18) -> int:
    """An integer written in ASCII digits with an optional leading '-' (what a header should carry):
    unlike int(), no '+', no '_', no whitespace inside and no other scripts' digits ('١'); ValueError."""
    digits = text[1:] if text.startswith("-") else text
    if not digits or len(digits) > max_digits or not digits.isascii() or not digits.isdigit():
        raise ValueError(f"not an integer: {text!r}")
    return int(text)


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router sees it."""

    id: str
    inflight: int = 0  # requests this router (or all gateways, via Redis) dispatched and not yet finished
    running: int = 0  # engine-reported running requests (scraped, may be stale)
    waiting: int = 0  # engine-reported queued requests (scraped, may be stale)
    kv_usage: float = 0.0  # engine-reported KV cache usage, 0..1
    pending_prefill_tokens: int = (
        0  # router-side: prompt tokens dispatched whose first token has not come back
    )
    overdue_s: float = 0.0  # router-side: how late the most overdue of those is against its prediction
    # router-side: prompt tokens of the requests decoding there (first token back, not finished): the
    # KV every engine step reads for the running batch
    decoding_context_tokens: int = 0
    capacity_tokens: int = 0  # KV cache capacity in tokens (num_gpu_blocks * block_size); 0 = unknown
    max_concurrency: int = 0  # requests the worker takes at once before queueing locally; 0 = unknown
    joined_s: float = 0.0  # when the worker joined the pool (cold-start exploration)
    healthy: bool = True  # lease valid and health checks passing
    draining: bool = False  # no new requests


@dataclass(frozen=True, slots=True)
class RequestView:
    """One request as routing and admission policies see it."""

    id: str
    model: str = "default"
    prefix_hashes: tuple[int, ...] = ()  # chained block hashes of the prompt, block 0 first
    block_tokens: tuple[int, ...] = ()  # tokens in each hashed block (same length as prefix_hashes)
    prompt_tokens: int = 0
    max_tokens: int = 0
    band: Band = Band.NORMAL
    tenant: str = "default"
    # worker id -> number of leading blocks of prefix_hashes that worker is believed to hold
    prefix_hits: Mapping[str, int] = field(default_factory=dict)
    # stickiness: the worker this request's leading prefix was last routed to, and when
    sticky_worker: str | None = None
    sticky_since_s: float | None = None
    # measured request rate (req/s) of the leading prefix, for the hot-prefix replica cap
    prefix_rate: float = 0.0
    # the plain EWMA of that rate when `prefix_rate` is the young window's higher reading (policy/state.py
    # `PrefixStat.rate_at`); None = `prefix_rate` is the plain EWMA. The policy reads the young rate only
    # while the prefix's holders are loaded (policy/kvgate.py `KvgatePolicy.hot_evidence`)
    prefix_rate_steady: float | None = None
    # seconds since the prefix's first request (0 = unknown): the age that unbiases its EWMA rate
    # (policy/replica_price.py `unbiased_rate`, read by `replicas.proactive_when = "priced"`)
    prefix_age_s: float = 0.0
    # worker id -> share (0-1) of its KV the router's prefix index believes filled; set only for
    # `replicas.proactive_when = "priced"` (what a copy would evict there)
    cache_fill: Mapping[str, float] = field(default_factory=dict)
    # explicit session affinity (policy/session.py): the worker the client's session is bound to, and
    # the prompt tokens of the session's last request there (what that worker is believed to hold)
    session_worker: str | None = None
    session_tokens: int = 0
    # cluster load (policy/state.py `LoadMeter`): the utilisation ρ of the pool by the work routed lately
    # (engine seconds per second per worker: 0 = idle or unknown, > 1 = more than it can serve), and how
    # many workers share it (0 = unknown)
    cluster_load: float = 0.0
    pool_workers: int = 0

    def hit_tokens(self, worker_id: str) -> int:
        """Prompt tokens covered by the blocks `worker_id` holds."""
        return sum(self.block_tokens[: self.prefix_hits.get(worker_id, 0)])


class ReasonKind(StrEnum):
    """The bounded class of a decision's reason (metrics label `reason`, decision records' `reason_kind`)."""

    CACHE_HIT = "cache_hit"  # the winner holds part of the prefix
    LOAD = "load"  # nobody useful held the prefix, or its holders cost more: least loaded / cheapest
    STICKINESS = "stickiness"  # held on the prefix's recent worker (stickiness window)
    EXPLORATION = "exploration"  # a miss that went to a new worker on its cold-start discount
    REPLICA_CAP = "replica_cap"  # kept among the prefix's replicas (replica cap)
    SESSION = "session"  # the client's explicit session (policy/session.py)
    FALLBACK = "fallback"  # no policy reasoning: a baseline (round robin) or a policy that gives no kind


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing decision: the winner (None = rejected), why, and every candidate's scores for the log."""

    worker: str | None
    reason: str
    scores: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # worker -> part -> value
    kind: ReasonKind = ReasonKind.FALLBACK

    @classmethod
    def reject(cls, reason: str) -> Decision:
        return cls(worker=None, reason=reason)
