"""The simulated GPU worker: step timing against the ENGINE.md §8 formula, chunked prefill, prefix-cache hits,
pinning, LRU eviction order, preemption, slot limits, aborts, KV events, and fast mode == reference mode."""

from __future__ import annotations

import math
from collections.abc import Hashable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.sim.engine import Engine, EngineEvent, EngineRequest, Finished, FirstToken
from bench.sim.profiles import EngineProfile, load_profile, scaled, step_time_ms

H100_8B = load_profile("h100-llama3.1-8b")


def tiny(**overrides: float) -> EngineProfile:
    """8B timing with a 20-block pool of 16-token blocks, so KV pressure is easy to build by hand."""
    base = {"num_gpu_blocks": 20, "max_num_batched_tokens": 1024, "max_num_seqs": 8}
    return scaled(H100_8B, **{**base, **overrides})


def req(rid: int | str, keys: list[Hashable], output: int, tokens: int = 16) -> EngineRequest:
    return EngineRequest(rid, tuple((k, tokens) for k in keys), output)


def ms(decodes: int = 0, decode_ctx: float = 0, chunks: tuple[tuple[int, int], ...] = ()) -> float:
    """Seconds of one step of the 8B profile; chunks are (new tokens, ctx before)."""
    new = sum(n for n, _ in chunks)
    attn = sum(n * (ctx + n / 2) for n, ctx in chunks)
    return step_time_ms(H100_8B, decodes, decode_ctx, new, attn) / 1000


def run_all(engine: Engine) -> list[EngineEvent]:
    return engine.advance(math.inf)


def invariant_holds(engine: Engine) -> bool:
    """Every engine block is free, cached, or privately held by a running request."""
    cache = engine._cache
    return cache.free + sum(cache.size.values()) + engine._private_total == engine.profile.num_gpu_blocks


# ---- timing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_single_request_follows_the_step_formula(reference: bool) -> None:
    engine = Engine(H100_8B, reference=reference)
    engine.submit(EngineRequest("a", ((1, 512), (2, 488)), 3), now_s=2.0)
    first = 2.0 + ms(chunks=((1000, 0),))
    finish = first + ms(1, 1001) + ms(1, 1002)  # context grows by the token each decode step adds
    assert engine.next_event_s() == pytest.approx(first)
    events = run_all(engine)
    assert events == [FirstToken("a", pytest.approx(first), 0), Finished("a", pytest.approx(finish), 3)]
    assert engine.busy_s == pytest.approx(finish - 2.0)
    assert engine.next_event_s() is None


def test_chunked_prefill_shares_the_token_budget() -> None:
    engine = Engine(tiny(num_gpu_blocks=1000))
    engine.submit(req("a", [("a", i) for i in range(3)], 2, tokens=500), 0.0)
    engine.submit(req("b", [("b", i) for i in range(3)], 2, tokens=500), 0.0)
    step1 = ms(chunks=((1024, 0),))  # a: 1024 of 1500
    step2 = ms(chunks=((476, 1024), (548, 0)))  # a completes, b starts with the rest of the budget
    step3 = ms(1, 1501, chunks=((952, 548),))  # a decodes (1 token), b completes within 1023
    events = engine.advance(step1 + step2 + step3)
    assert events == [
        FirstToken("a", pytest.approx(step1 + step2), 0),
        Finished("a", pytest.approx(step1 + step2 + step3), 2),  # a step's decodes report before its prefills
        FirstToken("b", pytest.approx(step1 + step2 + step3), 0),
    ]


def test_idle_engine_jumps_to_the_arrival_and_a_submit_at_until_joins_the_next_step() -> None:
    engine = Engine(H100_8B)
    assert engine.advance(50.0) == []
    engine.submit(EngineRequest("a", ((1, 100),), 50), 100.0)
    step1 = ms(chunks=((100, 0),))
    events = engine.advance(100.0 + step1)
    assert events == [FirstToken("a", pytest.approx(100.0 + step1), 0)]
    engine.submit(EngineRequest("b", ((2, 100),), 1), 100.0 + step1)
    step2 = ms(1, 101, chunks=((100, 0),))  # b joins a's first decode step
    assert engine.advance(100.0 + step1 + step2) == [
        FirstToken("b", pytest.approx(100.0 + step1 + step2), 0),
        Finished("b", pytest.approx(100.0 + step1 + step2), 1),
    ]


