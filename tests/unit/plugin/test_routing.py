"""Routing in the gateway: upstream parsing, the in-memory decision, accounting, index feed and writer."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis.asyncio as aioredis

from plugin.config import RoutingSection
from plugin.endpoints import with_usage_requested
from plugin.flow import Route
from plugin.prefix_memo import hash_prompt
from plugin.routing import Router, parse_upstream
from policy.session import SessionBinding, outcome
from policy.types import Band
from store import index_store
from store.registry import WorkerRecord

MODEL = "m"


def worker(wid: str, port: int, **kw: object) -> WorkerRecord:
    return WorkerRecord(id=wid, model=MODEL, url=f"http://127.0.0.1:{port}", lease_expiry_ms=2**62, **kw)  # type: ignore[arg-type]


WORKERS = [worker("w0", 9000, max_concurrency=8), worker("w1", 9001, max_concurrency=8)]
SYSTEM = "You are a helpful assistant. " * 40


def prompt(user: str, system: str = SYSTEM):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    return hash_prompt(body, MODEL, 256)


def route(router: Router, user: str, system: str = SYSTEM, workers=WORKERS):
    return router.route(
        request_id=user,
        model=MODEL,
        prompt=prompt(user, system),
        max_tokens=16,
        band=Band.NORMAL,
        tenant="t",
        workers=workers,
    )


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://10.0.0.1:8000", ("http", "10.0.0.1", 8000)),
        ("https://gpu.example", ("https", "gpu.example", 443)),
        ("127.0.0.1:9", ("http", "127.0.0.1", 9)),
        ("http://[::1]:81/v1", ("http", "::1", 81)),
    ],
)
def test_parse_upstream(url: str, expected: tuple[str, str, int]) -> None:
    up = parse_upstream(url)
    assert (up.scheme, up.host, up.port) == expected


def test_same_prefix_goes_to_the_same_worker_while_it_has_room() -> None:
    router = Router(RoutingSection())
    first = route(router, "question 0")
    assert first is not None
    for i in range(1, 4):
        again = route(router, f"question {i}")
        assert again is not None and again.worker.id == first.worker.id
        router.finished(again)


def test_a_full_worker_is_avoided() -> None:
    router = Router(RoutingSection())
    first = route(router, "q")
    assert first is not None
    busy = first.worker.id
    loaded = [worker(w.id, 9000 + i, max_concurrency=2, running=2 if w.id == busy else 0, waiting=0)
              for i, w in enumerate(WORKERS)]  # fmt: skip
    routing = router.model(MODEL)
    routing.ledger.dispatch("other", busy, 0, 0.1, 0.0)  # two requests in flight on it: at its limit
    assert routing.inflight[busy] == 2
    moved = route(router, "q2", workers=loaded)
    assert moved is not None and moved.worker.id != busy


def test_accounting_returns_to_zero() -> None:
    router = Router(RoutingSection())
    routes = [route(router, f"x{i}", system=f"tenant {i} " * 100) for i in range(6)]
    routing = router.model(MODEL)
    assert sum(routing.inflight.values()) == 6
    assert sum(routing.pending_prefill.values()) > 0
    for r in routes:
        assert r is not None
        router.first_token(r)
        router.first_token(r)  # idempotent
    assert sum(routing.pending_prefill.values()) == 0
    for r in routes:
        router.finished(r)  # type: ignore[arg-type]
    assert sum(routing.inflight.values()) == 0


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "article", "kvgate"])
def test_every_policy_picks_a_given_worker(policy: str) -> None:
    router = Router(RoutingSection(policy=policy))
    first, again = route(router, "u0"), route(router, "u1")  # the same long system prompt, w0 now busier
    assert first is not None and again is not None
    expected = {
        "round_robin": ("w0", "w1"),  # in turn
        "least_loaded": (first.worker.id, "w1" if first.worker.id == "w0" else "w0"),  # the idle one
        "article": (first.worker.id, first.worker.id),  # the prefix holder
        "kvgate": (first.worker.id, first.worker.id),
    }[policy]
    assert (first.worker.id, again.worker.id) == expected, (first.decision, again.decision)


def test_no_workers_no_route() -> None:
    assert route(Router(RoutingSection()), "q", workers=[]) is None


def test_index_ops_from_other_gateways_steer_routing() -> None:
    router = Router(RoutingSection())
    p = prompt("hello")
    router.apply_index_ops(MODEL, [index_store.IndexOp("add", "w1", p.hashes)])
    assert router.best_hit_tokens(MODEL, p) == sum(p.block_tokens)
    chosen = route(router, "hello")
    assert chosen is not None and chosen.worker.id == "w1"
    router.apply_index_ops(MODEL, [index_store.IndexOp("clear", "w1")])
    assert router.best_hit_tokens(MODEL, p) == 0


def test_usage_request_splice() -> None:
    raw = b' {"model": "m", "stream": true}'
    spliced = json.loads(with_usage_requested(raw, json.loads(raw)))
    assert spliced["stream_options"] == {"include_usage": True} and spliced["model"] == "m"
    raw2 = b'{"model": "m", "stream_options": {"include_usage": false, "x": 1}}'
    assert json.loads(with_usage_requested(raw2, json.loads(raw2)))["stream_options"] == {
        "include_usage": True,
        "x": 1,
    }


async def test_index_writer_publishes_routed_prefixes(redis: aioredis.Redis) -> None:
    router = Router(RoutingSection(), redis)
    await router.start()
    try:
        r = route(router, "publish me")
        assert r is not None

        async def written() -> bool:
            snap = await index_store.load_snapshot(redis, MODEL)
            return set(snap.get(r.worker.id, ())) >= set(r.view.prefix_hashes)

        for _ in range(200):
            if await written():
                break
            await asyncio.sleep(0.01)
        assert await written()
    finally:
        await router.close()


def test_the_ledger_counts_lateness_so_a_stalled_session_worker_loses_its_preference() -> None:
    """The gateway feeds policy.ledger from its request lifecycle: a streamed request whose first token
    is overdue makes its worker late (overdue_s), and the hold limit withdraws the session's credit."""
    router = Router(RoutingSection())
    first = route(router, "turn 1")
    assert first is not None
    holder = first.worker.id
    routing = router.model(MODEL)
    views = {v.id: v for v in routing.views(WORKERS, now_s=1e12)}
    assert views[holder].overdue_s > 1e6  # its first token never came: far past its prediction
    router.first_token(first)
    router.finished(first)
    views = {v.id: v for v in routing.views(WORKERS, now_s=1e12)}
    assert views[holder].overdue_s == 0.0 and views[holder].inflight == 0
    session = SessionBinding(holder, 10_000)

    def unrelated(text: str) -> Route:
        found = router.choose(
            request_id=text, model=MODEL, prompt=prompt(text, system=text * 2000), max_tokens=16,
            band=Band.NORMAL, tenant="t", workers=WORKERS, session=session,
        )  # fmt: skip
        assert found is not None
        return found

    # one request of 1,000 uncached tokens queued on the holder, on time: the session keeps the next
    routing.ledger.dispatch("queued", holder, 1000, 1.0, time.monotonic())
    kept = unrelated("other")
    assert kept.worker.id == holder and outcome(kept.view, kept.decision) == "decided"
    # the same request 30 s late (its worker stalls): the hold limit withdraws the preference
    routing.ledger.dispatch("queued", holder, 1000, 0.0, time.monotonic() - 30.0)
    moved = unrelated("other")
    assert moved.worker.id != holder and outcome(moved.view, moved.decision) == "moved"


