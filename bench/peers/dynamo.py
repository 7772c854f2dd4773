"""NVIDIA Dynamo KV router: lowest predicted cost in blocks, temperature 0.

Sources (shared/reference/PEERS.md §1.5): `ai-dynamo/dynamo: lib/llm/src/kv_router/scheduler.rs`
(2025), `lib/kv-router/src/{config.rs,radix_tree.rs,scheduling/selector/default.rs}` (2026).

Cost of worker w for a request of `isl` prompt tokens, in engine blocks of `block_size` tokens:
    overlap  = leading full blocks of the prompt w's engine holds (E: KV events; here the cluster's
               `cached_prefix_blocks` in 512-token trace blocks -> tokens -> full 64-token blocks)
    prefill  = (active_prefill_tokens[w] + isl - overlap * block_size) / block_size
    decode   = active_blocks[w] + blocks of this request not already active on w (shared counted once)
    logit[w] = overlap_score_weight * prefill + decode            -> argmin (temperature 0)
Router-side load (R): on route `active_prefill_tokens[w] += isl - overlap * block_size` and the
request's blocks are referenced on w; the first output token subtracts those prefill tokens; the
finish releases the block references.
This is the 2025 `scheduler.rs` form that PEERS.md gives; the 2026 selector adds a prefill scale, a
host/disk overlap credit and a per-request term (not modelled here).
Defaults: `overlap_score_weight` 1.0, `router_temperature` 0.0, block_size 64 (the Dynamo A/B setup,
ENGINE.md §7), `use_kv_events` true.

Simulation choices: a request's blocks for the decode term are its trace blocks, each weighing
ceil(tokens / 64) engine blocks (a partial last block counts as one block of its own); output
tokens do not grow the router's block count. Ties: Dynamo prefers the worker with the smallest
cached tree, then any; the cluster view does not expose tree sizes, so ties go to a seeded random
choice (they occur mainly on an idle cluster).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.peers.common import cumulative_tokens
from bench.sim.types import ClusterView, NoFeedback, SimRequest

BLOCK_SIZE = 64
OVERLAP_SCORE_WEIGHT = 1.0


@dataclass(slots=True)
class _Active:
    worker: str
    prefill_tokens: int  # still counted in active_prefill_tokens until the first token
    blocks: list[tuple[int, int]]  # (block id, engine blocks) referenced on the worker


class DynamoRouter(NoFeedback):
    """argmin of `overlap_score_weight * prefill_blocks + decode_blocks` over workers."""

    name = "dynamo"

    def __init__(
        self,
        rng: random.Random,
        overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        if overlap_score_weight < 0:
            raise ValueError(f"overlap_score_weight must be >= 0, not {overlap_score_weight}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        self.rng = rng
        self.overlap_score_weight = overlap_score_weight
        self.block_size = block_size
        self.active_prefill_tokens: dict[str, int] = {}
        self.active_blocks: dict[str, int] = {}
        self._refs: dict[str, dict[int, int]] = {}  # worker -> block id -> requests referencing it
        self._active: dict[int, _Active] = {}  # request id -> its accounting
        self.last_logits: dict[str, float] = {}

    def _request_blocks(self, req: SimRequest) -> list[tuple[int, int]]:
        bs = self.block_size
        return [(bid, -(-ntok // bs)) for bid, ntok in zip(req.block_ids, req.block_tokens, strict=True)]

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        bs = self.block_size
        isl = req.input_tokens
        cum = cumulative_tokens(req)
        blocks = self._request_blocks(req)
        logits: dict[str, float] = {}
        new_prefill: dict[str, int] = {}
        for w in cluster.worker_ids:
            cached_tokens = cum[min(cluster.cached_prefix_blocks(w, req), len(req.block_ids))]
            overlap_blocks = cached_tokens // bs
            new_prefill[w] = max(0, isl - overlap_blocks * bs)
            prefill = (self.active_prefill_tokens.get(w, 0) + new_prefill[w]) / bs
            refs = self._refs.get(w, {})
            new_blocks = sum(n for bid, n in blocks if bid not in refs)
            decode = self.active_blocks.get(w, 0) + new_blocks
            logits[w] = self.overlap_score_weight * prefill + decode
        self.last_logits = logits
        best = min(logits.values())
        chosen = self.rng.choice([w for w in cluster.worker_ids if logits[w] == best])
        self._add(req.id, chosen, new_prefill[chosen], blocks)
        return chosen

    def _add(self, req_id: int, worker: str, prefill_tokens: int, blocks: list[tuple[int, int]]) -> None:
        self.active_prefill_tokens[worker] = self.active_prefill_tokens.get(worker, 0) + prefill_tokens
        refs = self._refs.setdefault(worker, {})
        added = 0
        for bid, n in blocks:
            count = refs.get(bid, 0)
            if count == 0:
                added += n
            refs[bid] = count + 1
        self.active_blocks[worker] = self.active_blocks.get(worker, 0) + added
        self._active[req_id] = _Active(worker, prefill_tokens, blocks)

    def on_first_token(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        entry = self._active.get(req.id)
        if entry is not None and entry.prefill_tokens:
            self.active_prefill_tokens[entry.worker] -= entry.prefill_tokens
            entry.prefill_tokens = 0

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        entry = self._active.pop(req.id, None)
        if entry is None:
            return
        self.active_prefill_tokens[entry.worker] -= entry.prefill_tokens
        refs = self._refs[entry.worker]
        released = 0
        for bid, n in entry.blocks:
            count = refs[bid] - 1
            if count == 0:
                del refs[bid]
                released += n
            else:
                refs[bid] = count
        self.active_blocks[entry.worker] -= released


def make_router(seed: int) -> DynamoRouter:
    """Dynamo KV router defaults: overlap weight 1.0, temperature 0, 64-token blocks."""
    return DynamoRouter(rng=random.Random(seed))
