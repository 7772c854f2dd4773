"""Simulator adapter for kvgate's policies (`kvgate`, `article`): the same `policy/` code the gateway runs.

Per request: `RoutingState.prepare` → `policy.decide` → `RoutingState.commit`, exactly as the gateway
does. Trace block ids already name whole prefixes (Mooncake semantics), so they are the prefix hashes
as they are; `block_tokens` come from the request. The prefix index is approximate (entries inserted at
routing time, blind to engine evictions), aged by a per-worker LRU of capacity_tokens(w) / block size.

Load signals, as a gateway that sees every request knows them (R, `policy.ledger.InflightLedger`):
in-flight counts, the *uncached* prefill tokens dispatched to each worker whose first token has not come
back (prompt − the hit this router expected), how many requests wait for their first token and how late
the most overdue of them runs against its predicted TTFT; engine running/waiting/KV usage come scraped
(M) from `cluster.worker_views`.

Index models (`index`, `kvgate bench sim --index exact,approx,oracle`, docs/SIMULATOR.md):
  approx  the above: routing history, a capacity LRU per worker, blind to evictions, restarts and
          traffic that bypasses the router;
  exact   the engines' KV events (stored / removed / cleared) applied `event_delay_s` after they
          happen, plus speculative entries for a routed request's blocks that expire after
          `speculative_ttl_s` unless an event confirmed them (the gateway's exact mode, docs/ROUTING.md);
  oracle  the engines' true caches at routing time (events applied at once, no speculation).
  feedback  approx corrected by hit feedback (policy/feedback.py): each response's usage reports the
          prompt tokens the engine found cached, delivered when the gateway sees it (with the
          response's end), and a report short of the index's expectation drops the worker's entries
          older than the first block it missed. What a gateway can do without KV events.

Sessions (`sessions=True`, the `kvgate_session` policy): the clients send their session ids (a WEKA
conversation is one session, closed by its last call), and the router keeps their bindings in a
`policy.session.SessionTable` with the TTL and early close the gateway keeps in Redis; the policy
sees them as `RequestView.session_worker` (policy/session.py). Without it, the same policy routes the
same requests as clients without a session header.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Callable, Mapping

from bench.sim.types import ClusterView, RefusedAtDoor, Router, SimRequest
from policy.config import RoutingConfig
from policy.index import PrefixIndex
from policy.kvgate import build_policy
from policy.ledger import InflightLedger
from policy.profile import RoutingPolicy
from policy.session import SessionTable, outcome, with_session
from policy.state import RoutingState
from policy.types import Band, WorkerView

_DEFAULT_INDEX_BLOCKS = 1 << 20  # until the first request tells the block size
_EVENT_INDEX_BLOCKS = 1 << 30  # exact / oracle: the events evict, not a capacity LRU
INDEX_MODELS = ("approx", "exact", "oracle", "feedback")


class PolicyRouter:
    """A `bench.sim.types.Router` driving a `policy.profile.RoutingPolicy` through a `RoutingState`."""

    def __init__(
        self,
        name: str,
        config: RoutingConfig,
        seed: int,
        index: str = "approx",
        event_delay_s: float = 0.05,
        speculative_ttl_s: float = 2.0,
        sessions: bool = False,
    ) -> None:
        if index not in INDEX_MODELS:
            raise ValueError(f"unknown index model {index!r}; known: {', '.join(INDEX_MODELS)}")
        self.name = name
        self.config = config
        self.index_model = index
        self.wants_kv_events = index in ("exact", "oracle")
        self.event_delay_s = event_delay_s if index == "exact" else 0.0
        self.speculative_ttl_s = speculative_ttl_s
        self.policy: RoutingPolicy = build_policy(config)
        blocks = _EVENT_INDEX_BLOCKS if self.wants_kv_events else _DEFAULT_INDEX_BLOCKS
        self.state = RoutingState(config, PrefixIndex(blocks), insert_on_commit=index != "oracle")
        self._events: deque[tuple[float, str, str, list[object]]] = deque()  # (at, worker, kind, keys)
        self._held: dict[str, set[object]] = {}  # worker -> keys its events say it holds
        self._speculative: deque[tuple[float, str, tuple[int, ...]]] = deque()  # (at, worker, keys)
        self._rng = random.Random(seed)
        self.ledger = InflightLedger()
        self._block_size = 0
        self.decisions = 0
        self.reasons: dict[str, int] = {}  # first words of Decision.reason -> count (for tuning reports)
        self.sessions = SessionTable(config.session.ttl_s) if sessions else None
        self.session_outcomes: dict[str, int] = {}  # policy.session.outcome -> routed requests
        # the engine-queue guard on the decision (band, the chosen worker's scores) -> refuse; set by the
        # `kvgate_guard` gate (bench/sim/admission.py GatedRouter), None = no guard
        self.door: Callable[[Band, Mapping[str, float]], bool] | None = None
        self.hit_feedback = index == "feedback"
        self._expected: dict[int, list[float]] = {}  # request id -> its hit expectation (policy/state.py)
        self.feedback_misses = 0  # reports that proved entries stale
        self.feedback_dropped = 0  # index entries they dropped

    def _size_index(self, req: SimRequest, cluster: ClusterView) -> None:
        block = max(req.block_tokens, default=0)
        if block <= self._block_size or self.wants_kv_events:
            return
        self._block_size = block
        for w in cluster.worker_ids:
            self.state.index.set_capacity(w, max(1, cluster.capacity_tokens(w) // block))

    def _follow_events(self, cluster: ClusterView, now_s: float) -> None:
        """exact / oracle: apply the engines' KV events that are `event_delay_s` old; expire
        unconfirmed speculative entries."""
        for w in cluster.worker_ids:
            for kind, keys in cluster.drain_kv_events(w):
                self._events.append((now_s, w, kind, keys))
        index = self.state.index
        while self._events and self._events[0][0] <= now_s - self.event_delay_s:
            _, w, kind, keys = self._events.popleft()
            held = self._held.setdefault(w, set())
            if kind == "stored":
                index.insert(w, keys, now_s)  # type: ignore[arg-type]
                held.update(keys)
            else:  # removed, cleared
                index.remove(w, keys)  # type: ignore[arg-type]
                held.difference_update(keys)
        while self._speculative and self._speculative[0][0] <= now_s - self.speculative_ttl_s:
            _, w, keys = self._speculative.popleft()
            held = self._held.get(w, set())
            index.remove(w, [k for k in keys if k not in held])

    def _views(self, cluster: ClusterView, now_s: float) -> list[WorkerView]:
        """Each worker as the gateway's views() builds it (plugin/routing.py), in one construction: the
        engine's scraped M signals, this router's R signals (its ledger), first-seen time as join time."""
        ledger, joined = self.ledger, self.state.joined
        views = []
        for w in cluster.worker_ids:
            scraped = cluster.scraped(w)
            views.append(
                WorkerView(
                    id=w,
                    running=scraped.running,
                    waiting=scraped.waiting,
                    kv_usage=scraped.kv_usage,
                    capacity_tokens=cluster.capacity_tokens(w),
                    max_concurrency=cluster.max_concurrency(w),
                    joined_s=joined.setdefault(w, now_s),
                    **ledger.signals(w, now_s),
                )
            )
        return views

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        self._size_index(req, cluster)
        if self.wants_kv_events:
            self._follow_events(cluster, now_s)
        views = self._views(cluster, now_s)
        view = self.state.prepare(
            request_id=str(req.id),
            prefix_hashes=req.block_ids,
            block_tokens=req.block_tokens,
            prompt_tokens=req.input_tokens,
            workers=views,
            now_s=now_s,
            max_tokens=req.output_tokens,
            band=req.band,
            tenant=req.tenant,
        )
        if self.sessions is not None and req.session is not None:
            view = with_session(view, self.sessions.lookup(req.session, now_s))
        decision = self.policy.decide(view, views, self._rng, now_s)
        self.decisions += 1
        key = decision.reason.split(" on ")[0].split(" (")[0]
        self.reasons[key] = self.reasons.get(key, 0) + 1
        worker = decision.worker
        if worker is None:  # every worker unhealthy or draining: the simulator has no reject path here
            worker = views[0].id
        if self.door is not None and self.door(req.band, decision.scores.get(worker, {})):
            raise RefusedAtDoor(req.id)  # before the commit: a refused request leaves nothing behind
        if self.hit_feedback:
            expected = self.state.hit_expectation(view, worker)
            if expected:
                self._expected[req.id] = expected
        self.state.commit(view, dataclasses.replace(decision, worker=worker), now_s)
        if self.index_model == "exact":  # the commit inserted them speculatively
            self._speculative.append((now_s, worker, req.block_ids))
        uncached = max(0, req.input_tokens - view.hit_tokens(worker))
        predicted = decision.scores.get(worker, {}).get("predicted-ttft", 0.0)
        self.ledger.dispatch(str(req.id), worker, uncached, predicted, now_s, req.input_tokens)
        if self.sessions is not None and req.session is not None:
            kind = outcome(view, dataclasses.replace(decision, worker=worker))
            self.session_outcomes[kind] = self.session_outcomes.get(kind, 0) + 1
            self.sessions.started(req.session, worker, req.input_tokens, now_s)
        return worker

    def on_first_token(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        self.ledger.first_token(str(req.id), now_s)

    def on_usage(self, req: SimRequest, worker_id: str, cached_tokens: int, now_s: float) -> None:
        expected = self._expected.pop(req.id, None)
        if expected is not None:
            stale = self.state.hit_feedback(worker_id, expected, cached_tokens, req.block_tokens)
            if stale is not None:
                self.feedback_misses += 1
                self.feedback_dropped += len(stale[1])

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        self.ledger.finish(str(req.id), now_s)
        if self.sessions is not None and req.session is not None:
            self.sessions.finished(req.session, now_s, close=req.session_close)


def make_kvgate_router(seed: int, config: RoutingConfig | None = None, index: str = "approx") -> Router:
    """kvgate's default policy (policy/kvgate.py) with default config unless given."""
    return PolicyRouter("kvgate", config or RoutingConfig(policy="kvgate"), seed, index=index)


def make_article_router(seed: int, config: RoutingConfig | None = None, index: str = "approx") -> Router:
    """The article's formula (policy/article.py), weights 1.2 / 0.7 / 0.3, 30 % minimum gain, stickiness."""
    return PolicyRouter("article", config or RoutingConfig(policy="article"), seed, index=index)


def make_kvgate_session_router(
    seed: int, config: RoutingConfig | None = None, index: str = "approx"
) -> Router:
    """kvgate's default policy with clients that send their session ids (policy/session.py)."""
    config = config or RoutingConfig(policy="kvgate")
    return PolicyRouter("kvgate_session", config, seed, index=index, sessions=True)
