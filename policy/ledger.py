"""`InflightLedger`: a router's own account of the work it sent to each worker (R signals), pure data.

    ledger.dispatch(request_id, worker, uncached_tokens, predicted_ttft_s, now_s,   after a decision
                    context_tokens=prompt_tokens)
    ledger.first_token(request_id, now_s)                                           its first token
    ledger.finish(request_id, now_s)                                                it ended (any way)
    WorkerView(id, ..., **ledger.signals(id, now_s))                                before the next one

Per worker it knows the requests in flight, the uncached prefill tokens whose first token has not come
back (`pending_prefill_tokens`), how many requests are still waiting for their first token
(`pending_requests`), how late the most overdue of them is against the TTFT predicted when it was
routed (`overdue_s`), and the prompt tokens of the requests decoding there (first token back, not
finished: `decoding_context_tokens`), the KV each engine step reads for the running batch.
Lateness is the measured part of the wait: a worker whose queue stalls for a reason the TTFT model
does not see (KV cache full of long contexts, preemptions, a slow or throttled GPU, an evicted cache)
shows it in its pending requests at once, long before any of them returns, so no affinity rule can
keep feeding it while the queue grows. The simulator adapter and the gateway
keep one ledger per model; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TypedDict


@dataclass(slots=True)
class _Pending:
    worker: str
    uncached_tokens: int
    due_s: float  # dispatch time + predicted TTFT
    context_tokens: int = 0  # its prompt: the KV its decode reads at every engine step
    first_token: bool = False


class RSignals(TypedDict):
    """The router-side fields of a WorkerView (`InflightLedger.signals`)."""

    inflight: int
    pending_prefill_tokens: int
    overdue_s: float
    decoding_context_tokens: int


class InflightLedger:
    """In-flight requests, pending prefill and lateness per worker (see module docstring)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Pending] = {}
        self._inflight: dict[str, int] = {}
        self._pending_prefill: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._decoding_context: dict[str, int] = {}
        self._due: dict[str, list[tuple[float, str]]] = {}  # worker -> heap of (due, request id), lazy

    def dispatch(
        self,
        request_id: str,
        worker: str,
        uncached_tokens: int,
        predicted_ttft_s: float,
        now_s: float,
        context_tokens: int = 0,
    ) -> None:
        """`request_id` was sent to `worker`, `uncached_tokens` of prefill expected, first token
        predicted `predicted_ttft_s` after `now_s`; `context_tokens` (its prompt) count as decoding
        context from its first token to its end. A repeated id replaces the earlier entry."""
        if request_id in self._requests:
            self.finish(request_id, now_s)
        uncached = max(0, uncached_tokens)
        entry = _Pending(worker, uncached, now_s + max(0.0, predicted_ttft_s), max(0, context_tokens))
        self._requests[request_id] = entry
        self._inflight[worker] = self._inflight.get(worker, 0) + 1
        self._pending_prefill[worker] = self._pending_prefill.get(worker, 0) + uncached
        self._pending[worker] = self._pending.get(worker, 0) + 1
        heapq.heappush(self._due.setdefault(worker, []), (entry.due_s, request_id))

    def first_token(self, request_id: str, now_s: float) -> None:
        """The request's first token came back: its prefill is no longer queued. Unknown ids: no-op."""
        entry = self._requests.get(request_id)
        if entry is None or entry.first_token:
            return
        entry.first_token = True
        w = entry.worker
        self._pending_prefill[w] -= entry.uncached_tokens
        self._pending[w] -= 1
        self._decoding_context[w] = self._decoding_context.get(w, 0) + entry.context_tokens

    def finish(self, request_id: str, now_s: float) -> None:
        """The request ended (finished, failed, aborted), with or without a first token."""
        self.first_token(request_id, now_s)
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self._inflight[entry.worker] -= 1
            self._decoding_context[entry.worker] -= entry.context_tokens

    # -- what the views carry --------------------------------------------------------------------------
    def inflight(self, worker: str) -> int:
        return self._inflight.get(worker, 0)

    def pending_prefill_tokens(self, worker: str) -> int:
        return self._pending_prefill.get(worker, 0)

    def decoding_context_tokens(self, worker: str) -> int:
        return self._decoding_context.get(worker, 0)

    def pending_requests(self, worker: str) -> int:
        return self._pending.get(worker, 0)

    def overdue_s(self, worker: str, now_s: float) -> float:
        """How far past its predicted first token the most overdue pending request on `worker` is (≥ 0)."""
        heap = self._due.get(worker)
        if not heap:
            return 0.0
        requests = self._requests
        while heap:
            due, rid = heap[0]
            entry = requests.get(rid)
            if entry is not None and not entry.first_token and entry.due_s == due and entry.worker == worker:
                return max(0.0, now_s - due)
            heapq.heappop(heap)  # returned, finished or re-dispatched since: drop lazily
        return 0.0

    def signals(self, worker: str, now_s: float) -> RSignals:
        """This ledger's R signals for `worker`, the fields of its WorkerView that the router knows and the
        engine does not: `WorkerView(id=..., <scraped fields>, **ledger.signals(id, now_s))`, as the gateway
        (plugin/routing.py) and the simulator's router (bench/sim/policy_router.py) both build them."""
        return RSignals(
            inflight=self.inflight(worker),
            pending_prefill_tokens=self.pending_prefill_tokens(worker),
            overdue_s=self.overdue_s(worker, now_s),
            decoding_context_tokens=self.decoding_context_tokens(worker),
        )
