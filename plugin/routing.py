"""Routing: pick the worker for an admitted request and point the flow at it.

`Router` is the imperative shell around the pure policy (policy/): per model it keeps a
`RoutingState` (prefix index mirror, sticky table, prefix rates) and this gateway's own load
accounting (requests in flight and prompt tokens awaiting their first token, per worker). A
decision reads only memory: the mirror's workers (plugin/mirror.py) and this state. After a
decision the request's prefix blocks go to Redis in a batched background writer (approximate
mode), so other gateways learn the placement without this request waiting for it. With
`routing.hit_feedback`, a response whose usage reports fewer cached tokens than the index expected
removes the worker's entries it proves stale (policy/feedback.py), in the mirror and in Redis.

Exact mode (per model, `prefix_mode = "exact"`): before admission, `exact_prompt` replaces the
request's text-chunk hashes by token-block hashes of its token ids (plugin/tokenize.py: the worker's
own /tokenize); the index then holds what the agents report from KV events, so it follows the
workers' real caches, evictions included. The index is hybrid (policy/index.py, docs/EXACT.md): a
worker whose agent publishes KV events (a registered router block size) is `exact`, and routing writes
nothing to Redis for it; with `exact_speculative` its routed blocks enter this gateway's mirror at once
as speculative entries that live `exact_speculative_ttl_ms` unless its KV events confirm them first, so
a burst of one prefix does not scatter during its first prefill. A worker without KV events in the
same pool is `approximate`: its routed blocks (token-block hashes) go to Redis as in approximate mode.

Policies: `kvgate` (policy/kvgate.py), `article` (policy/article.py), and the baselines
`round_robin` and `least_loaded` (for the demo).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from plugin.config import ConfigError, RoutingSection
from plugin.flow import Prompt, Route, Upstream, remember
from plugin.local_tokenizer import LocalTokenizer, LocalTokenizerError
from plugin.tokenize import TokenizeFailed, Tokenizer, TokenizeRequest, tokenize_request
from policy.ab import CANDIDATE_ARM, DEFAULT_ARM, arm_of
from policy.baselines import least_loaded, round_robin
from policy.candidates import candidate_indices
from policy.config import RoutingConfig
from policy.feedback import scaled_cached_tokens
from policy.index import PrefixIndex
from policy.kvgate import build_policy
from policy.ledger import InflightLedger
from policy.prefix import CHARS_PER_TOKEN
from policy.session import SessionBinding, with_session
from policy.state import RoutingState
from policy.types import Band, Decision, ReasonKind, RequestView, WorkerView
from runtime.tasks import cancel_and_wait, spawn
from store import index_store
from store.registry import WorkerRecord

if TYPE_CHECKING:
    from plugin.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

REPUBLISH_S = 10.0  # a block this gateway published for a worker is not written again this soon
PUBLISHED_MAX = 100_000  # per worker, bounded memory for that bookkeeping
DEFAULT_CAPACITY_TOKENS = 1_000_000  # a worker that did not report its KV size
DEFAULT_BLOCK_SIZE = 16  # exact mode, when neither the config nor the agents give a block size
# Index writes are batched this long: each batch costs ~0.3 ms of redis-py CPU here and as much again
# in every gateway's mirror reading it back, whatever the number of requests it carries, so a longer
# window costs less per request; other gateways learn a placement up to this much later.
INDEX_BATCH_S = 0.1


def parse_upstream(url: str, default_scheme: str = "http") -> Upstream:
    parts = urlsplit(url if "://" in url else f"{default_scheme}://{url}")
    scheme = parts.scheme or default_scheme
    if not parts.hostname:
        raise ValueError(f"worker URL without a host: {url!r}")
    return Upstream(scheme, parts.hostname, parts.port or (443 if scheme == "https" else 80))


class ModelRouting:
    """One model's routing state and this gateway's load accounting for its workers."""

    def __init__(
        self,
        config: RoutingConfig,
        blocks_per_token: float,
        *,
        exact: bool = False,
        speculative: bool = False,
        speculative_ttl_s: float = 3.0,
        min_index_tokens: int = 0,
    ) -> None:
        self.exact = exact  # token-block hashes; workers with KV events have the agents' exact entries
        self.blocks_per_token = blocks_per_token
        index = PrefixIndex(
            self._capacity_blocks(DEFAULT_CAPACITY_TOKENS), speculative_ttl_s=speculative_ttl_s
        )
        self.state = RoutingState(
            config, index, insert_on_commit=not exact or speculative, min_index_tokens=min_index_tokens
        )
        # this gateway's R signals per worker, as the simulator keeps them (policy/ledger.py): requests in
        # flight, uncached prefill awaiting its first token, and how late the most overdue of those is
        self.ledger = InflightLedger()
        self.capacity_set: dict[str, int] = {}
        self.kind_set: dict[str, str] = {}

    @property
    def inflight(self) -> dict[str, int]:
        """Requests in flight per worker seen (for metrics and drain)."""
        return {w: self.ledger.inflight(w) for w in self.capacity_set}

    @property
    def pending_prefill(self) -> dict[str, int]:
        """Uncached prefill tokens awaiting their first token, per worker seen."""
        return {w: self.ledger.pending_prefill_tokens(w) for w in self.capacity_set}

    def _capacity_blocks(self, tokens: int) -> int:
        return max(1, int(tokens * self.blocks_per_token))

    def size_index(self, workers: Sequence[WorkerRecord]) -> None:
        """Bound each worker's mirrored index entries by its KV capacity, and in exact mode give it its
        index kind (exact when its agent publishes KV events), when either changed."""
        for w in workers:
            capacity = w.capacity_tokens or DEFAULT_CAPACITY_TOKENS
            if self.capacity_set.get(w.id) != capacity:
                self.state.index.set_capacity(w.id, self._capacity_blocks(capacity))
                self.capacity_set[w.id] = capacity
            if self.exact:
                kind = index_kind(w)
                if self.kind_set.get(w.id) != kind:
                    self.state.index.set_kind(w.id, kind)
                    self.kind_set[w.id] = kind

    def views(self, workers: Sequence[WorkerRecord], now_s: float) -> list[WorkerView]:
        self.size_index(workers)
        out = []
        ledger = self.ledger
        for w in workers:
            out.append(
                WorkerView(
                    id=w.id,
                    running=w.running,
                    waiting=w.waiting,
                    kv_usage=w.kv_usage,
                    capacity_tokens=w.capacity_tokens,
                    max_concurrency=w.max_concurrency,
                    joined_s=w.joined_ms / 1000,
                    healthy=w.live,
                    draining=w.draining,
                    **ledger.signals(w.id, now_s),
                )
            )
        return out


def index_kind(worker: WorkerRecord) -> str:
    """`exact` for a worker whose agent indexes its KV events (it registers a router block size)."""
    return "exact" if worker.router_block_size > 0 else "approximate"


def load_local_tokenizers(directories: Mapping[str, str]) -> dict[str, LocalTokenizer]:
    """model -> its local tokenizer ([models."<m>"] tokenizer); ConfigError names a bad directory."""
    out = {}
    for model, directory in directories.items():
        try:
            out[model] = LocalTokenizer.load(directory)
        except LocalTokenizerError as e:
            raise ConfigError(f"models.{model}.tokenizer", directory, str(e)) from None
    return out


class Router:
    """Picks workers for one gateway process; see the module docstring."""

    def __init__(
        self,
        section: RoutingSection,
        redis: aioredis.Redis | None = None,
        *,
        prefix_modes: dict[str, str] | None = None,
        metrics: GatewayMetrics | None = None,
        tokenizers: Mapping[str, str] | None = None,
    ) -> None:
        self.section = section
        self.prefix_modes = prefix_modes or {}  # per-model overrides of section.prefix_mode
        self.metrics = metrics
        self.tokenizer = Tokenizer(
            timeout_s=section.tokenize_timeout_ms / 1000,
            cache_entries=section.tokenize_cache_entries,
            local=load_local_tokenizers(tokenizers or {}),
        )
        self.policy_config = policy_config = section.policy_config()
        self.redis = redis
        self.rng = random.Random(section.seed)
        self.policy = build_policy(policy_config)
        # the A/B split's candidate arm (routing.ab_policy): its own policy object, the same state
        self.arm_policies = {DEFAULT_ARM: section.policy}
        self.candidate = None
        if section.ab_policy and section.ab_share > 0:
            self.arm_policies[CANDIDATE_ARM] = section.ab_policy
            self.candidate = build_policy(section.policy_config(section.ab_policy))
        self.models: dict[str, ModelRouting] = {}
        self._round_robin = itertools.count()
        self._sample_rng = random.Random(section.seed + 1)  # its own: the policy's draws stay as they were
        self._upstreams: dict[str, Upstream] = {}
        self._pending_index: dict[tuple[str, str], tuple[int, list[int]]] = {}
        # hit feedback for Redis: (model, worker) -> (entries used before this ms are stale, the reporting
        # requests' own blocks, which their prefill cached again)
        self._pending_forget: dict[tuple[str, str], tuple[int, set[int]]] = {}
        self._reports_cached: set[tuple[str, str]] = set()  # (model, worker) whose usage had a cached count
        # an OrderedDict, not a cachetools cache: it is read once per prefix block of every request,
        # and cachetools' Python-level get/contains cost ~3 calls each (+5% hook CPU, bench.hook_cost)
        self._published: dict[tuple[str, str], OrderedDict[int, float]] = {}
        self._writer: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def model(self, name: str) -> ModelRouting:
        routing = self.models.get(name)
        if routing is None:
            if self.is_exact(name):
                block = self.section.exact_block_size or DEFAULT_BLOCK_SIZE
                routing = ModelRouting(
                    self.policy_config,
                    1 / block,
                    exact=True,
                    speculative=self.section.exact_speculative,
                    speculative_ttl_s=self.section.exact_speculative_ttl_ms / 1000,
                    min_index_tokens=self.section.index_min_prefix_tokens,
                )
            else:
                routing = ModelRouting(
                    self.policy_config,
                    CHARS_PER_TOKEN / self.section.chunk_chars,
                    min_index_tokens=self.section.index_min_prefix_tokens,
                )
            self.models[name] = routing
        return routing

    def is_exact(self, model: str) -> bool:
        """Whether `model` routes on the agents' exact (token-block) index."""
        return self.prefix_modes.get(model, self.section.prefix_mode) == "exact"

    # -- exact mode: token ids before admission ------------------------------------------------------
    async def exact_prompt(
        self,
        body: dict[str, object],
        model: str,
        fallback: Prompt | Callable[[], Prompt],
        workers: Sequence[WorkerRecord],
        request_for: Callable[[Mapping[str, object], str], TokenizeRequest] = tokenize_request,
    ) -> Prompt:
        """The request's token-block hashes (exact mode), or `fallback` (its approximate hashes, or what
        computes them: only needed then) when no token ids could be had; the fallback is counted in
        kvgate_prefix_fallbacks_total."""
        started = time.monotonic()
        try:
            blocks, source = await self.tokenizer.blocks(
                body, model, workers, self.block_size(model, workers), request_for
            )
        except TokenizeFailed as e:
            logger.debug("exact prefix of a %s request: %s; approximate instead", model, e)
            if self.metrics is not None:
                self.metrics.prefix_fallbacks.inc(model, e.reason)
            return fallback if isinstance(fallback, Prompt) else fallback()
        if self.metrics is not None:
            self.metrics.tokenized.inc(model, source)
            if source == "worker":
                self.metrics.tokenize_seconds.observe(time.monotonic() - started, model)
        return Prompt(blocks.hashes, blocks.block_tokens, blocks.prompt_tokens, exact=True)

    def block_size(self, model: str, workers: Sequence[WorkerRecord]) -> int:
        """Exact-mode block size: the config's, else the one most of the agents registered, else 16."""
        block = self.section.exact_block_size
        if not block:
            sizes = [w.router_block_size for w in workers if w.router_block_size > 0]
            block = max(set(sizes), key=sizes.count) if sizes else DEFAULT_BLOCK_SIZE
        routing = self.model(model)
        if routing.blocks_per_token != 1 / block:  # size the mirrored index in blocks of this size
            routing.blocks_per_token = 1 / block
            routing.capacity_set.clear()
        return block

    # -- the decision (hot path: memory only) --------------------------------------------------------
    def choose(
        self,
        *,
        request_id: str,
        model: str,
        prompt: Prompt,
        max_tokens: int,
        band: Band,
        tenant: str,
        workers: Sequence[WorkerRecord],
        arm: str = DEFAULT_ARM,
        session: SessionBinding | None = None,
        streamed: bool = True,
    ) -> Route | None:
        """The route for a request among routable `workers`, or None if the policy rejects them all.

        No side effect on this gateway's accounting: `reserve()` counts the route's load (so concurrent
        decisions see it) and `record()` writes the routing history (index, stickiness) once the
        request is placed."""
        if not workers:
            return None
        now = time.monotonic()
        routing = self.models.get(model) or self.model(model)  # (the lookup inline: hot path)
        pool = len(workers)  # the cluster load is shared by all of them, not only the candidates
        workers = self._candidates(routing, prompt, workers)
        views = routing.state.observe_workers(routing.views(workers, now), now)
        view = routing.state.prepare(
            request_id=request_id, prefix_hashes=prompt.hashes, block_tokens=prompt.block_tokens,
            prompt_tokens=prompt.prompt_tokens, workers=views, now_s=now, model=model,
            max_tokens=max_tokens, band=band, tenant=tenant, pool_workers=pool,
        )  # fmt: skip
        view = with_session(view, session)  # the client's session binding, if any (policy/session.py)
        decision = self._decide(view, views, now, arm)
        if decision.worker is None:
            return None
        worker = next(w for w in workers if w.id == decision.worker)
        route = Route(model, worker, self.upstream(worker.url), decision, view, streamed=streamed)
        matched = view.prefix_hits.get(worker.id, 0)
        if not prompt.exact:  # text-chunk hashes: only routing history can match them
            route.index_kind = "approximate" if matched else "none"
        else:
            route.index_kind = routing.state.index.match_kind(worker.id, prompt.hashes, matched)
        return route

    def _candidates(
        self, routing: ModelRouting, prompt: Prompt, workers: Sequence[WorkerRecord]
    ) -> Sequence[WorkerRecord]:
        """`workers`, or in a large fleet the prefix's holders and a random sample (policy/candidates.py)."""
        limit = self.section.candidates_limit
        if len(workers) <= limit:
            return workers
        routing.size_index(workers)  # every worker's LRU bound, not only the candidates'
        hits = routing.state.index.match(prompt.hashes)
        at = {w.id: i for i, w in enumerate(workers)} if hits else {}
        holder_hits = {at[w]: n for w, n in hits.items() if w in at}
        sample = self.section.candidates_sample
        chosen = candidate_indices(
            len(workers), holder_hits, limit=limit, sample=sample, rng=self._sample_rng
        )
        return workers if chosen is None else [workers[i] for i in chosen]

    def route(self, **request: Any) -> Route | None:
        """`choose(**request)`, then `reserve()` and `record()` the choice (a request placed at once)."""
        route = self.choose(**request)
        if route is not None:
            self.reserve(route)
            self.record(route)
        return route

    def reserve(self, route: Route) -> None:
        """Count the route's request as in flight on its worker (undone by `finished()`): in the ledger,
        with its uncached prefill and the first token the policy predicted. A request that is not
        streamed has no first-token signal before it ends, so it is never counted late."""
        worker, view = route.worker.id, route.view
        route.first_token_seen = False
        scores = route.decision.scores.get(worker, {})
        predicted = scores.get("predicted-ttft", 0.0) if route.streamed else math.inf
        uncached = max(0, view.prompt_tokens - view.hit_tokens(worker))
        (self.models.get(route.model) or self.model(route.model)).ledger.dispatch(
            view.id, worker, uncached, predicted, time.monotonic(), view.prompt_tokens
        )

    def record(self, route: Route) -> None:
        """Write the routing history: prefix index (approximate mode, or in exact mode a worker without KV
        events), stickiness, prefix rate."""
        routing = self.models.get(route.model) or self.model(route.model)
        if self.section.hit_feedback:  # the evidence its usage will be checked against, before the commit
            route.expected_touched_s = routing.state.hit_expectation(route.view, route.worker.id)
        routing.state.commit(route.view, route.decision, time.monotonic())
        if (
            self.section.write_index
            and self.redis is not None
            and route.view.prefix_hashes
            and routing.state.worth_indexing(route.view.block_tokens)
            and not (routing.exact and index_kind(route.worker) == "exact")
        ):
            self._queue_index_write(route.model, route.worker, route.view.prefix_hashes)

    def record_soon(self, route: Route) -> None:
        """`record(route)` once the loop is free again: the request hook returns first, and the request
        goes out to its worker before its routing history is written (a commit walks every prefix block:
        ~0.4 ms for an exact-mode prompt of 382 token blocks, where the request does not need it)."""
        asyncio.get_running_loop().call_soon(self.record, route)

    def best_hit_tokens(self, model: str, prompt: Prompt) -> int:
        """Prompt tokens the best-placed worker is believed to hold (for admission seats)."""
        hits = self.model(model).state.index.match(prompt.hashes)
        return sum(prompt.block_tokens[: max(hits.values(), default=0)])

    def arm(self, tenant: str, prompt: Prompt) -> str:
        """The request's A/B arm (policy/ab.py): "default" unless routing.ab_policy is set."""
        if self.candidate is None:
            return DEFAULT_ARM
        return arm_of(self.section.ab_share, tenant, prompt.hashes, self.section.ab_by)

    def _decide(self, view: RequestView, views: list[WorkerView], now: float, arm: str) -> Decision:
        policy = self.arm_policies.get(arm, self.section.policy)
        if policy == "round_robin":
            return Decision(round_robin([w.id for w in views], next(self._round_robin)), "round robin")
        if policy == "least_loaded":
            load = {w.id: float(w.inflight + w.waiting) for w in views}
            pick = least_loaded(list(load), load.__getitem__, lambda _: self.rng.random())
            return Decision(pick, "least loaded", kind=ReasonKind.LOAD)
        chosen = self.candidate if arm == CANDIDATE_ARM and self.candidate is not None else self.policy
        return chosen.decide(view, views, self.rng, now)

    def upstream(self, url: str) -> Upstream:
        found = self._upstreams.get(url)
        if found is None:
            found = remember(self._upstreams, url, parse_upstream(url))
        return found

    # -- outcome accounting --------------------------------------------------------------------------
    def first_token(self, route: Route) -> None:
        """The route's first token came back: its prefill is no longer queued, nor late (idempotent)."""
        if not route.first_token_seen:
            route.first_token_seen = True
            (self.models.get(route.model) or self.model(route.model)).ledger.first_token(
                route.view.id, time.monotonic()
            )

    def hit_feedback(self, route: Route, prompt_tokens: int, cached_tokens: int | None) -> int:
        """The route's worker reported `cached_tokens` of its `prompt_tokens` cached (its usage): forget the
        entries this proves stale (policy/feedback.py), in the mirror at once and in Redis by the batched
        writer, so every gateway unlearns them. Returns how many entries the mirror dropped.

        vLLM omits `prompt_tokens_details` when nothing was cached (and always without
        --enable-prompt-tokens-details): a usage without it means 0 from a worker that reported a
        cached count before, and nothing from one that never did."""
        expected, route.expected_touched_s = route.expected_touched_s, ()
        reporter = (route.model, route.worker.id)
        if cached_tokens is not None:
            self._reports_cached.add(reporter)
        elif reporter in self._reports_cached:
            cached_tokens = 0
        if not expected or cached_tokens is None:
            return 0
        view = route.view
        cached = scaled_cached_tokens(cached_tokens, prompt_tokens, view.prompt_tokens)
        routing = self.models.get(route.model) or self.model(route.model)
        stale = routing.state.hit_feedback(route.worker.id, expected, cached, view.block_tokens)
        if stale is None:
            return 0
        before_s, dropped = stale
        if self.section.write_index and self.redis is not None:
            # Redis scores are wall-clock ms: the same instant, `now - before_s` ago
            before_ms = int((time.time() - (time.monotonic() - before_s)) * 1000)
            key = (route.model, route.worker.id)
            pending = self._pending_forget.get(key)
            if pending is None:
                self._pending_forget[key] = (before_ms, set(view.prefix_hashes))
            else:  # several reports in one batch: the latest evidence, and every reporter's own blocks
                self._pending_forget[key] = (max(before_ms, pending[0]), pending[1] | set(view.prefix_hashes))
            self._wake.set()
        if self.metrics is not None and dropped:
            self.metrics.index_unlearnt.inc(route.model, route.worker.id, by=len(dropped))
        return len(dropped)

    def finished(self, route: Route) -> None:
        """The route's request ended (any way) or gave its reservation back."""
        self.first_token(route)
        (self.models.get(route.model) or self.model(route.model)).ledger.finish(
            route.view.id, time.monotonic()
        )

    # -- index feed from the mirror ------------------------------------------------------------------
    def apply_index_ops(self, model: str, ops: Sequence[index_store.IndexOp]) -> None:
        started = time.perf_counter_ns()
        index = self.model(model).state.index
        now = time.monotonic()
        for op in ops:
            if op.op == "add":
                index.insert(op.worker, op.hashes, now)
            elif op.op == "remove":
                index.remove(op.worker, op.hashes)
            elif op.op == "clear":
                index.clear(op.worker)
        if self.metrics is not None:  # the loop's time off the request path (one run per batch)
            self.metrics.hot_path_cpu.add(model, "index_feed", DEFAULT_ARM, time.perf_counter_ns() - started)

    def reset_worker(self, model: str, worker: str) -> None:
        self.model(model).state.forget_worker(worker)
        self._published.pop((model, worker), None)

    # -- batched index writer ------------------------------------------------------------------------
    def _queue_index_write(self, model: str, worker: WorkerRecord, hashes: Sequence[int]) -> None:
        """Queue the blocks this gateway has not published for `worker` within REPUBLISH_S (a shared
        system prompt is published once, not with every request that carries it)."""
        key = (model, worker.id)
        now = time.monotonic()
        recent = self._published.get(key)
        if recent is None:
            recent = self._published[key] = OrderedDict()
        fresh = [h for h in hashes if now - recent.get(h, -REPUBLISH_S) >= REPUBLISH_S]
        if not fresh:
            return
        for h in fresh:
            recent[h] = now
            recent.move_to_end(h)
        while len(recent) > PUBLISHED_MAX:
            recent.popitem(last=False)
        capacity = (self.models.get(model) or self.model(model))._capacity_blocks(
            worker.capacity_tokens or DEFAULT_CAPACITY_TOKENS
        )
        entry = self._pending_index.get(key)
        if entry is None:
            self._pending_index[key] = (capacity, fresh)
        else:
            entry[1].extend(fresh)
        self._wake.set()

    async def start(self) -> None:
        if self.redis is not None and self.section.write_index:
            self._writer = spawn(self._write_loop(), name="kvgate-index-writer")

    async def close(self) -> None:
        await cancel_and_wait(self._writer)
        await self.tokenizer.close()

    async def _write_loop(self) -> None:
        assert self.redis is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(INDEX_BATCH_S)  # batch what arrives meanwhile
            forget, self._pending_forget = self._pending_forget, {}
            for (model, worker), (before_ms, keep) in forget.items():  # before this batch's adds
                try:
                    await index_store.forget_before(self.redis, model, worker, before_ms, list(keep))
                except (RedisError, OSError) as e:
                    logger.warning("hit feedback for %s/%s failed: %s", model, worker, e)
            batch, self._pending_index = self._pending_index, {}
            now_ms = int(time.time() * 1000)
            for (model, worker), (capacity, hashes) in batch.items():
                unique = list(dict.fromkeys(hashes))
                try:
                    await index_store.add_blocks(self.redis, model, worker, unique, now_ms, capacity)
                except (RedisError, OSError) as e:
                    logger.warning("index write for %s/%s failed: %s", model, worker, e)
