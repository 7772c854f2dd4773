"""`RoutingState`: the history a routing policy needs, as pure data, with the two calls around a decision.

    view = state.prepare(request fields..., workers=views, now_s=t)   # prefix hits, sticky worker, rate
    decision = policy.decide(view, views, rng, now_s=t)                # pure, no side effects
    state.commit(view, decision, now_s=t)                              # index insert, sticky, rate

The simulator adapter (bench/sim/policy_router.py) and the gateway call exactly these.

Held here:
  index      `PrefixIndex` of block hashes per worker. In approximate mode (`insert_on_commit=True`) the
             routed request's blocks are inserted for its worker at commit; in exact mode KV events fill it
             (and a routed request's blocks are speculative for an exact worker: policy/index.py).
  stats      per block hash (bounded LRU, `stats_max_entries`): the worker the prefix ending at that block
             was last routed to, since when it has been on that worker (`since_s`), when it was last seen,
             and its request rate as an EWMA (half-life `rate_half_life_s`; a steady stream of λ req/s
             reads λ).
  joined     when each worker was first seen (cold-start exploration when the view has no `joined_s`).
  load       `LoadMeter`: the engine seconds routed per second, cluster-wide (every commit: the request's
             uncached prefill and its decode of `max_tokens`, `TtftModel.work_s`), per worker of the pool:
             `cluster_load` of the views, the utilisation ρ (how busy the cluster will be, which the cost
             model's miss weight reads: policy/scorers.py `ServeCost.displaced`).

Sticky key: the deepest block of the request whose stats exist and whose prefix covers at least
`min_cache_gain` of the prompt (shorter shared prefixes, such as one short system prompt, carry no
stickiness). `prefix_rate` is that key's rate: a hot shared prefix reads high, one conversation low.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policy.config import RoutingConfig
from policy.feedback import SLACK_BLOCKS, stale_before
from policy.index import PrefixIndex
from policy.scorers import TtftModel
from policy.types import Band, Decision, RequestView, WorkerView


@dataclass(slots=True)
class PrefixStat:
    """What routing remembers about one prefix (identified by its last block's hash)."""

    worker: str
    since_s: float  # when the prefix moved to `worker` (stickiness window starts here)
    last_s: float  # last request with this prefix
    rate: float  # EWMA request rate (req/s) as of last_s
    first_s: float = 0.0  # first request with this prefix (the young-rate correction's clock)

    def rate_at(
        self, now_s: float, half_life_s: float, young_window_s: float = 0.0, young_min_requests: int = 1
    ) -> float:
        """The EWMA rate at `now_s`. Within `young_window_s` of the prefix's first request, at least its
        requests after the first ÷ the window: k requests in a young prefix's first seconds read
        ≥ (k − 1) ÷ window instead of the k × ln 2 ÷ half-life an EWMA from 0 reads (a shared prompt
        hit by a burst is hot before its EWMA knows it). Older prefixes read the plain EWMA, so the
        evidence window is short and its effect bounded. 0 = the plain EWMA always.

        The young reading needs `young_min_requests` requests after the first inside the window: it is
        for a prefix MANY requests share at once, and one conversation's next turn or two (an agent's
        tool loop sends a turn every 0.5–1 s, each extending the last within its final block, so they
        share every full block) would otherwise read 1 ÷ window, hot at a 2 s window (docs/BENCHMARKS.md,
        "the young rate for many requests only", session 8). Fewer: the plain EWMA."""
        decay: float = 0.5 ** (max(0.0, now_s - self.last_s) / half_life_s)
        ewma = self.rate * decay
        if young_window_s <= 0.0 or now_s - self.first_s >= young_window_s:
            return ewma
        step = math.log(2) / half_life_s
        first: float = 0.5 ** (max(0.0, now_s - self.first_s) / half_life_s)  # the first request's weight now
        # the requests after the first, each weighted at least `first` (all of them inside the window)
        later = (ewma - step * first) / step
        if later < young_min_requests * first * (1.0 - 1e-9):
            return ewma
        return max(ewma, later / young_window_s)


class LoadMeter:
    """Rate of a stream of amounts (uncached prompt tokens routed) as a bias-corrected EWMA, pure data.

        rate(t) = Σ amount_i × 2^(−(t − t_i)/h)  ÷  ∫_{t0}^{t} 2^(−(t − s)/h) ds

    t0 is the first event (it starts the clock and is not counted, so k events in (t0, t] read k ÷ (t − t0)
    while t − t0 ≪ h, and a steady stream reads its rate at any age, with no warm-up from 0; an EWMA
    seeded at 0 reads low for several half-lives, exactly when a cold cluster decides the most).
    Before the second event the rate is 0 (unknown).
    """

    __slots__ = ("_last_s", "_step", "_sum", "_t0", "half_life_s")

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._step = math.log(2) / half_life_s
        self._t0: float | None = None
        self._last_s = 0.0
        self._sum = 0.0

    def add(self, amount: float, now_s: float) -> None:
        if self._t0 is None:
            self._t0 = self._last_s = now_s
            return
        now_s = max(now_s, self._last_s)
        self._sum = self._sum * 0.5 ** ((now_s - self._last_s) / self.half_life_s) + max(0.0, amount)
        self._last_s = now_s

    def rate(self, now_s: float) -> float:
        if self._t0 is None:
            return 0.0
        now_s = max(now_s, self._last_s)
        # ∫ decay over the meter's age: (1 − 2^(−age/h)) ÷ (ln 2 / h)
        window = -math.expm1(-self._step * (now_s - self._t0)) / self._step
        if window <= 0.0:
            return 0.0
        decay: float = 0.5 ** ((now_s - self._last_s) / self.half_life_s)
        return self._sum * decay / window


class RoutingState:
    """Routing history: prefix index, per-prefix sticky worker and rate, worker join times."""

    def __init__(
        self,
        config: RoutingConfig,
        index: PrefixIndex,
        *,
        insert_on_commit: bool = True,
        min_index_tokens: int = 0,
    ) -> None:
        self.config = config
        self.index = index
        self.insert_on_commit = insert_on_commit
        # a prefix shorter than this is not worth an index entry (its prefill costs little: the article's
        # length threshold, §5.3)
        self.min_index_tokens = min_index_tokens
        self.stats: OrderedDict[int, PrefixStat] = OrderedDict()
        self.joined: dict[str, float] = {}
        self.load = LoadMeter(config.rate_half_life_s)
        t = config.ttft
        self._work = TtftModel(
            t.prefill_tokens_per_s,
            attention_s_per_token_ctx=t.attention_s_per_token_ctx,
            decode_s_per_token=t.decode_s_per_token,
            decode_s_per_token_ctx=t.decode_s_per_token_ctx,
        )
        self._rate_step = math.log(2) / config.rate_half_life_s

    # -- workers -------------------------------------------------------------------------------------
    def observe_workers(self, workers: Sequence[WorkerView], now_s: float) -> list[WorkerView]:
        """Record first-seen times; views without a `joined_s` get the first time this state saw them."""
        out: list[WorkerView] = []
        for w in workers:
            first = self.joined.setdefault(w.id, now_s)
            out.append(w if w.joined_s > 0 else dataclasses.replace(w, joined_s=first))
        return out

    def forget_worker(self, worker: str) -> None:
        """A worker left (lease expired, removed): drop its index entries and join time."""
        self.index.clear(worker)
        self.joined.pop(worker, None)

    def hit_expectation(self, view: RequestView, worker: str) -> list[float]:
        """Call before `commit`: the evidence hit feedback needs (policy/feedback.py), when the index last
        saw each block it expects `worker` to hold used there. Empty for an exact worker (its KV events
        correct it) and for an expected hit within the feedback's slack (a report cannot contradict it)."""
        blocks = view.prefix_hits.get(worker, 0)
        if blocks <= SLACK_BLOCKS or self.index.kind(worker) != "approximate":
            return []
        return self.index.touched_s(worker, view.prefix_hashes[:blocks])

    def hit_feedback(
        self,
        worker: str,
        expected_touched_s: Sequence[float],
        cached_tokens: int,
        block_tokens: Sequence[int],
    ) -> tuple[float, list[int]] | None:
        """The engine reported `cached_tokens` for a request routed to `worker` with `hit_expectation`
        `expected_touched_s`: forget the entries the report proves stale. None when it agrees with the
        index, else (the index time before which `worker`'s entries were stale, the hashes dropped)."""
        if not expected_touched_s:
            return None
        before = stale_before(cached_tokens, block_tokens, expected_touched_s)
        return None if before is None else (before, self.index.forget_before(worker, before))

    def worth_indexing(self, block_tokens: Sequence[int]) -> bool:
        """Whether a prefix of these blocks is long enough to index (`min_index_tokens`)."""
        return self.min_index_tokens <= 0 or sum(block_tokens) >= self.min_index_tokens

    # -- around a decision ---------------------------------------------------------------------------
    def prepare(
        self,
        *,
        request_id: str,
        prefix_hashes: Sequence[int],
        block_tokens: Sequence[int],
        prompt_tokens: int,
        workers: Sequence[WorkerView],
        now_s: float,
        model: str = "default",
        max_tokens: int = 0,
        band: Band = Band.NORMAL,
        tenant: str = "default",
        pool_workers: int | None = None,
    ) -> RequestView:
        """The request as policies see it: prefix hits per candidate, sticky worker, prefix rate, cluster
        load. `pool_workers`: the workers sharing the load when `workers` is only a candidate sample
        (default: `len(workers)`)."""
        if len(prefix_hashes) != len(block_tokens):
            raise ValueError("prefix_hashes and block_tokens must have the same length")
        ids = {w.id for w in workers}
        pool = len(workers) if pool_workers is None else pool_workers
        self.index.expire(now_s)  # speculative entries past their TTL match nothing
        hits: Mapping[str, int] = {w: n for w, n in self.index.match(prefix_hashes).items() if w in ids}
        sticky_worker: str | None = None
        sticky_since: float | None = None
        rate = 0.0
        steady_rate: float | None = None  # the plain EWMA, when the young window reads higher
        age = 0.0
        need = self.config.min_cache_gain * prompt_tokens
        covered = sum(block_tokens)
        for i in range(len(prefix_hashes) - 1, -1, -1):
            stat = self.stats.get(prefix_hashes[i])
            if stat is not None:
                covered_here = covered - sum(block_tokens[i + 1 :])
                c = self.config
                rate = stat.rate_at(
                    now_s, c.rate_half_life_s, c.rate_young_window_s, c.rate_young_min_requests
                )
                if c.rate_young_window_s > 0.0:
                    steady = stat.rate_at(now_s, c.rate_half_life_s)
                    steady_rate = steady if steady < rate else None
                age = max(0.0, now_s - stat.first_s)
                if covered_here >= need and covered_here > 0:
                    sticky_worker, sticky_since = stat.worker, stat.since_s
                break
        return RequestView(
            id=request_id,
            model=model,
            prefix_hashes=tuple(prefix_hashes),
            block_tokens=tuple(block_tokens),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            band=band,
            tenant=tenant,
            prefix_hits=hits,
            sticky_worker=sticky_worker,
            sticky_since_s=sticky_since,
            prefix_rate=rate,
            prefix_rate_steady=steady_rate,
            prefix_age_s=age,
            cache_fill=self._cache_fill(workers),
            cluster_load=self.cluster_load(pool, now_s),
            pool_workers=pool,
        )

    def _cache_fill(self, workers: Sequence[WorkerView]) -> Mapping[str, float]:
        """The index's belief of each worker's KV fill, for `proactive_when = "priced"` only (the copy's
        eviction cost); empty otherwise, so the default path does no per-worker work."""
        if self.config.replicas.proactive_when != "priced":
            return {}
        index = self.index
        return {w.id: index.size(w.id) / index.capacity(w.id) for w in workers}

    def cluster_load(self, pool_workers: int, now_s: float) -> float:
        """Engine seconds routed per second (`LoadMeter` of `TtftModel.work_s`) ÷ the pool's workers."""
        return self.load.rate(now_s) / max(1, pool_workers)

    def commit(self, view: RequestView, decision: Decision, now_s: float) -> None:
        """Record the routing: index insert (approximate mode), per-prefix worker, since and rate."""
        worker = decision.worker
        if worker is None:
            return
        hit = min(view.hit_tokens(worker), view.prompt_tokens)
        self.load.add(self._work.work_s(view.prompt_tokens - hit, hit, view.max_tokens), now_s)
        if self.insert_on_commit and self.worth_indexing(view.block_tokens):
            self.index.insert_routed(worker, view.prefix_hashes, now_s)
        stats, half_life, step = self.stats, self.config.rate_half_life_s, self._rate_step
        last_s, decay = None, 1.0  # the decay since last_s: a prefix's blocks were mostly touched together
        for h in view.prefix_hashes:
            stat = stats.get(h)
            if stat is None:
                stats[h] = PrefixStat(worker=worker, since_s=now_s, last_s=now_s, rate=step, first_s=now_s)
                continue
            # stat.rate_at(now_s, half_life) inlined (the same float operations: hot loop, one per block)
            if stat.last_s != last_s:
                last_s = stat.last_s
                decay = 0.5 ** (max(0.0, now_s - last_s) / half_life)
            stat.rate = stat.rate * decay + step
            stat.last_s = now_s
            if stat.worker != worker:
                stat.worker, stat.since_s = worker, now_s
            stats.move_to_end(h)
        while len(stats) > self.config.stats_max_entries:
            stats.popitem(last=False)
