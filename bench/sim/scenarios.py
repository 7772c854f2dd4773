"""Generated workloads from the design article, deterministic from a seed (`kvgate bench sim --scenario`).

Each scenario builds prompts from named segments (a system prompt, a document, a user turn, ...) and
cuts them into 512-token blocks with Mooncake semantics: a block id names the block's content *and
everything before it*, so two prompts share block i iff their first (i+1)*512 tokens are identical,
and a partial last block never shares an id with a full one. Arrival times are nominal seconds; the
offered load (bench/sim/load.py) rescales them, think times and bursts included.

Cache pressure = reusable working set ÷ one worker's KV capacity, stated against the default profile
h100-llama3.1-8b (436,551 tokens per worker; 3.49 M tokens for 8 workers). Affinity can only pay when
the pressure is > 1 but < the number of workers (shared/DESIGN.md, "Evaluating routing honestly");
the report prints the measured value of every run.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from bench.sim.capacity import capacity_rps
from bench.sim.profiles import EngineProfile
from bench.sim.traces import TRACE_BLOCK_TOKENS
from bench.sim.types import SimRequest
from policy.types import Band

Segment = tuple[Hashable, int]  # (content key, tokens)


class PromptBlocks:
    """Chained block ids for prompts made of segments; equal content + equal prefix => equal id."""

    def __init__(self, block_size: int = TRACE_BLOCK_TOKENS) -> None:
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[tuple[Hashable, int, int], ...]], int] = {}

    def blocks(self, segments: Sequence[Segment]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(block ids, block token counts) of the prompt formed by `segments` in order."""
        ids: list[int] = []
        sizes: list[int] = []
        parent = -1
        content: list[tuple[Hashable, int, int]] = []
        filled = 0
        for key, length in segments:
            offset = 0
            while offset < length:
                take = min(length - offset, self.block_size - filled)
                content.append((key, offset, offset + take))
                offset += take
                filled += take
                if filled == self.block_size:
                    parent = self._intern(parent, content)
                    ids.append(parent)
                    sizes.append(filled)
                    content, filled = [], 0
        if filled:
            ids.append(self._intern(parent, content))
            sizes.append(filled)
        return tuple(ids), tuple(sizes)

    def _intern(self, parent: int, content: list[tuple[Hashable, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(content)), len(self._ids))


def _request(
    blocks: PromptBlocks,
    rid: int,
    at_s: float,
    segments: Sequence[Segment],
    output: int,
    tenant: str = "default",
    band: Band = Band.NORMAL,
    slo_ttft_s: float | None = None,
) -> SimRequest:
    ids, sizes = blocks.blocks(segments)
    return SimRequest(rid, at_s, sum(sizes), output, ids, sizes, band, tenant, slo_ttft_s)


def _zipf_cum_weights(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (k**s) for k in range(1, n + 1)))


def _poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(n)))


def system_prompt(seed: int, n: int = 3000) -> list[SimRequest]:
    """One 6,144-token system prompt shared by every user + 200-1,200 unique tokens (the article's headline).

    Pressure ≈ 0.014 (6k reusable tokens): round-robin warms every worker once and does nearly as well
    as affinity; the interesting part is load balance under a hot prefix."""
    rng, blocks = random.Random(seed), PromptBlocks()
    times = _poisson_times(rng, n, 4.0)
    return [
        _request(blocks, i, t, [("sys", 6144), (("user", i), rng.randint(200, 1200))], rng.randint(100, 400))
        for i, t in enumerate(times)
    ]


