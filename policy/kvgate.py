"""kvgate's default routing policy: least predicted time to first token, with affinity guards.

    candidates  Eligible (healthy, not draining) → HardOverload (engine slots / KV full)
                → ReplicaCap (a prefix held by ≥ cap workers stays on them unless hot and overloaded)
                → StickyHold (within the window a prefix stays on its worker unless overloaded)
    cost(w)     = (ttft(w) + (miss_weight + busy) × own_prefill(w)) × (1 − cold_start(w))
                  busy = queued wait on the least-loaded candidate in full prefills of the request,
                  counting the lateness its queue already shows, capped (scorers.ServeCost.busy_weight):
                  when every worker is busy, a hit is capacity (and a hot prefix's new replica is an
                  investment only to 1/(1+busy): the rest of its prefill is miss work)
                  (`ttft.miss_load = "queueing"`, not the default: miss_weight × Erlang C of the cluster
                  load the routing state measures, scorers.ServeCost.displaced)
                  ttft = TtftModel.ttft_s(w, prompt − effective_hit(w)); own_prefill = its uncached part
                  − session credit (policy/session.py: the session worker of an explicit session id, only
                  while the hold limit below allows; a separate term)
    winner      = argmin cost, seeded tie-break

effective_hit(w) is the worker's cached prompt prefix, ignored below `min_cache_gain` of the prompt (30 %).
`miss_weight` charges the uncached prefill a second time: it is work the worker's later requests wait
for, which a greedy per-request TTFT does not see (keeps hit rates high under load).
No affinity guard (stickiness window, replica cap) holds a request on a worker whose predicted TTFT
exceeds the cost of serving it elsewhere, recompute included (`scorers.holding_costs_more`); the guards'
prediction counts the prefill queued on the worker and how late its queue already runs (`overdue_s`,
policy/ledger.py), so a holder that stalls for reasons the model cannot see is let go.
The TTFT model (policy/scorers.py) charges the uncached prefill already queued on the worker plus this
request's own uncached prefill, slowed by running decodes: it weighs cache against load in one unit
(seconds), the way Dynamo's cost weighs prefill blocks against decode blocks, instead of mixing unitless
scores. The guards add what a greedy cost model lacks: stability (stickiness, the minimum gain), KV economy
(replica cap) and exploration of new workers (cold-start discount). Parameters: policy/config.py and
docs/ROUTING.md.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from policy.article import article_policy
from policy.config import RoutingConfig
from policy.filters import Eligible, Filter, HardOverload, ReplicaCap, StickyHold
from policy.pickers import MinCost
from policy.profile import RoutingPolicy, run_filters
from policy.replica_price import copy_benefit_s, evicted_tokens, unbiased_rate
from policy.scorers import ColdStart, PredictedTtft, ServeCost, TtftModel, effective_hit_tokens
from policy.session import CREDIT, DECIDED, SessionPreference
from policy.types import Decision, ReasonKind, RequestView, WorkerView


@dataclass(frozen=True)
class KvgatePolicy:
    """Least predicted TTFT among the candidates that survive the affinity guards."""

    config: RoutingConfig = field(default_factory=RoutingConfig)
    name: str = "kvgate"

    # The parts below depend on the (frozen) config only: built once per policy, not per decision.
    @cached_property
    def ttft(self) -> PredictedTtft:
        t = self.config.ttft
        model = TtftModel(
            t.prefill_tokens_per_s,
            t.decode_slowdown,
            t.overhead_s,
            t.attention_s_per_token_ctx,
            t.decode_s_per_token,
            t.decode_s_per_token_ctx,
            batch_read=t.decode_batch_read,
        )
        return PredictedTtft(model=model, min_gain=self.config.min_cache_gain)

    @cached_property
    def cost(self) -> ServeCost:
        return self._serve_cost(self.ttft)

    def _serve_cost(self, ttft: PredictedTtft) -> ServeCost:
        t = self.config.ttft
        return ServeCost(
            ttft,
            miss_weight=t.miss_weight,
            busy_weight_max=t.busy_weight_max,
            miss_load=t.miss_load,
            replica_busy=t.replica_busy,
        )

    @cached_property
    def guard_ttft(self) -> PredictedTtft:
        """The affinity guards' prediction: the model's, raised to the lateness the queue already shows."""
        return dataclasses.replace(self.ttft, late=True)

    def filters(self) -> Sequence[Filter]:
        return self._filters

    @cached_property
    def _filters(self) -> tuple[Filter, ...]:
        c, ttft = self.config, self.guard_ttft
        cost = self._serve_cost(ttft)
        return (
            Eligible(),
            HardOverload(),
            ReplicaCap(ttft=ttft, config=c.replicas, cost=cost),
            StickyHold(ttft=ttft, config=c.sticky, skip_rate_per_s=c.replicas.hot_rate_per_s, cost=cost),
        )

    def decide(
        self, req: RequestView, workers: Sequence[WorkerView], rng: random.Random, now_s: float
    ) -> Decision:
        c = self.config
        if c.rate_young_bound == "gate":
            req = self.hot_evidence(req, workers)
        candidates, narrowed, emptied = run_filters(self.filters(), req, workers, now_s)
        if emptied is not None:
            return Decision.reject(f"no worker left after {emptied}")
        cold = self._cold_start.score(req, candidates, now_s)
        prompt = max(req.prompt_tokens, 1)
        hits = {w.id: effective_hit_tokens(req, w.id, c.min_cache_gain) for w in candidates}
        replicate = self._replicate_hot(req, hits, candidates)
        # a hot prefix that may grow a replica: the replica's prefill is an investment, not miss work
        # (it still counts in this request's TTFT: that is where it lands), as far as idle capacity pays
        # for it: when every worker is busy, busy/(1+busy) of it is miss work (ServeCost.parts)
        kept = dict.fromkeys(hits, max(hits.values())) if replicate else hits
        scores: dict[str, dict[str, float]] = {}
        costs: dict[str, float] = {}
        hot = req.prefix_rate >= c.replicas.hot_rate_per_s
        bonus = c.sticky.bonus if (c.sticky.hot_bonus or not hot) else 0.0
        busy = self.cost.busy_weight(req, candidates)
        young = replicate and self._young_bounded(req)
        priced = replicate and c.replicas.proactive_when == "priced"
        # the best holder's TTFT, which both the young window's gain and the priced copy are measured against
        holder_ttft = self._holder_ttft(req, candidates, hits) if young or priced else None
        lead = holder_ttft if young else None
        best_holder = holder_ttft if priced else None
        for w in candidates:
            hit = hits[w.id]
            ttft_s, miss_s, cost_s = self.cost.parts(req, w, hit, kept[w.id], busy)
            if kept[w.id] > hit:  # a new replica: its one-time prefill, shared by the requests it will serve
                # (when every worker is busy, that prefill is capacity lost to all: the share shrinks)
                free_ttft = self.cost.parts(req, w, kept[w.id])[0]
                invest = ttft_s - free_ttft
                gain = None if lead is None else self._young_gain(lead, ttft_s, free_ttft)
                unpaid = best_holder is not None and not self._copy_pays(
                    req, w, hits, kept[w.id], invest, best_holder - free_ttft
                )
                if unpaid or (gain is not None and gain <= 0.0):  # nothing sooner: a plain recompute
                    ttft_s, miss_s, cost_s = self.cost.parts(req, w, hit, None, busy)
                else:
                    share = 1.0 - 1.0 / (1.0 + self._replica_share(req, hits))
                    discount = invest if gain is None else min(invest, gain)
                    cost_s -= discount * share / (1.0 + busy)
            costs[w.id] = cost_s * (1.0 - cold[w.id])
            if w.id == req.sticky_worker:
                costs[w.id] *= 1.0 - bonus
            scores[w.id] = {
                "prefix-match": hit / prompt,
                "predicted-ttft": ttft_s,
                "miss-work": miss_s,
                "cold-start": cold[w.id],
                "cost": costs[w.id],
            }
        if req.session_worker is not None:  # explicit session affinity: one separate term (policy/session.py)
            self._session.adjust(req, candidates, hits, costs, scores)
        winner = MinCost().pick(costs, rng)
        # the wait before its own prefill, at least the lateness its queue shows: read by the door's guard
        # (plugin/placement.py) for the chosen worker only, so computed for it alone
        chosen = next(w for w in candidates if w.id == winner)
        scores[winner]["queue-wait"] = self.ttft.model.wait_s(chosen, late=True)
        # the same wait from this gateway's own dispatches alone (prefill sent, no first token yet), no
        # lateness: the door's guard with `queue_signal = "dispatched"` reads it. Lateness is a tail
        # statistic that a loaded machine raises for every worker at once, and refusals raise it further
        scores[winner]["dispatched-wait"] = self.ttft.model.wait_s(chosen, late=False)
        if replicate:
            narrowed = [*narrowed, "replicate"]
        if scores[winner].get(DECIDED):
            narrowed = [*narrowed, "session"]
        reason = _reason(req, winner, scores[winner], narrowed)
        return Decision(winner, reason, scores, kind=_kind(scores[winner], narrowed))

    def hot_evidence(self, req: RequestView, workers: Sequence[WorkerView]) -> RequestView:
        """The request with the prefix rate the hot rules may read. The young window's reading (a burst
        of a new prefix, policy/state.py `PrefixStat.rate_at`) counts only while every holder of the
        prefix is loaded: its predicted TTFT with its hit (the guards' prediction, lateness included)
        is no sooner than the request's own full prefill on an idle worker, so the hit buys nothing
        there right now. While some holder still serves the request sooner, a few requests of a new
        prefix are no reason to skip the sticky hold or to price a replica as shared by the window's
        extrapolation of them: the prefix reads the plain EWMA (docs/BENCHMARKS.md, "the young window
        without its flap cost", session 9). A prefix no live worker holds keeps the young reading."""
        steady = req.prefix_rate_steady
        if steady is None or steady >= req.prefix_rate:
            return req
        if self._a_holder_serves_sooner(req, workers):
            return dataclasses.replace(req, prefix_rate=steady, prefix_rate_steady=None)
        return req

    def _a_holder_serves_sooner(self, req: RequestView, workers: Sequence[WorkerView]) -> bool:
        """Some live holder of the prefix serves the request with its hit (the guards' prediction,
        lateness included) sooner than the request's own full prefill on an idle worker: its hit still
        buys time there, so not every holder is loaded (`hot_evidence`, `replicas.proactive_when`)."""
        model, min_gain = self.guard_ttft.model, self.config.min_cache_gain
        idle = model.overhead_s + model.own_prefill_s(req.prompt_tokens, 0)
        for w in workers:
            hit = effective_hit_tokens(req, w.id, min_gain) if w.healthy and not w.draining else 0
            if hit > 0 and model.ttft_s(w, req.prompt_tokens - hit, hit, late=True) < idle:
                return True
        return False

    def _copy_pays(
        self, req: RequestView, w: WorkerView, hits: dict[str, int], kept: int, invest: float, lead: float
    ) -> bool:
        """`proactive_when = "priced"`: a copy of the prefix on `w` saves the prefix's later requests more
        than it costs, its prefill `invest` and the KV it evicts there (policy/replica_price.py)."""
        c, model = self.config, self.ttft.model
        ewma = req.prefix_rate if req.prefix_rate_steady is None else req.prefix_rate_steady
        rate = max(req.prefix_rate, unbiased_rate(ewma, req.prefix_age_s, c.rate_half_life_s))
        tail = req.prompt_tokens - kept
        work, prefill = model.work_s(tail, kept, req.max_tokens), model.own_prefill_s(tail, kept)
        holders = sum(1 for h in hits.values() if h > 0)
        benefit = copy_benefit_s(rate, work, prefill, holders, c.sticky.window_s, lead)
        new = kept - hits[w.id]  # the prefix the copy adds to w's cache (a holder adds only the tail)
        evicted = evicted_tokens(new, req.cache_fill.get(w.id, 0.0), w.capacity_tokens)
        return benefit > invest + model.own_prefill_s(evicted, 0)

    def _holder_ttft(
        self, req: RequestView, candidates: Sequence[WorkerView], hits: dict[str, int]
    ) -> float | None:
        """The best holder's predicted TTFT with its hit (the cost model's), None without a holder."""
        ttfts = [self.cost.parts(req, w, hits[w.id])[0] for w in candidates if hits[w.id] > 0]
        return min(ttfts) if ttfts else None

    def _young_gain(self, lead: float, ttft_s: float, free_ttft: float) -> float | None:
        """What a replica priced on the young reading (`rate_young_bound = "horizon"`) offers, in seconds,
        against `lead`, the best holder's TTFT (`decide` computes it only when `_young_bounded`).

            sooner  the best holder's TTFT minus the replica's for this request (its full prefill
                    included): ≤ 0 when a holder still serves it sooner, and then the copy is a plain
                    recompute (its prefill is miss work, nothing is discounted)
            wait    the best holder's TTFT minus the replica's once it holds the prefix: a later
                    request of the prefix gains at most that lead over the holder, so the discount per
                    shared request is capped by it (no lead: a plain recompute, as with sooner)

        A young reading is a few requests of a new prefix; a copy made while its holder still
        serves them sooner is a lost hit for no later gain (docs/BENCHMARKS.md, the share horizon,
        session 10: 8 of rag 1.2/16's 9 lost hits were such copies)."""
        c = self.config
        if c.rate_young_replica_gain == "sooner":
            return lead - ttft_s
        if c.rate_young_replica_gain == "wait":
            return max(0.0, lead - free_ttft) or -1.0
        return None

    def _young_bounded(self, req: RequestView) -> bool:
        """The request reads the young window and `rate_young_replica_gain` bounds its copies."""
        c = self.config
        return (
            c.rate_young_bound == "horizon"
            and req.prefix_rate_steady is not None
            and c.rate_young_replica_gain != "any"
        )

    @cached_property
    def _session(self) -> SessionPreference:
        guard = self._serve_cost(self.guard_ttft)
        return SessionPreference(self.cost, guard, weight=self.config.session.weight)

    @cached_property
    def _cold_start(self) -> ColdStart:
        return ColdStart(self.config.cold_start.period_s, self.config.cold_start.discount)

    def _replica_share(self, req: RequestView, hits: dict[str, int]) -> float:
        """Requests of the prefix a new replica can expect within the stickiness window (rate ÷ replicas).

        `rate_young_bound = "horizon"`: a young window's reading (`prefix_rate_steady` set) is evidence
        for as long as the window it was read over, not for the whole stickiness window: the replica is
        priced as shared by the requests that reading has shown (rate × the young window), with the
        plain EWMA's extrapolation over the stickiness window as a floor (docs/BENCHMARKS.md, "the share
        horizon", session 10)."""
        holders = sum(1 for h in hits.values() if h > 0)
        c = self.config
        horizon = c.sticky.window_s
        steady = req.prefix_rate_steady
        if c.rate_young_bound == "horizon" and steady is not None:
            young = req.prefix_rate * min(horizon, c.rate_young_window_s)
            return max(steady * horizon, young) / (holders + 1)
        return req.prefix_rate * horizon / (holders + 1)

    def _replicate_hot(
        self, req: RequestView, hits: dict[str, int], candidates: Sequence[WorkerView]
    ) -> bool:
        """Hot prefix with non-holders among the candidates: below the cap, or ReplicaCap found the
        holders overloaded (otherwise it would have left only holders). `proactive_when =
        "holders_loaded"`: only while no holder among the candidates serves the request sooner than its
        full prefill on an idle worker; a copy made while a holder is still free costs hits for no
        gain yet (docs/BENCHMARKS.md, tenants at 0.8, session 10)."""
        r = self.config.replicas
        holders = sum(1 for h in hits.values() if h > 0)
        if not (r.proactive and req.prefix_rate >= r.hot_rate_per_s and 0 < holders < len(hits)):
            return False
        return r.proactive_when != "holders_loaded" or not self._a_holder_serves_sooner(req, candidates)


def _reason(req: RequestView, winner: str, parts: dict[str, float], narrowed: list[str]) -> str:
    ttft = f"predicted TTFT {parts['predicted-ttft']:.3f} s"
    if "session" in narrowed:
        return f"session on {winner} (its cache believed {parts[CREDIT]:.3f} s cheaper), {ttft}"
    if "sticky-hold" in narrowed:
        return f"sticky on {winner} (prefix {parts['prefix-match']:.2f}), {ttft}"
    held = " among replicas (cap)" if "replica-cap" in narrowed else ""
    if "replicate" in narrowed:
        held = ", hot prefix: may add a replica"
    if parts["prefix-match"] > 0:
        return f"prefix {parts['prefix-match']:.2f} on {winner}{held}, least {ttft}"
    cold = ", cold-start discount" if parts["cold-start"] > 0 else ""
    return f"miss → least {ttft} on {winner}{held}{cold}"


def _kind(parts: dict[str, float], narrowed: list[str]) -> ReasonKind:
    """The bounded class of `_reason`'s text (the same order of precedence)."""
    if "session" in narrowed:
        return ReasonKind.SESSION
    if "sticky-hold" in narrowed:
        return ReasonKind.STICKINESS
    if "replica-cap" in narrowed and "replicate" not in narrowed:
        return ReasonKind.REPLICA_CAP
    if parts["prefix-match"] > 0:
        return ReasonKind.CACHE_HIT
    return ReasonKind.EXPLORATION if parts["cold-start"] > 0 else ReasonKind.LOAD


def build_policy(config: RoutingConfig) -> RoutingPolicy:
    """The policy `config.policy` names: `kvgate` (default) or `article`."""
    if config.policy == "article":
        return article_policy(config)
    return KvgatePolicy(config)
