"""Workloads of `kvgate bench live`, as block traces the simulator replays too, and as real chat text.

A workload is a list of `SimRequest`s with Mooncake block semantics (bench/sim/traces.py): block id i
names the block *and everything before it*. The live run turns each block id into its own fixed text
(`BlockText`), so two prompts share leading text exactly where they share leading block ids, and the
emulated workers' prefix caches see the same sharing the simulator's engines see. Arrival times are
rescaled to an offered load by the simulator's own rule (bench/sim/load.py, capacity without cache
hits), and the rescaled trace is written as Mooncake JSONL so `kvgate bench sim --trace` replays the
very same requests (item 2 of issue 11).

Workloads:
  tenants   20 tenants with 2-6k-token system prompts (Zipf popularity); multi-turn sessions that
            re-send their history, one-off questions and one-off documents (1-4k unique tokens).
  mooncake  a slice of the Mooncake arXiv trace (shared/traces/mooncake_arxiv_first1000).
  weka      WEKA agentic-coding conversations (shared/traces/weka_agentic_coding, bench/sim/traces.py
            `load_weka`): 40 conversations started within 10 minutes, calls above 36k tokens of
            context dropped (the emulated pools are small); the first n calls.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from bench.live_scenarios import filler_text
from bench.loadgen import LiveRequest
from bench.sim.load import scale_to_load
from bench.sim.profiles import EngineProfile
from bench.sim.scenarios import PromptBlocks, Segment
from bench.sim.traces import WekaOptions, load_trace, load_weka
from bench.sim.types import SimRequest

TRACES = Path("/work/shared/traces")
MOONCAKE_SLICE = TRACES / "mooncake_arxiv_first1000" / "mooncake_trace_1000.jsonl"
WEKA_TRACES = TRACES / "weka_agentic_coding" / "traces.tar.gz"
WEKA_MAX_CONTEXT = 36_000
WORKLOADS = ("tenants", "mooncake", "weka")


def tenants(seed: int, n: int) -> list[SimRequest]:
    """The multi-tenant system-prompt scenario of issue 11 (see the module docstring)."""
    rng, blocks = random.Random(seed), PromptBlocks()
    prompts = [rng.randint(2000, 6000) for _ in range(20)]
    weights = [1.0 / (k + 1) ** 0.6 for k in range(len(prompts))]
    sessions: dict[int, tuple[int, list[Segment]]] = {}  # session -> (tenant, history)
    out: list[SimRequest] = []
    at = 0.0
    for i in range(n):
        at += rng.expovariate(1.0)
        kind = rng.random()
        if kind < 0.5:  # a turn of a session: a new one, or the next turn of a live one
            if sessions and rng.random() < 0.7:
                sid = rng.choice(list(sessions))
            else:
                sid = i
                tenant = rng.choices(range(len(prompts)), weights)[0]
                sessions[sid] = (tenant, [(("tenant", tenant), prompts[tenant])])
            tenant, history = sessions[sid]
            segments = [*history, (("turn", sid, i), rng.randint(50, 400))]
            output = rng.randint(40, 200)
            sessions[sid] = (tenant, [*segments, (("answer", sid, i), output)])
            if len(sessions[sid][1]) > 12:  # sessions end after about 6 turns
                del sessions[sid]
        else:
            tenant = rng.choices(range(len(prompts)), weights)[0]
            unique = rng.randint(50, 300) if kind < 0.8 else rng.randint(1000, 4000)  # question | document
            segments = [(("tenant", tenant), prompts[tenant]), (("once", i), unique)]
            output = rng.randint(40, 200)
        ids, sizes = blocks.blocks(segments)
        out.append(SimRequest(i, at, sum(sizes), output, ids, sizes, tenant=f"t{tenant}"))
    return out


def mooncake(n: int, offset: int = 0, path: Path = MOONCAKE_SLICE) -> list[SimRequest]:
    """`n` requests of the Mooncake arXiv slice from line `offset`, ids and arrivals renumbered."""
    reqs = load_trace(path, offset + n)[offset:]
    start = reqs[0].arrival_s
    return [replace(r, id=i, arrival_s=r.arrival_s - start) for i, r in enumerate(reqs)]


def weka(seed: int, n: int, path: Path = WEKA_TRACES) -> list[SimRequest]:
    options = WekaOptions(
        conversations=40, window_s=600.0, max_context=WEKA_MAX_CONTEXT, duration_s=600.0, seed=seed
    )
    reqs = load_weka(path, options)[:n]
    start = reqs[0].arrival_s
    return [replace(r, id=i, arrival_s=r.arrival_s - start) for i, r in enumerate(reqs)]


def build(name: str, seed: int, n: int) -> list[SimRequest]:
    if name == "tenants":
        return tenants(seed, n)
    if name == "mooncake":
        return mooncake(n)
    if name == "weka":
        return weka(seed, n)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def cap_output(requests: Iterable[SimRequest], max_output: int) -> list[SimRequest]:
    """Outputs capped at `max_output` tokens (keeps a run within minutes; the sim gets the same cap)."""
    return [replace(r, output_tokens=min(r.output_tokens, max_output)) for r in requests]


def at_load(
    requests: Sequence[SimRequest], profile: EngineProfile, workers: int, load: float
) -> list[SimRequest]:
    """Arrivals rescaled so the offered load is `load` x the cluster's capacity without cache hits."""
    scaled, _plan = scale_to_load(profile, requests, workers, load)
    return scaled


def offered_rps(requests: Sequence[SimRequest]) -> float:
    """Requests ÷ arrival span (first to last arrival), in modelled seconds. Goodput and throughput are
    counted per second of the run's span, which is at least the arrival span, so neither can exceed
    this: it caps every router's goodput, and so any ratio of two routers' goodput at this load."""
    if len(requests) < 2:
        return 0.0
    arrivals = [r.arrival_s for r in requests]
    span = max(arrivals) - min(arrivals)
    return len(requests) / span if span > 0 else 0.0


def write_mooncake_jsonl(requests: Sequence[SimRequest], path: Path) -> None:
    """The requests as a Mooncake trace (`kvgate bench sim --trace` input; timestamps in ms)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for r in requests:
            record = {
                "timestamp": round(r.arrival_s * 1000, 3),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.block_ids),
            }
            out.write(json.dumps(record) + "\n")


class BlockText:
    """Fixed text per block id: `tokens` x 4 characters, so every block starts on a token boundary of
    the emulated tokenizer (bench/emulator/tokenizer.py) and its tokens are the same in every prompt."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._texts: dict[int, str] = {}

    def block(self, block_id: int, tokens: int) -> str:
        text = self._texts.get(block_id)
        if text is None:
            rng = random.Random(self.seed * 1_000_003 + block_id)
            chars = tokens * 4
            text = f"[{block_id}] {filler_text(rng, tokens)}"[:chars].ljust(chars, ".")
            self._texts[block_id] = text
        return text

    def prompt(self, request: SimRequest) -> str:
        return "".join(self.block(b, t) for b, t in zip(request.block_ids, request.block_tokens, strict=True))


def live_requests(
    requests: Sequence[SimRequest], model: str, time_scale: float, seed: int = 1
) -> list[LiveRequest]:
    """Chat requests sent at arrival x `time_scale` wall seconds; output length pinned by max_tokens."""
    texts = BlockText(seed)
    out = []
    start = requests[0].arrival_s if requests else 0.0
    for r in requests:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": texts.prompt(r)}],
            "max_tokens": r.output_tokens,
            "ignore_eos": True,
        }
        out.append(LiveRequest(send_at_s=(r.arrival_s - start) * time_scale, body=body))
    return out
