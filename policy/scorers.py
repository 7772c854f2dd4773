"""Scorers: one signal each, a score in [0, 1] per candidate worker, higher is better (llm-d's contract).

A profile (policy/profile.py) weighs them; kvgate's cost model (policy/kvgate.py) reads `TtftModel`
directly. Every scorer is a frozen dataclass with a stable kebab-case `name` used by config and the
decision log. Scores outside [0, 1] are clamped by the profile, but none of these produce any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from policy.types import RequestView, WorkerView


class Scorer(Protocol):
    @property
    def name(self) -> str: ...

    def score(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> dict[str, float]: ...


def clamp01(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def saturating(count: int, saturate_at: int) -> float:
    """1 for 0, falling linearly to 0 at `saturate_at` (≥ 1) and beyond (Load, QueueDepth)."""
    return 1.0 - min(max(count, 0), saturate_at) / saturate_at


def effective_hit_tokens(req: RequestView, worker_id: str, min_gain: float) -> int:
    """Cached prompt tokens on the worker, or 0 when they cover less than `min_gain` of the prompt
    (the article's minimum cache gain: small matches are ignored so that they cannot cause churn)."""
    hit = req.hit_tokens(worker_id)
    if hit <= 0 or hit < min_gain * req.prompt_tokens:
        return 0
    return min(hit, req.prompt_tokens) if req.prompt_tokens > 0 else hit


@dataclass(frozen=True)
class TtftModel:
    """Predicted time to first token of a request on worker `w`, in seconds:

        own  = u / prefill_tokens_per_s + attention_s_per_token_ctx × u × (hit + u / 2)
        wait = overhead_s + w.pending_prefill_tokens / prefill_tokens_per_s × slow
               late=True: overhead_s + max(that queued prefill, w.overdue_s)
        ttft = wait + own × slow + read,      slow = 1 + decode_slowdown × w.inflight
        read = 1.5 × decode_s_per_token_ctx × w.decoding_context_tokens       (batch_read; else 0)

    u = prompt − hit is the request's uncached prefill, `pending_prefill_tokens` the uncached prefill
    already queued on the worker (router-side, R); attention makes long prompts super-linear; `slow` is
    the share of each engine step taken by running decodes (chunked prefill shares steps). `read` is
    the time the engine steps before the first token spend reading the running decodes' KV (R: the
    prompt tokens of the requests decoding there, `decoding_context_tokens`): each step reads all of
    it, whatever its prefill, so it adds the same seconds to a short prefill as to a long one, which
    `slow` (a share of the prefill) cannot say: a hit on a worker with 30 decodes of 7k-token contexts
    waits ~19 ms more than on an idle one, more than its own prefill (the step in progress, half of
    one on average, and the step that runs the prefill; a longer prefill's further steps are a small
    share of its own time and are not counted). The engine profiles' `f_ms_per_ctx_token`.
    `overdue_s` (R, policy/ledger.py) is how late the worker's most overdue queued request already is
    against its own prediction: a new request queues behind it, so the queue is at least that long,
    whatever the model says (a KV cache full of long contexts stalls admission without any prefill
    queued; an evicted cache makes queued prefills longer than expected). The affinity guards count
    it (`late=True`: it is what tells them a holder stalls); the cost model does not, because under
    overload every worker runs late by turns and chasing the momentarily punctual one trades hits for
    nothing (measured: docs/BENCHMARKS.md, robust policy section).
    Ranges: prefill_tokens_per_s > 0 (≈ 15k–50k for an 8B model on one GPU), attention ≥ 0 (≈ 1e-9 for
    8B on H100), decode_slowdown 0–1 (≈ 0.002–0.02), overhead_s ≥ 0 (≈ one engine step).
    """

    prefill_tokens_per_s: float = 44_600.0
    decode_slowdown: float = 0.005
    overhead_s: float = 0.01
    attention_s_per_token_ctx: float = 1.06e-9
    decode_s_per_token: float = 1.24e-4  # cluster load only (`work_s`)
    decode_s_per_token_ctx: float = 5.6e-8
    batch_read: bool = False  # count the running decodes' KV read in the TTFT (`read` above)

    def work_s(self, uncached_tokens: int, hit_tokens: int, output_tokens: int) -> float:
        """Engine seconds a request takes from a worker: its uncached prefill, and its decode in a full
        batch (per output token a share of the step plus its KV read, at its mean context)."""
        out = max(0, output_tokens)
        ctx = max(0, hit_tokens) + max(0, uncached_tokens) + out / 2
        decode = out * (self.decode_s_per_token + self.decode_s_per_token_ctx * ctx)
        return self.own_prefill_s(uncached_tokens, hit_tokens) + decode

    def own_prefill_s(self, uncached_tokens: int, hit_tokens: int) -> float:
        u = max(0, uncached_tokens)
        return u / self.prefill_tokens_per_s + self.attention_s_per_token_ctx * u * (hit_tokens + u / 2)

    def ttft_s(
        self, w: WorkerView, uncached_tokens: int, hit_tokens: int = 0, *, late: bool = False
    ) -> float:
        own = self.own_prefill_s(uncached_tokens, hit_tokens) * self.slowdown(w)
        read = self.batch_read_s(w) if self.batch_read else 0.0  # off by default: no call per prediction
        return self.wait_s(w, late=late) + own + read

    def batch_read_s(self, w: WorkerView) -> float:
        """The KV read of the worker's running decodes in the steps up to a new request's first token
        (`read` above; counted only with `batch_read`)."""
        return 1.5 * self.decode_s_per_token_ctx * max(0, w.decoding_context_tokens)

    def slowdown(self, w: WorkerView) -> float:
        return 1.0 + self.decode_slowdown * max(0, w.inflight)

    def wait_s(self, w: WorkerView, *, late: bool = False) -> float:
        """Predicted wait before this request's own prefill: the queued prefill; with `late`, at least
        the lateness the worker's queue already shows (`overdue_s`)."""
        queued = max(0, w.pending_prefill_tokens) / self.prefill_tokens_per_s * self.slowdown(w)
        return self.overhead_s + (max(queued, max(0.0, w.overdue_s)) if late else queued)


@dataclass(frozen=True)
class PredictedTtft:
    """score = scale_s / (scale_s + ttft): 1 for an instant first token, 0.5 at `scale_s` (> 0)."""

    model: TtftModel
    min_gain: float = 0.3
    scale_s: float = 1.0
    late: bool = False  # count the queue's measured lateness (TtftModel.wait_s)
    name: str = "predicted-ttft"

    def ttfts(self, req: RequestView, workers: Sequence[WorkerView]) -> dict[str, float]:
        out: dict[str, float] = {}
        for w in workers:
            hit = effective_hit_tokens(req, w.id, self.min_gain)
            out[w.id] = self.model.ttft_s(w, req.prompt_tokens - hit, hit, late=self.late)
        return out

    def score(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> dict[str, float]:
        return {wid: self.scale_s / (self.scale_s + t) for wid, t in self.ttfts(req, workers).items()}


@dataclass(frozen=True)
class ServeCost:
    """What serving the request on `w` costs, in seconds (kvgate's cost model, policy/kvgate.py):

        cost(w) = ttft(w) + (miss_weight + busy) × own_prefill(w)

    The second term is the uncached prefill once more, as work the worker's later requests wait for
    (a greedy per-request TTFT does not see it). `miss_weight` ≥ 0. `busy` (`busy_weight`, 0 to
    `busy_weight_max`) is how many of this request's full prefills even the least-loaded candidate already
    has queued: when every worker is busy, the cluster is work-bound, a recompute delays everyone queued
    behind it, and a hit is capacity rather than a lost load balance.
    """

    ttft: PredictedTtft
    miss_weight: float = 1.0
    busy_weight_max: float = 0.0
    miss_load: str = "fixed"  # how the cluster load scales miss_weight (`displaced`)
    replica_busy: bool = True  # at overload a new replica's prefill is partly miss work (`parts`)

    def displaced(self, req: RequestView) -> float:
        """The share (0–1) of a recompute's time that later requests would otherwise have used: how
        much of `miss_weight` to charge, from the cluster load the shell measured (`req.cluster_load`
        ρ over `req.pool_workers` N; policy/state.py `LoadMeter`).

            fixed        1 (the load is not read; the default)
            queueing     Erlang C(N, Nρ) (1 at ρ ≥ 1): a later request is delayed by the recompute
                         only if it finds no worker free (M/M/N), so a recompute in a large, lightly
                         loaded pool displaces nobody. Not the default: measured better on the issue-9
                         subset grid, worse at load 0.5 and on held-out workloads (docs/BENCHMARKS.md,
                         "cluster load", session 7)
        """
        if self.miss_load == "fixed":
            return 1.0
        rho = max(0.0, req.cluster_load)
        return erlang_c(max(1, req.pool_workers), rho)

    def busy_weight(self, req: RequestView, workers: Sequence[WorkerView]) -> float:
        """Queued wait on the least-loaded of `workers`, in units of this request's full prefill
        (capped at `busy_weight_max`); 0 while some worker could start it at once. The wait counts the
        lateness each queue already shows (`TtftModel.wait_s(late=True)`): a KV-bound engine admits
        nothing while its queued prefill looks small, and only its lateness shows that wait. The
        minimum over the workers says every one of them runs late, which one stalled worker cannot fake
        (it raises no other worker's wait)."""
        if self.busy_weight_max <= 0 or not workers or req.prompt_tokens <= 0:
            return 0.0
        model = self.ttft.model
        wait = min(model.wait_s(w, late=True) - model.overhead_s for w in workers)
        full = model.own_prefill_s(req.prompt_tokens, 0)
        return min(self.busy_weight_max, max(0.0, wait) / full) if full > 0 else 0.0

    def parts(
        self, req: RequestView, w: WorkerView, hit: int, kept_hit: int | None = None, busy: float = 0.0
    ) -> tuple[float, float, float]:
        """(predicted TTFT, own uncached prefill, cost) of the request on `w` with `hit` cached tokens.

        `kept_hit` (default `hit`): the prefix the miss-work term treats as cached. A new replica of a
        hot prefix pays its prefill in this request's TTFT, honestly, but not again as miss work while
        some worker has room: the replica is an investment later requests draw on, not work they wait
        for. `busy`: `busy_weight` of the candidates. When every worker is busy there is no idle
        capacity for the investment to draw on: busy / (1 + busy) of the replica's prefill is capacity
        lost to every queued request, miss work like any recompute (the same 1 / (1 + busy) shrinks the
        replica's TTFT share in policy/kvgate.py), so at overload a hit is kept rather than copied."""
        model = self.ttft.model
        ttft = model.ttft_s(w, req.prompt_tokens - hit, hit, late=self.ttft.late)
        miss = model.own_prefill_s(req.prompt_tokens - hit, hit)
        if kept_hit is not None and kept_hit > hit:
            lost = busy / (1.0 + busy) if self.replica_busy else 0.0  # the share idle capacity cannot pay
            invested = model.own_prefill_s(req.prompt_tokens - kept_hit, kept_hit)
            miss = invested + (miss - invested) * lost
        return ttft, miss, ttft + (self.miss_weight * self.displaced(req) + busy) * miss

    def cost_s(self, req: RequestView, w: WorkerView, busy: float = 0.0) -> float:
        return self.parts(req, w, effective_hit_tokens(req, w.id, self.ttft.min_gain), busy=busy)[2]


def erlang_c(servers: int, rho: float) -> float:
    """Probability that an arrival waits in an M/M/`servers` queue at utilisation `rho` (1 at ρ ≥ 1),
    by the Erlang B recursion (B_k = a·B_{k−1} ÷ (k + a·B_{k−1}), a = servers·ρ; C = B ÷ (1 − ρ(1 − B)))."""
    if rho >= 1.0:
        return 1.0
    if rho <= 0.0:
        return 0.0
    a, b = servers * rho, 1.0
    for k in range(1, servers + 1):
        b = a * b / (k + a * b)
    return b / (1.0 - rho * (1.0 - b))


def holding_costs_more(
    cost: ServeCost, req: RequestView, holders: Sequence[WorkerView], others: Sequence[WorkerView]
) -> bool:
    """The affinity rules' limit: True when even the best of `holders` (the workers a rule would keep
    the request on) has a predicted TTFT above the cost of serving the request on the cheapest of
    `others`, recompute included; when every worker is busy, both sides' recompute is valued as
    capacity (`ServeCost.busy_weight`). No stickiness window,
    replica cap or cache gain may hold a request past this point."""
    if not holders or not others:
        return False
    busy = cost.busy_weight(req, [*holders, *others])
    hold = min(_held_cost(cost, req, w, busy) for w in holders)
    return hold > min(cost.cost_s(req, w, busy) for w in others)


def _held_cost(cost: ServeCost, req: RequestView, w: WorkerView, busy: float) -> float:
    """A holder's predicted TTFT, plus its own uncached prefill valued as capacity when all are busy
    (`busy`; 0 for a full hit), so that a holder and a non-holder are charged the same recompute."""
    ttft, miss, _ = cost.parts(req, w, effective_hit_tokens(req, w.id, cost.ttft.min_gain))
    return ttft + busy * miss


@dataclass(frozen=True)
class PerWorker:
    """A scorer that rates each worker on its own: `share`, clamped to [0, 1], or 0 for every worker
    when the scorer does not apply to the request (`applies`)."""

    def applies(self, req: RequestView) -> bool:
        return True

    def share(self, req: RequestView, w: WorkerView, now_s: float) -> float:
        raise NotImplementedError

    def score(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> dict[str, float]:
        if not self.applies(req):
            return {w.id: 0.0 for w in workers}
        return {w.id: clamp01(self.share(req, w, now_s)) for w in workers}


@dataclass(frozen=True)
class PrefixMatch(PerWorker):
    """score = hit_tokens / prompt_tokens, or 0 when below `min_gain` (0–1). 0 for an empty prompt."""

    min_gain: float = 0.0
    name: str = "prefix-match"

    def applies(self, req: RequestView) -> bool:
        return req.prompt_tokens > 0

    def share(self, req: RequestView, w: WorkerView, now_s: float) -> float:
        return effective_hit_tokens(req, w.id, self.min_gain) / req.prompt_tokens


@dataclass(frozen=True)
class Load:
    """score = 1 − min(inflight, saturate_at) / saturate_at: 1 idle, 0 at `saturate_at` (≥ 1) requests."""

    saturate_at: int = 32
    name: str = "load"

    def count(self, w: WorkerView) -> int:
        return w.inflight

    def score(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> dict[str, float]:
        return {w.id: saturating(self.count(w), self.saturate_at) for w in workers}


@dataclass(frozen=True)
class QueueDepth(Load):
    """score = 1 − min(waiting, saturate_at) / saturate_at (engine-reported queue, M): Load on the queue."""

    name: str = "queue-depth"

    def count(self, w: WorkerView) -> int:
        return w.waiting


@dataclass(frozen=True)
class KvFree(PerWorker):
    """score = 1 − kv_usage (engine-reported KV cache usage 0–1, M)."""

    name: str = "kv-free"

    def share(self, req: RequestView, w: WorkerView, now_s: float) -> float:
        return 1.0 - w.kv_usage


@dataclass(frozen=True)
class Stickiness:
    """score = 1 for the request's sticky worker while now − since ≤ window_s (≥ 0), else 0."""

    window_s: float = 30.0
    name: str = "stickiness"

    def score(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> dict[str, float]:
        live = sticky_live(req, now_s, self.window_s)
        return {w.id: 1.0 if live and w.id == req.sticky_worker else 0.0 for w in workers}


def sticky_live(req: RequestView, now_s: float, window_s: float) -> bool:
    """The request has a sticky worker whose window has not run out."""
    return (
        req.sticky_worker is not None
        and req.sticky_since_s is not None
        and now_s - req.sticky_since_s <= window_s
    )


@dataclass(frozen=True)
class ColdStart(PerWorker):
    """score = discount × (1 − age / period_s) for a worker younger than period_s, else 0.

    A new worker has no cache, so cache-aware scores starve it; this share (discount 0–1, period ≥ 0)
    fades linearly to 0 over the exploration period. kvgate multiplies its cost by (1 − score).
    """

    period_s: float = 60.0
    discount: float = 0.3
    name: str = "cold-start"

    def applies(self, req: RequestView) -> bool:
        return self.period_s > 0

    def share(self, req: RequestView, w: WorkerView, now_s: float) -> float:
        return self.discount * (1.0 - max(0.0, now_s - w.joined_s) / self.period_s)