# ---- prefix cache ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "cached_tokens"),
    [
        pytest.param([0, 1, 2], 1024, id="same prompt: all but the recomputed last block"),
        pytest.param([0, 1, 9], 1024, id="same first two blocks"),
        pytest.param([0, 8, 9], 512, id="same first block"),
        pytest.param([7, 1, 2], 0, id="different root: later equal keys do not count"),
    ],
)
def test_second_request_hits_the_cache(keys: list[int], cached_tokens: int) -> None:
    engine = Engine(H100_8B)
    engine.submit(EngineRequest("a", ((0, 512), (1, 512), (2, 100)), 2), 0.0)
    run_all(engine)
    engine.submit(EngineRequest("b", ((keys[0], 512), (keys[1], 512), (keys[2], 100)), 2), 10.0)
    first = run_all(engine)[0]
    assert first == FirstToken(
        "b", pytest.approx(10.0 + ms(chunks=((1124 - cached_tokens, cached_tokens),))), cached_tokens
    )
    assert (engine.prefix_cache_queries, engine.prefix_cache_hits) == (2 * 1124, cached_tokens)


def test_lru_eviction_takes_tails_first_and_a_hit_refreshes_recency() -> None:
    engine = Engine(tiny(), record_kv_events=True)
    for rid, keys in [("a", ["a1", "a2"]), ("b", ["b1", "b2"]), ("e", ["a1", "e2"])]:
        engine.submit(req(rid, keys, 1), engine._clock)
        run_all(engine)
    assert engine.drain_kv_events() == [("stored", ["a1", "a2", "b1", "b2", "e2"])]
    # free queue now: a2, b2, b1, e2, a1 (each request released tail first; e touched a1 last)
    engine.submit(req("big", [f"c{i}" for i in range(16)], 1), engine._clock)  # 16 + 1 decode block > 15 free
    run_all(engine)
    events = engine.drain_kv_events()
    assert events[0] == ("removed", ["a2", "b2"])
    assert engine.cached_prefix_keys(["a1"]) == 1
    assert engine.cached_prefix_blocks([("b1", 16), ("b2", 16)]) == 1
    assert invariant_holds(engine)


def test_pinned_blocks_are_never_evicted_and_a_request_that_does_not_fit_waits() -> None:
    engine = Engine(tiny())
    engine.submit(req("p", [f"p{i}" for i in range(5)], 40), 0.0)
    engine.advance(0.1)  # p decodes, holding 5 cached + up to 3 decode blocks
    engine.submit(req("q", [f"q{i}" for i in range(14)], 1), 0.1)  # needs 15, at most 14 free
    engine.advance(0.2)
    assert (engine.running, engine.waiting) == (1, 1)
    assert engine.cached_prefix_keys([f"p{i}" for i in range(5)]) == 5
    events = run_all(engine)
    assert [type(e).__name__ + e.id for e in events] == ["Finishedp", "FirstTokenq", "Finishedq"]
    assert invariant_holds(engine)


def test_clear_cache_drops_unpinned_blocks_only() -> None:
    engine = Engine(tiny(), record_kv_events=True)
    engine.submit(req("done", ["d1", "d2"], 1), 0.0)
    run_all(engine)
    engine.submit(req("live", ["l1"], 500), 1.0)
    engine.advance(1.1)
    engine.drain_kv_events()
    engine.clear_cache()
    assert engine.drain_kv_events() == [("cleared", ["d2", "d1"])]
    assert engine.cached_prefix_keys(["d1"]) == 0
    assert engine.cached_prefix_keys(["l1"]) == 1
    assert invariant_holds(engine)


# ---- scheduling limits ----------------------------------------------------------------------------------


def test_decode_growth_under_kv_pressure_preempts_the_newest_request() -> None:
    engine = Engine(tiny())
    engine.submit(req("old", ["o1", "o2", "o3", "o4"], 200), 0.0)
    engine.submit(req("new", ["n1", "n2", "n3", "n4"], 200), 0.0)
    # each holds 4 prompt blocks + ceil(generated / 16) decode blocks: the 20-block pool runs out when both
    # have 96 tokens and want a 7th decode block; "new" (admitted last) is preempted and keeps its tokens
    events: list[EngineEvent] = []
    while engine.num_preemptions == 0:
        events += engine.advance(engine._clock + 0.01)
    assert (engine.running, engine.waiting, engine.progress("new", engine._clock)) == (1, 1, 96)
    events += run_all(engine)
    assert engine.num_preemptions == 1
    finished = [e for e in events if isinstance(e, Finished)]
    assert [(e.id, e.output_tokens) for e in finished] == [("old", 200), ("new", 200)]
    assert sorted(e.id for e in events if isinstance(e, FirstToken)) == ["new", "old"]  # once each
    assert invariant_holds(engine) and engine.kv_usage == 0.0