def test_a_request_that_is_not_streamed_is_never_counted_late() -> None:
    router = Router(RoutingSection())
    placed = router.choose(
        request_id="ns", model=MODEL, prompt=prompt("q"), max_tokens=16, band=Band.NORMAL, tenant="t",
        workers=WORKERS, streamed=False,
    )  # fmt: skip
    assert placed is not None
    router.reserve(placed)
    view = {v.id: v for v in router.model(MODEL).views(WORKERS, now_s=1e12)}[placed.worker.id]
    assert view.overdue_s == 0.0 and view.inflight == 1 and view.pending_prefill_tokens > 0


async def test_record_soon_writes_the_routing_history_once_the_loop_runs_again() -> None:
    """A placed request's history (index entries, stickiness) is written after the request hook's
    synchronous part, so the request goes out first; a decision made after that loop turn sees it."""
    router = Router(RoutingSection())
    chosen = router.choose(
        request_id="a", model=MODEL, prompt=prompt("hi"), max_tokens=16, band=Band.NORMAL, tenant="t",
        workers=WORKERS,
    )  # fmt: skip
    assert chosen is not None
    router.reserve(chosen)
    router.record_soon(chosen)
    state = router.model(MODEL).state
    assert state.index.match(chosen.view.prefix_hashes) == {}
    await asyncio.sleep(0)
    hits = state.index.match(chosen.view.prefix_hashes)
    assert hits == {chosen.worker.id: len(chosen.view.prefix_hashes)}


def test_hit_feedback_unlearns_older_entries_and_reads_a_missing_count_as_zero_once_reported() -> None:
    router = Router(RoutingSection(chunk_chars=256, hit_feedback=True))
    one = [WORKERS[0]]
    old = route(router, "old", system="Tenant A. " * 200, workers=one)
    assert old is not None and len(old.view.prefix_hashes) > 2
    first = route(router, "new", system="Tenant B. " * 200, workers=one)
    assert first is not None and not first.expected_touched_s  # nothing expected yet
    again = route(router, "again", system="Tenant B. " * 200, workers=one)
    assert again is not None and len(again.expected_touched_s) > 2
    index = router.model(MODEL).state.index
    # a worker that never reported a cached count: a usage without one proves nothing
    assert router.hit_feedback(again, 1000, None) == 0
    assert index.match(old.view.prefix_hashes) == {"w0": len(old.view.prefix_hashes)}
    later = route(router, "later", system="Tenant B. " * 200, workers=one)
    assert later is not None
    assert router.hit_feedback(later, 1000, 990) == 0  # the hit it expected: nothing unlearnt
    last = route(router, "last", system="Tenant B. " * 200, workers=one)
    assert last is not None
    # it reported counts before, so no count (vLLM omits prompt_tokens_details at 0) is a reset
    # (every entry used before the missed root's last use: the older prefix, and the tails of the earlier
    # requests on this one, their own user messages)
    tails = {h for r in (first, again) for h in r.view.prefix_hashes} - set(later.view.prefix_hashes)
    assert tails
    assert router.hit_feedback(last, 1000, None) == len(old.view.prefix_hashes) + len(tails)
    assert index.match(old.view.prefix_hashes) == {}
    assert index.match(last.view.prefix_hashes) == {"w0": len(last.view.prefix_hashes)}