def multi_turn(seed: int, n: int = 2000) -> list[SimRequest]:
    """Chats of 3-10 turns; each turn re-sends the whole history (1,024-token shared system prompt,
    user turns of 100-600 tokens, the previous answers), with exponential think times (mean 20 s).

    Pressure ≈ 2.1 per worker at n = 2000 (about n/6 chats, ~5k-token final histories; 0.27 of 8
    workers' KV): round-robin makes every worker hold every chat and thrash; affinity partitions the chats."""
    rng, blocks = random.Random(seed), PromptBlocks()
    pending: list[tuple[float, int, list[Segment], int]] = []  # (arrival, chat, segments, turns left)
    chat_starts = _poisson_times(rng, max(1, n // 6), 0.6)
    for chat, start in enumerate(chat_starts):
        pending.append((start, chat, [("sys", 1024)], rng.randint(3, 10)))
    out: list[tuple[float, list[Segment], int]] = []
    while pending and len(out) < n:
        pending.sort(key=lambda p: (p[0], p[1]))
        at, chat, history, turns_left = pending.pop(0)
        turn = len(out)
        history = [*history, (("user", chat, turn), rng.randint(100, 600))]
        output = rng.randint(150, 500)
        out.append((at, history, output))
        if turns_left > 1:
            latency = 2.0 + output * 0.02  # nominal answer time before the user starts thinking
            next_at = at + latency + rng.expovariate(1 / 20.0)
            pending.append((next_at, chat, [*history, (("assistant", chat, turn), output)], turns_left - 1))
    return [_request(blocks, i, at, segs, output) for i, (at, segs, output) in enumerate(out)]


def rag(seed: int, n: int = 3000) -> list[SimRequest]:
    """A 512-token system prompt, then one of 300 retrieved documents (2-4k tokens, Zipf popularity
    s = 1.0), then a unique 30-200-token question.

    Pressure ≈ 1.5 per worker (670k tokens of documents requested twice or more; 0.19 of 8 workers)."""
    rng, blocks = random.Random(seed), PromptBlocks()
    doc_tokens = [rng.randint(2000, 4000) for _ in range(300)]
    cum = _zipf_cum_weights(len(doc_tokens), 1.0)
    times = _poisson_times(rng, n, 4.0)
    reqs = []
    for i, t in enumerate(times):
        doc = rng.choices(range(len(doc_tokens)), cum_weights=cum)[0]
        segments = [("sys", 512), (("doc", doc), doc_tokens[doc]), (("q", i), rng.randint(30, 200))]
        reqs.append(_request(blocks, i, t, segments, rng.randint(50, 300)))
    return reqs


def mixed(seed: int, n: int = 3000) -> list[SimRequest]:
    """95 % short requests (512-token shared prompt + 200-2,000 unique tokens) and 5 % very long ones
    (16k-64k unique tokens): the article's "a few instances drown in long requests".

    Pressure ≈ 0.001 (one shared block): a load-balance test; counting requests instead of work loses."""
    rng, blocks = random.Random(seed), PromptBlocks()
    times = _poisson_times(rng, n, 4.0)
    reqs = []
    for i, t in enumerate(times):
        if rng.random() < 0.05:
            segments, output = (
                [("sys", 512), (("long", i), rng.randint(16_000, 64_000))],
                rng.randint(200, 800),
            )
        else:
            segments, output = [("sys", 512), (("short", i), rng.randint(200, 2000))], rng.randint(50, 300)
        reqs.append(_request(blocks, i, t, segments, output))
    return reqs


def burst(seed: int, n: int = 3000) -> list[SimRequest]:
    """Steady Poisson load with a burst at 4x the rate for a tenth of the run; 16 system prompts of
    1.5-3k tokens (uniform choice) + 100-800 unique tokens.

    Pressure ≈ 0.07 (≈31k reusable tokens): tests how a policy spreads a burst without losing affinity."""
    rng, blocks = random.Random(seed), PromptBlocks()
    prompts = [rng.randint(1536, 3072) for _ in range(16)]
    base_rate, duration = 4.0, n / 4.0 / 1.3  # the burst adds 0.3 of the base volume
    times: list[float] = []
    t = 0.0
    while len(times) < n:
        in_burst = 0.45 * duration <= t < 0.55 * duration
        t += rng.expovariate(base_rate * (4.0 if in_burst else 1.0))
        times.append(t)
    reqs = []
    for i, at in enumerate(times):
        p = rng.randrange(len(prompts))
        segments = [(("sys", p), prompts[p]), (("user", i), rng.randint(100, 800))]
        reqs.append(_request(blocks, i, at, segments, rng.randint(100, 300)))
    return reqs


def multi_tenant(seed: int, n: int = 4000) -> list[SimRequest]:
    """150 tenants, each with its own 4k-16k-token system prompt (Zipf popularity s = 0.8), + 100-1,000
    unique tokens per request; `tenant` is set.

    Pressure ≈ 3.5 per worker (1.5 M tokens of prompts; 0.44 of 8 workers): the case where cache-aware
    routing should win clearly over round-robin."""
    rng, blocks = random.Random(seed), PromptBlocks()
    prompts = [rng.randint(4000, 16_000) for _ in range(150)]
    cum = _zipf_cum_weights(len(prompts), 0.8)
    times = _poisson_times(rng, n, 4.0)
    reqs = []
    for i, t in enumerate(times):
        k = rng.choices(range(len(prompts)), cum_weights=cum)[0]
        segments = [(("tenant", k), prompts[k]), (("user", i), rng.randint(100, 1000))]
        reqs.append(_request(blocks, i, t, segments, rng.randint(100, 400), tenant=f"t{k}"))
    return reqs


def churn(seed: int, n: int = 4000) -> list[SimRequest]:
    """Caches that churn: 800 tenants' 4k-16k-token system prompts (Zipf s = 0.9) + 100-800 unique
    tokens; a fifth of the requests bypass the router (each such tenant's client talks to one worker
    directly), and worker w0 restarts halfway through (`Engine.restart`: its running requests start
    over and its whole prefix cache is gone).

    The reusable working set is ≈11x one worker's KV, 1.4x the 8 workers' pooled KV (pooled-LRU hit
    64 % against 77 % with an infinite cache): the cluster cannot hold it, evictions are constant, and
    the router cannot see a fifth of the traffic nor the restart, unless it follows the engines' KV
    events (the exact index). Its default load is 1.6 of cold capacity (`Scenario.default_load`): like
    llm-d's shared-prefix benchmark, the offered load exceeds what the cluster serves without cache
    hits, so the hit rate decides whether it keeps up (docs/SIMULATOR.md, "Churn")."""
    rng, blocks = random.Random(seed), PromptBlocks()
    prompts = [rng.randint(4000, 16_000) for _ in range(800)]
    cum = _zipf_cum_weights(len(prompts), 0.9)
    times = _poisson_times(rng, n, 4.0)
    reqs = []
    for i, t in enumerate(times):
        k = rng.choices(range(len(prompts)), cum_weights=cum)[0]
        segments = [(("tenant", k), prompts[k]), (("user", i), rng.randint(100, 800))]
        req = _request(blocks, i, t, segments, rng.randint(100, 400), tenant=f"t{k}")
        bypass, restart = rng.random() < 0.2, ("w0",) if i == n // 2 else ()
        reqs.append(dataclasses.replace(req, bypass=bypass, restart_before=restart))
    return reqs


@dataclass(frozen=True, slots=True)
class Stream:
    """One kind of traffic of the overload scenario; loads are fractions of the cluster's measured
    capacity for this kind (bench/sim/capacity.py)."""

    name: str
    band: Band
    tenants: tuple[str, ...]
    steady_load: float
    burst_load: float
    slo_ttft_s: float
    shared_tokens: tuple[int, int]  # per-tenant system prompt length range (0, 0) = none
    unique_tokens: tuple[int, int]
    output_tokens: tuple[int, int]


# steady 0.6 = 0.15 high + 0.15 normal + 0.30 low; burst 2.0 = 0.30 high + 0.15 normal + 1.00 from one
# flooding tenant (normal band) + 0.55 low. Online traffic is short, under per-tenant system prompts,
# with a tight TTFT SLO; offline traffic has long prompts and outputs and a loose SLO.
OVERLOAD_STREAMS = (
    Stream(
        "chat", Band.HIGH, ("chat-a", "chat-b", "chat-c"), 0.15, 0.30, 2.0, (1024, 2048), (50, 600), (50, 250)
    ),
    Stream(
        "api", Band.NORMAL, ("api-1", "api-2", "api-3"), 0.15, 0.15, 10.0, (512, 512), (500, 3000), (100, 400)
    ),
    Stream("flood", Band.NORMAL, ("api-flood",), 0.0, 1.0, 10.0, (512, 512), (500, 3000), (100, 400)),
    Stream("batch", Band.LOW, ("batch-x", "batch-y"), 0.30, 0.55, 60.0, (0, 0), (4000, 12_000), (300, 1500)),
)
OVERLOAD_PHASES_S = (60.0, 60.0, 90.0)  # steady, burst (2x capacity), back to steady
HALF_LOAD_SCALE = 0.5 / 0.6  # the steady mix scaled to 0.5 of capacity (the reference run)


def overload_requests(
    seed: int,
    profile: EngineProfile,
    workers: int,
    load_scale: float = 1.0,
    burst: bool = True,
    streams: Sequence[Stream] = OVERLOAD_STREAMS,
    phases_s: tuple[float, float, float] = OVERLOAD_PHASES_S,
) -> list[SimRequest]:
    """The overload scenario in absolute virtual seconds for `workers` engines of `profile`.

    Each stream is a Poisson process per phase at load x `load_scale` x its measured capacity
    (`stream_capacity_rps` x `workers`), so the phases ask for 0.6 / 2.0 / 0.6 of what the cluster
    serves. `burst=False` keeps the steady mix during the burst window (the half-load reference:
    `load_scale=HALF_LOAD_SCALE, burst=False`)."""
    rng = random.Random(seed)
    drafts: list[tuple[float, Stream, str, list[Segment], int]] = []
    for stream in streams:
        capacity = workers * stream_capacity_rps(profile, stream)
        start = 0.0
        for phase, length in enumerate(phases_s):
            load = stream.burst_load if phase == 1 and burst else stream.steady_load
            rate = load * load_scale * capacity
            t = start
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= start + length:
                    break
                tenant, segs, out = _overload_content(rng, stream, len(drafts))
                drafts.append((t, stream, tenant, segs, out))
            start += length
    drafts.sort(key=lambda d: d[0])
    blocks = PromptBlocks()
    return [
        _request(blocks, i, t, segs, out, tenant, stream.band, stream.slo_ttft_s)
        for i, (t, stream, tenant, segs, out) in enumerate(drafts)
    ]


@functools.cache
def stream_capacity_rps(profile: EngineProfile, stream: Stream) -> float:
    """Requests per second one engine of `profile` serves of `stream` alone (bench/sim/capacity.py)."""
    sample = stream_alone(stream, 1.0, 200.0)
    return capacity_rps(profile, lambda rate, span_s: stream_alone(stream, rate, span_s), sample)


def overload_utilisation(
    requests: Sequence[SimRequest],
    profile: EngineProfile,
    workers: int,
    streams: Sequence[Stream] = OVERLOAD_STREAMS,
) -> float:
    """Fraction of the cluster's measured capacity the requests ask for over their arrival span (each
    request counts 1 / its stream's capacity; the stream is known by the tenant)."""
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    if span <= 0:
        raise ValueError("utilisation needs at least two distinct arrival times")
    capacity = {t: stream_capacity_rps(profile, s) for s in streams for t in s.tenants}
    return sum(1 / capacity[r.tenant] for r in requests) / (span * workers)


def stream_alone(stream: Stream, rate: float, span_s: float) -> list[SimRequest]:
    """The stream's traffic by itself: Poisson at `rate` requests/s over [0, `span_s`), fixed seed (so
    a measured capacity depends only on the stream and the profile)."""
    rng, blocks = random.Random(f"capacity:{stream.name}"), PromptBlocks()
    out: list[SimRequest] = []
    t = rng.expovariate(rate)
    while t < span_s:
        tenant, segs, output = _overload_content(rng, stream, len(out))
        out.append(_request(blocks, len(out), t, segs, output, tenant, stream.band, stream.slo_ttft_s))
        t += rng.expovariate(rate)
    return out


def _overload_content(rng: random.Random, stream: Stream, key: int) -> tuple[str, list[Segment], int]:
    tenant = rng.choice(stream.tenants)
    segments: list[Segment] = []
    if stream.shared_tokens[1] > 0:  # one system prompt per tenant, its length fixed by the name
        segments.append((("sys", tenant), random.Random(tenant).randint(*stream.shared_tokens)))
    segments.append(((stream.name, key), rng.randint(*stream.unique_tokens)))
    return tenant, segments, rng.randint(*stream.output_tokens)


def overload(seed: int, n: int = 100_000) -> list[SimRequest]:
    """The overload scenario for the default profile and 8 workers; the runner rebuilds it for the
    actual profile and worker count (`bench.sim.runner.load_requests`)."""
    from bench.sim.profiles import load_profile

    return overload_requests(seed, load_profile("h100-llama3.1-8b"), 8)[:n]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    build: Callable[[int, int], list[SimRequest]]  # (seed, n) -> requests sorted by arrival
    default_n: int
    help: str
    default_load: float = 0.8  # offered load, fraction of cold capacity, when --load is not given


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("system_prompt", system_prompt, 3000, "one shared 6k system prompt + short unique text"),
        Scenario("multi_turn", multi_turn, 2000, "growing multi-turn chats; working set 2.1x one worker"),
        Scenario("rag", rag, 3000, "300 shared documents with Zipf popularity + unique questions"),
        Scenario("mixed", mixed, 3000, "mostly short requests + 5% very long (16k-64k) ones"),
        Scenario("burst", burst, 3000, "steady load with a 4x burst; 16 system prompts"),
        Scenario(
            "multi_tenant", multi_tenant, 4000, "150 tenant system prompts; working set 3.5x one worker"
        ),
        Scenario(
            "churn",
            churn,
            4000,
            "800 tenant prompts (1.4x the pooled KV), 1/5 bypasses the router, w0 restarts; load 1.6",
            default_load=1.6,
        ),
        Scenario(
            "overload",
            overload,
            100_000,
            "3 bands, 9 tenants, TTFT SLOs: steady 0.6, 2x capacity for 60 s (a tenant floods), back",
        ),
    )
}


class UnknownScenario(ValueError):
    pass


def list_scenarios() -> list[tuple[str, str]]:
    """(name, one-line help) of every scenario."""
    return [(s.name, s.help) for s in SCENARIOS.values()]


def default_load(name: str | None) -> float:
    """The offered load a scenario runs at when none is asked for (0.8 for traces)."""
    scenario = SCENARIOS.get(name or "")
    return 0.8 if scenario is None else scenario.default_load


def build_scenario(name: str, seed: int, limit: int | None = None) -> list[SimRequest]:
    """The scenario's requests (default size, or `limit` requests)."""
    scenario = SCENARIOS.get(name)
    if scenario is None:
        raise UnknownScenario(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return scenario.build(seed, limit if limit is not None else scenario.default_n)