def test_a_lone_request_larger_than_the_pool_still_runs() -> None:
    engine = Engine(tiny(), record_kv_events=True)
    engine.submit(req("huge", [f"h{i}" for i in range(30)], 40), 0.0)  # 30 + 3 blocks > 20 in the pool
    engine.submit(req("next", ["n1"], 1), 0.0)
    events = run_all(engine)
    assert [(type(e).__name__, e.id) for e in events] == [
        ("FirstToken", "huge"),
        ("Finished", "huge"),
        ("FirstToken", "next"),
        ("Finished", "next"),
    ]
    assert invariant_holds(engine) and engine.kv_usage == 0.0


def test_kv_usage_counts_blocks_of_running_requests() -> None:
    engine = Engine(tiny())
    engine.submit(req("a", ["a1", "a2", "a3", "a4"], 40), 0.0)
    engine.advance(0.02)  # prefill done, a few decode steps: 4 prompt blocks + 1 decode block
    assert 1 < engine.progress("a", 0.02) <= 16
    assert (engine.running, engine.kv_usage) == (1, 5 / 20)
    run_all(engine)
    assert (engine.running, engine.kv_usage) == (0, 0.0)


def test_max_num_seqs_caps_running_requests() -> None:
    engine = Engine(tiny(max_num_seqs=2, num_gpu_blocks=1000))
    for rid in "abc":
        engine.submit(req(rid, [rid], 50), 0.0)
    engine.advance(0.05)
    assert (engine.running, engine.waiting) == (2, 1)
    events = run_all(engine)
    assert [e.id for e in events if isinstance(e, Finished)] == ["a", "b", "c"]


def test_abort_frees_blocks_and_emits_nothing() -> None:
    engine = Engine(tiny())
    engine.submit(req("a", ["a1", "a2"], 100), 0.0)
    engine.submit(req("w", ["w1"], 5), 0.0)
    engine.advance(0.05)
    assert engine.kv_usage > 0
    engine.abort("a", 0.05)
    engine.abort("w", 0.05)
    engine.abort("never-seen", 0.05)
    assert (engine.running, engine.waiting, engine.kv_usage) == (0, 0, 0.0)
    assert engine.cached_prefix_keys(["a1", "a2"]) == 2  # computed blocks stay cached, unpinned
    assert engine.next_event_s() is None
    assert run_all(engine) == []
    assert invariant_holds(engine)


def test_progress_is_monotone_and_ends_at_output_tokens() -> None:
    engine = Engine(tiny(num_gpu_blocks=1000))
    engine.submit(req("a", ["a1"], 300), 0.0)
    engine.submit(req("b", ["b1"], 120), 0.5)
    seen = {"a": [], "b": []}
    for i in range(1, 200):
        engine.advance(i * 0.02)
        for rid in seen:
            if i * 0.02 >= 0.5 or rid == "a":
                seen[rid].append(engine.progress(rid, i * 0.02))
    run_all(engine)
    for rid, output in [("a", 300), ("b", 120)]:
        assert seen[rid] == sorted(seen[rid]) and seen[rid][0] < seen[rid][-1] <= output
        assert engine.progress(rid, 10.0) == output
    with pytest.raises(KeyError):
        engine.progress("nobody", 0.0)


def test_next_event_look_ahead_leaves_the_engine_untouched() -> None:
    engine = Engine(tiny(), record_kv_events=True)
    for rid in range(4):  # fill the cache with unpinned blocks
        engine.submit(req(rid, [(rid, j) for j in range(4)], 1), engine._clock)
        run_all(engine)
    engine.drain_kv_events()
    engine.submit(req("x", [("x", j) for j in range(12)], 30), engine._clock)  # its admission evicts
    engine.submit(req("y", [(0, 0), (0, 1), ("y", 2)], 30), engine._clock)  # hits 2 blocks of request 0
    cache = engine._cache
    before = (dict(cache.size), dict(cache.ref), list(cache.lru), cache.free, engine.running, engine.waiting)
    next_s = engine.next_event_s()
    assert (
        dict(cache.size),
        dict(cache.ref),
        list(cache.lru),
        cache.free,
        engine.running,
        engine.waiting,
    ) == before
    assert engine.drain_kv_events() == []
    events = engine.advance(next_s)
    assert events and events[0].at_s == next_s
    assert engine.drain_kv_events()[0][0] == "removed"


def test_bad_requests_are_rejected() -> None:
    engine = Engine(H100_8B)
    with pytest.raises(ValueError):
        engine.submit(EngineRequest("x", (), 1), 0.0)
    with pytest.raises(ValueError):
        engine.submit(EngineRequest("x", ((1, 10),), 0), 0.0)
    engine.submit(EngineRequest("x", ((1, 10),), 1), 0.0)
    with pytest.raises(ValueError):
        engine.submit(EngineRequest("x", ((1, 10),), 1), 0.0)


