"""Preble E2's per-GPU load cost, kept incrementally for bench/peers/preble.py.

cost(g) = Σ over windowed nodes n with g in alloc(n) of
          miss_rate(n) · count(n) · T_prefill(n.num_tokens, context before n) / |alloc(n)|
          + ref(n, g) · output_len(n) · median_tpot(g)
where ref(n, g) = running requests on g whose prompt passes through n (a request counts at every
windowed node on its path, as upstream), output_len = mean finished output of n's requests, else the
latest request's max_tokens (= its output_tokens here). TPOT per GPU: median of the last 200, initially
0.15 s. Each node's stats remember their contribution to the sums, so `refresh` replaces it and `cost`
never scans the window or the tree. `cost(g, min2=True)` counts only nodes with >= 2 windowed requests
(what rebalancing weighs).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

from bench.peers.preble_tree import Stats

TPOT_INIT_S = 0.15
TPOT_HISTORY = 200


class GpuCosts:
    """Per-GPU sums of the windowed prefill and the running decode terms, and the TPOT history."""

    def __init__(self, prefill_time: Callable[[int, int], float]) -> None:
        self.prefill_time = prefill_time  # (new tokens, cached context tokens) -> seconds
        self._pref: dict[str, float] = {}
        self._pref2: dict[str, float] = {}
        self._dec: dict[str, float] = {}
        self.gpu_nodes: dict[str, set[Stats]] = {}  # gpu -> stats contributing to its prefill sum
        self._tpot: dict[str, deque[float]] = {}
        self._tpot_median: dict[str, float] = {}

    def refresh(self, s: Stats) -> None:
        """Replace the node's contribution to the per-GPU cost sums."""
        for g, v in s.c_prefill.items():
            self._pref[g] -= v
            if s.c_min2:
                self._pref2[g] -= v
            self.gpu_nodes[g].discard(s)
        for g, v in s.c_decode.items():
            self._dec[g] -= v
        s.c_prefill, s.c_decode, s.c_min2 = {}, {}, False
        node = s.node
        if s.in_window and node.alloc and s.prompt_tokens:
            miss = 1.0 - s.hit_tokens / s.prompt_tokens
            before = node.context_length - node.num_tokens
            if s.t_key != (node.num_tokens, before):
                s.t_key, s.t_prefill = (node.num_tokens, before), self.prefill_time(node.num_tokens, before)
            v = miss * s.count * s.t_prefill / len(node.alloc)
            s.c_min2 = s.count >= 2
            for g in node.alloc:
                s.c_prefill[g] = v
                self._pref[g] = self._pref.get(g, 0.0) + v
                if s.c_min2:
                    self._pref2[g] = self._pref2.get(g, 0.0) + v
                self.gpu_nodes.setdefault(g, set()).add(s)
            out = s.out_len()
            for g in node.alloc:
                a = node.ref.get(g, 0)
                if a:
                    s.c_decode[g] = a * out
                    self._dec[g] = self._dec.get(g, 0.0) + a * out

    def tpot(self, gpu: str) -> float:
        """Median time per output token of the GPU's recent finished requests."""
        return self._tpot_median.get(gpu, TPOT_INIT_S)

    def record_tpot(self, gpu: str, tpot: float) -> None:
        hist = self._tpot.setdefault(gpu, deque([TPOT_INIT_S], maxlen=TPOT_HISTORY))
        hist.append(tpot)
        self._tpot_median[gpu] = statistics.median(hist)

    def cost(self, gpu: str, min2: bool = False) -> float:
        pref = self._pref2 if min2 else self._pref
        return max(0.0, pref.get(gpu, 0.0)) + self.tpot(gpu) * max(0.0, self._dec.get(gpu, 0.0))
