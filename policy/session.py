"""Explicit session affinity: the worker a client's session ran on, as a soft preference in the cost model.

A client may name its conversation (`x-kvgate-session-id`, as Dynamo's `X-Dynamo-Session-ID` and SMG's
`x-smg-routing-key`). The gateway (plugin/sessions.py, shared through Redis) or the simulator
(`SessionTable`) binds the session to the worker its last request went to, with the prompt tokens of
that request: what the worker is believed to hold. The next request of the session sees the binding
in its view (`RequestView.session_worker`, `session_tokens`), and kvgate's cost model credits the
session's worker with that belief, in the cost model's own unit (seconds of prefill):

    session_hit = the request's leading blocks covering min(prompt, session_tokens)   (≥ min_cache_gain)
    credit      = weight × (cost(w, index hit) − cost(w, session_hit))        only w = session worker

It is a preference, never a pin:
  - no credit when the worker is not a candidate (gone, draining, unhealthy, or narrowed away by a
    guard with better evidence: the prefix's sticky worker, its replicas), or overloaded (HardOverload);
  - no credit where the hold limit says move (`scorers.holding_costs_more`, the rule of the stickiness
    window and the replica cap): the session worker's predicted TTFT with the session's cache, its
    queued prefill and measured lateness (policy/ledger.py) included, exceeds the cost of serving the
    request on another candidate, recompute included;
  - no credit when the index already believes the worker holds as much (nothing to add).
A route that the credit changed is "decided" by the session (`outcome`); the gateway counts outcomes
in `kvgate_session_routes_total` and names them in the decision record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

from policy.filters import HardOverload
from policy.scorers import ServeCost, effective_hit_tokens, holding_costs_more
from policy.types import Decision, RequestView, WorkerView

OUTCOMES = ("new", "followed", "decided", "moved")
DECIDED = "session-decided"  # score part of the winner whose route the session's credit decided
CREDIT = "session-credit"  # score part: seconds taken off the session worker's cost


@dataclass(frozen=True, slots=True)
class SessionBinding:
    """Where a session's last request went, and how many prompt tokens it had."""

    worker: str
    tokens: int


def with_session(view: RequestView, binding: SessionBinding | None) -> RequestView:
    """The view with the session's binding (unchanged without one)."""
    if binding is None:
        return view
    return dataclasses.replace(view, session_worker=binding.worker, session_tokens=max(0, binding.tokens))


def session_view(req: RequestView) -> RequestView:
    """`req` as if the session worker held the leading blocks that cover the session's last prompt."""
    target = req.session_worker
    if target is None:
        return req
    budget, blocks = min(req.prompt_tokens, req.session_tokens), 0
    for tokens in req.block_tokens:
        if budget < tokens:
            break
        budget -= tokens
        blocks += 1
    if blocks <= req.prefix_hits.get(target, 0):
        return req
    return dataclasses.replace(req, prefix_hits={**req.prefix_hits, target: blocks})


@dataclass(frozen=True)
class SessionPreference:
    """The session worker's credit in kvgate's cost (see the module docstring); `weight` 0–1, 0 = off."""

    cost: ServeCost  # the cost model's
    guard: ServeCost  # the hold limit's (predicted TTFT with lateness: KvgatePolicy.guard_ttft)
    weight: float = 1.0
    overload: HardOverload = field(default_factory=HardOverload)

    def credit_s(self, req: RequestView, candidates: Sequence[WorkerView], hits: Mapping[str, int]) -> float:
        """Seconds off the session worker's cost (0: no preference for this request)."""
        target = req.session_worker
        mine = next((w for w in candidates if w.id == target), None)
        if mine is None or self.weight <= 0 or self.overload.overloaded(mine):
            return 0.0
        believed = session_view(req)
        hit = effective_hit_tokens(believed, mine.id, self.cost.ttft.min_gain)
        if hit <= hits.get(mine.id, 0):
            return 0.0
        others = [w for w in candidates if w.id != mine.id]
        if holding_costs_more(self.guard, believed, [mine], others):
            return 0.0
        now_cost = self.cost.parts(req, mine, hits.get(mine.id, 0))[2]
        return self.weight * max(0.0, now_cost - self.cost.parts(req, mine, hit)[2])

    def adjust(
        self,
        req: RequestView,
        candidates: Sequence[WorkerView],
        hits: Mapping[str, int],
        costs: MutableMapping[str, float],
        scores: MutableMapping[str, dict[str, float]],
    ) -> None:
        """Take the credit off the session worker's cost (in `costs` and its `scores`), and mark it
        `DECIDED` when the credit turned a worse cost into the least one."""
        target = req.session_worker
        credit = self.credit_s(req, candidates, hits) if target is not None else 0.0
        if target is None or credit <= 0:
            return
        before = costs[target]
        others = min((c for w, c in costs.items() if w != target), default=float("inf"))
        costs[target] = max(0.0, before - credit)
        scores[target][CREDIT] = credit
        scores[target]["cost"] = costs[target]
        if before > others >= costs[target]:
            scores[target][DECIDED] = 1.0


def outcome(view: RequestView, decision: Decision) -> str:
    """What the session did for a routed request: `new` (no binding), `decided` (its credit chose the
    worker), `followed` (the bound worker won on its own), `moved` (routed elsewhere)."""
    if view.session_worker is None:
        return "new"
    if decision.worker != view.session_worker:
        return "moved"
    return "decided" if decision.scores.get(decision.worker, {}).get(DECIDED) else "followed"


@dataclass
class _Entry:
    binding: SessionBinding
    last_s: float
    active: int = 0


class SessionTable:
    """Session bindings in memory, for one router (the simulator; the gateway keeps them in Redis,
    store/sessions.py, with the same rules): a binding lives `ttl_s` after its session's last
    activity, never expires while one of its requests is in flight (the gateway renews it), and
    goes at once when the client closes the session on its last request."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, _Entry] = {}

    def lookup(self, session: str, now_s: float) -> SessionBinding | None:
        entry = self._entries.get(session)
        if entry is None:
            return None
        if entry.active <= 0 and now_s - entry.last_s > self.ttl_s:
            del self._entries[session]
            return None
        return entry.binding

    def started(self, session: str, worker: str, tokens: int, now_s: float) -> None:
        """A request of the session was routed to `worker` with `tokens` prompt tokens: (re)bind."""
        entry = self._entries.get(session)
        active = entry.active if entry is not None and self.lookup(session, now_s) is not None else 0
        self._entries[session] = _Entry(SessionBinding(worker, tokens), now_s, active + 1)

    def finished(self, session: str, now_s: float, *, close: bool = False) -> None:
        """A request of the session ended; `close`: the client ended the session with it."""
        entry = self._entries.get(session)
        if entry is None:
            return
        if close:
            del self._entries[session]
            return
        entry.active = max(0, entry.active - 1)
        entry.last_s = now_s

    def __len__(self) -> int:
        return len(self._entries)