# ---- fast mode == reference mode ------------------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> tuple[EngineProfile, list[tuple[float, str, EngineRequest | int]]]:
    profile = scaled(
        H100_8B,
        block_size=draw(st.sampled_from([4, 16])),
        num_gpu_blocks=draw(st.integers(12, 150)),
        max_num_batched_tokens=draw(st.integers(16, 512)),
        max_num_seqs=draw(st.integers(1, 12)),
    )
    ops: list[tuple[float, str, EngineRequest | int]] = []
    t = 0.0
    for i in range(draw(st.integers(1, 16))):
        t += draw(st.floats(0.0, 0.2))
        root = draw(st.integers(0, 2))  # few roots: shared prefixes
        depth = draw(st.integers(1, 5))
        branch = draw(st.integers(0, 3))
        blocks = tuple(((root, branch if j else 0, j), draw(st.integers(1, 40))) for j in range(depth))
        ops.append((t, "submit", EngineRequest(i, blocks, draw(st.integers(1, 80)))))
        if draw(st.integers(0, 9)) == 0:
            ops.append((t + draw(st.floats(0.0, 0.3)), "abort", i))
    ops.sort(key=lambda op: op[0])
    return profile, ops


def drive(engine: Engine, ops: list[tuple[float, str, EngineRequest | int]]) -> list[EngineEvent]:
    """Drive like the simulator: deliver engine events up to each operation, using next_event_s()."""
    events: list[EngineEvent] = []
    for t, kind, arg in [*ops, (math.inf, "end", 0)]:
        while (next_s := engine.next_event_s()) is not None and next_s <= t:
            got = engine.advance(next_s)
            assert got and got[0].at_s == pytest.approx(next_s, abs=1e-9)
            events += got
        events += engine.advance(t)
        assert invariant_holds(engine)
        if kind == "submit":
            assert isinstance(arg, EngineRequest)
            engine.submit(arg, t)
        elif kind == "abort":
            engine.abort(arg, t)
    return events


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_fast_mode_gives_the_reference_events(case: tuple[EngineProfile, list]) -> None:  # type: ignore[type-arg]
    profile, ops = case
    fast, reference = (
        Engine(profile, record_kv_events=True),
        Engine(profile, record_kv_events=True, reference=True),
    )
    got, want = drive(fast, ops), drive(reference, ops)
    assert [(type(e), e.id, getattr(e, "cached_tokens", None)) for e in got] == [
        (type(e), e.id, getattr(e, "cached_tokens", None)) for e in want
    ]
    assert all(abs(a.at_s - b.at_s) < 1e-6 for a, b in zip(got, want, strict=True))
    assert (fast.prefix_cache_hits, fast.num_preemptions) == (
        reference.prefix_cache_hits,
        reference.num_preemptions,
    )
    assert fast.drain_kv_events() == reference.drain_kv_events()
    assert fast.busy_s == pytest.approx(reference.busy_s, abs=1e-6)
    assert fast.num_steps == reference.num_steps
    submitted = {arg.id: arg.output_tokens for _, kind, arg in ops if kind == "submit"}  # type: ignore[union-attr]
    aborted = {arg for _, kind, arg in ops if kind == "abort"}
    finished = {e.id: e.output_tokens for e in got if isinstance(e, Finished)}
    assert {rid: out for rid, out in submitted.items() if rid not in aborted}.items() <= finished.items()


@pytest.mark.parametrize("reference", [False, True])
def test_a_restart_drops_the_blocks_running_requests_pin_and_they_start_over(reference: bool) -> None:
    engine = Engine(tiny(), reference=reference, record_kv_events=True)
    engine.submit(req("done", [1, 2], 1), 0.0)
    run_all(engine)
    engine.submit(req("long", [3, 4], 200), 1.0)
    engine.advance(1.5)  # "long" is decoding: blocks 3 and 4 are cached and pinned
    assert engine.cached_prefix_keys([3, 4]) == 2
    engine.clear_cache()  # reset_prefix_cache keeps what a running request pins
    assert engine.cached_prefix_keys([1]) == 0 and engine.cached_prefix_keys([3, 4]) == 2
    engine.restart(1.5)
    assert engine.cached_prefix_keys([3, 4]) == 0
    assert engine.num_preemptions == 1 and invariant_holds(engine)
    assert [e.id for e in run_all(engine) if isinstance(e, Finished)] == ["long"]
    assert invariant_holds(engine) and engine.cached_prefix_keys([3, 4]) == 2
