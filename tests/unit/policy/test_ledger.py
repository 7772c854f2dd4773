"""policy/ledger.py: the router's account of in-flight work and of how late each worker's queue runs."""

from __future__ import annotations

from policy.ledger import InflightLedger
from policy.types import WorkerView


def test_dispatch_first_token_finish_bring_every_counter_back() -> None:
    ledger = InflightLedger()
    ledger.dispatch("a", "w0", 1000, 0.5, now_s=10.0)
    ledger.dispatch("b", "w0", 500, 2.0, now_s=10.0)
    assert (ledger.inflight("w0"), ledger.pending_prefill_tokens("w0"), ledger.pending_requests("w0")) == (
        2,
        1500,
        2,
    )
    assert ledger.overdue_s("w0", 10.4) == 0.0
    assert ledger.overdue_s("w0", 13.0) == 2.5  # a was due at 10.5
    ledger.first_token("a", 13.0)
    assert ledger.overdue_s("w0", 13.0) == 1.0  # b, due at 12.0, is the most overdue now
    assert (ledger.inflight("w0"), ledger.pending_prefill_tokens("w0"), ledger.pending_requests("w0")) == (
        2,
        500,
        1,
    )
    ledger.finish("b", 14.0)  # ended without a first token (failed, aborted)
    ledger.finish("a", 15.0)
    ledger.finish("a", 15.0)  # twice: no-op
    assert (ledger.inflight("w0"), ledger.pending_prefill_tokens("w0"), ledger.pending_requests("w0")) == (
        0,
        0,
        0,
    )
    assert ledger.overdue_s("w0", 100.0) == 0.0


def test_signals_are_the_router_side_fields_of_a_view() -> None:
    ledger = InflightLedger()
    ledger.dispatch("a", "w1", 800, 1.0, now_s=0.0)
    idle = WorkerView("w0", waiting=3, kv_usage=0.5, **ledger.signals("w0", 4.0))
    assert idle == WorkerView("w0", waiting=3, kv_usage=0.5)
    busy = WorkerView("w1", running=2, **ledger.signals("w1", 4.0))
    assert (busy.inflight, busy.pending_prefill_tokens, busy.overdue_s, busy.running) == (1, 800, 3.0, 2)


def test_a_repeated_id_replaces_its_earlier_dispatch() -> None:
    ledger = InflightLedger()
    ledger.dispatch("a", "w0", 100, 0.0, now_s=0.0)
    ledger.dispatch("a", "w1", 200, 0.0, now_s=1.0)  # re-routed after the first worker turned it down
    assert (ledger.inflight("w0"), ledger.inflight("w1"), ledger.pending_prefill_tokens("w1")) == (0, 1, 200)
    assert ledger.overdue_s("w0", 5.0) == 0.0 and ledger.overdue_s("w1", 5.0) == 4.0


def test_decoding_context_counts_a_request_from_its_first_token_to_its_end() -> None:
    # the KV the running batch reads at every step: prompts of requests that decode (first token back)
    ledger = InflightLedger()
    ledger.dispatch("a", "w0", 1000, 0.5, 0.0, context_tokens=7000)
    ledger.dispatch("b", "w0", 500, 0.5, 0.0, context_tokens=3000)
    assert ledger.decoding_context_tokens("w0") == 0  # both still wait for their prefill
    ledger.first_token("a", 0.4)
    assert ledger.decoding_context_tokens("w0") == 7000
    assert ledger.signals("w0", 0.4)["decoding_context_tokens"] == 7000
    ledger.finish("b", 0.6)  # ended without a first token: it never decoded
    assert ledger.decoding_context_tokens("w0") == 7000
    ledger.finish("a", 1.0)
    assert ledger.decoding_context_tokens("w0") == 0
