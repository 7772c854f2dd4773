"""Contracts between the simulator's parts: requests, the cluster view a router sees, and routers.

The simulator replays `SimRequest`s through an `AdmissionGate` (optional) and a `Router` onto
engines (bench/sim/engine.py). Routers see the cluster only through `ClusterView`, which exposes
each load signal the way the real systems get it (shared/reference/PEERS.md, conventions):
  R  router-side in-flight accounting (`inflight`, `pending_prefill_tokens`), instantaneous;
  M  engine metrics as of the last scrape (`scraped`), stale by up to the scrape period;
  E  the engine's own prefix cache (`cached_prefix_blocks`), as KV events would report it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from policy.types import Band, WorkerView


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a trace or scenario.

    `block_ids[i]` identifies the whole prefix up to and including block i (Mooncake semantics:
    equal id at position i means identical tokens 0..i), and `block_tokens[i]` is that block's
    token count (trace block size, except a shorter last block).
    """

    id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    block_tokens: tuple[int, ...]
    band: Band = Band.NORMAL
    tenant: str = "default"
    slo_ttft_s: float | None = None  # for goodput; None = no SLO
    # churn: sent straight to a worker (a client that bypasses the router; the router never sees it)
    bypass: bool = False
    # churn: these workers restart (lose their prefix cache) just before this request arrives
    restart_before: tuple[str, ...] = ()
    # explicit session affinity (policy/session.py): the client's session id (a WEKA conversation),
    # and whether this request is the session's last (the client closes the session with it)
    session: str | None = None
    session_close: bool = False


@dataclass(frozen=True, slots=True)
class Scraped:
    """Engine metrics as a scrape saw them (vLLM names in comments)."""

    at_s: float  # when the scrape happened
    running: int  # vllm:num_requests_running
    waiting: int  # vllm:num_requests_waiting
    kv_usage: float  # vllm:kv_cache_usage_perc


class ClusterView(Protocol):
    """What a router may look at when it routes one request."""

    @property
    def worker_ids(self) -> Sequence[str]:
        """Workers in registry order (the order ties are broken in for registry-order peers)."""
        ...

    def inflight(self, worker_id: str) -> int:
        """R: requests dispatched to the worker and not finished."""
        ...

    def pending_prefill_tokens(self, worker_id: str) -> int:
        """R: prompt tokens dispatched to the worker whose first token has not come back."""
        ...

    def scraped(self, worker_id: str) -> Scraped:
        """M: the worker's metrics as of the last scrape."""
        ...

    def cached_prefix_blocks(self, worker_id: str, req: SimRequest) -> int:
        """E: leading blocks of `req` the worker's engine holds in its prefix cache now."""
        ...

    def capacity_tokens(self, worker_id: str) -> int:
        """KV cache capacity of the worker in tokens."""
        ...

    def max_concurrency(self, worker_id: str) -> int:
        """Requests the worker runs at once (engine max_num_seqs)."""
        ...

    def worker_views(self, now_s: float) -> list[WorkerView]:
        """All workers as `policy.types.WorkerView`s (R for inflight, M for running/waiting/kv_usage)."""
        ...

    def drain_kv_events(self, worker_id: str) -> list[tuple[str, list[object]]]:
        """E: the worker's KV events ("stored" | "removed" | "cleared", keys) since the last call; only
        for a router with a true `wants_kv_events` attribute (else always empty)."""
        ...


class RefusedAtDoor(Exception):
    """Raised by `Router.route` when the engine-queue guard refuses the request on its routing decision
    (the gateway's 429 `queue_too_deep`: nothing is dispatched or recorded); the runner marks it rejected."""


class Router(Protocol):
    """A routing policy in the simulator. May keep state (trees, counters); must be deterministic
    given its seed. Called in arrival order; `on_*` hooks report what happened to routed requests."""

    name: str

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        """Pick the worker id for `req` (or raise `RefusedAtDoor`)."""
        ...

    def on_first_token(self, req: SimRequest, worker_id: str, now_s: float) -> None: ...

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None: ...

    def on_usage(self, req: SimRequest, worker_id: str, cached_tokens: int, now_s: float) -> None:
        """The response's usage came back (at its end: a non-streamed body, or a stream's final chunk)
        with the prompt tokens the engine found cached (`usage.prompt_tokens_details.cached_tokens`)."""
        ...


class NoFeedback:
    """For routers that keep no per-request state: the `Router` feedback hooks do nothing."""

    def on_usage(self, req: SimRequest, worker_id: str, cached_tokens: int, now_s: float) -> None:
        pass

    def on_first_token(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        pass

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        pass
