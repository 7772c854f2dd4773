"""policy/index.py: PrefixIndex matching, LRU bounds, removal."""

from __future__ import annotations

import random

import pytest

from policy.index import PrefixIndex


def index_with(entries: dict[str, list[int]], capacity: int = 100) -> PrefixIndex:
    idx = PrefixIndex(capacity)
    for worker, hashes in entries.items():
        idx.insert(worker, hashes, 0.0)
    return idx


@pytest.mark.parametrize(
    ("entries", "query", "expected"),
    [
        pytest.param({}, [1, 2], {}, id="empty index"),
        pytest.param({"a": [1, 2, 3]}, [1, 2, 3, 4], {"a": 3}, id="leading blocks held"),
        pytest.param(
            {"a": [1, 2], "b": [1, 2, 3]}, [1, 2, 3], {"a": 2, "b": 3}, id="each worker stops at its miss"
        ),
        pytest.param({"a": [1, 3]}, [1, 2, 3], {"a": 1}, id="not consecutive: stops at first miss"),
        pytest.param({"a": [2, 3]}, [1, 2, 3], {}, id="block 0 missing: nothing"),
        pytest.param({"a": [1], "b": [1, 2]}, [1, 2], {"a": 1, "b": 2}, id="shared root"),
    ],
)
def test_match(entries: dict[str, list[int]], query: list[int], expected: dict[str, int]) -> None:
    assert index_with(entries).match(query) == expected


def test_lru_evicts_tails_first_and_bounds_size() -> None:
    idx = PrefixIndex(3)
    idx.insert("a", [1, 2, 3], 0.0)
    idx.insert("a", [1, 4], 1.0)  # touch 1, add 4: the least recent is the old tail 3
    assert idx.size("a") == 3
    assert idx.match([1, 2, 3]) == {"a": 2}
    assert idx.holders(3) == frozenset()


def test_per_worker_capacity() -> None:
    idx = PrefixIndex(10)
    idx.set_capacity("small", 2)
    idx.insert("small", [1, 2, 3, 4], 0.0)
    idx.insert("big", [1, 2, 3, 4], 0.0)
    assert (idx.size("small"), idx.size("big")) == (2, 4)
    assert idx.match([1, 2, 3, 4]) == {"small": 2, "big": 4}
    idx.set_capacity("big", 1)
    assert idx.size("big") == 1 and idx.total_entries() == 3


def test_remove_and_clear() -> None:
    idx = index_with({"a": [1, 2, 3], "b": [1, 2]})
    idx.remove("a", [2, 99])
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 2}
    assert idx.holders(2) == frozenset({"b"})
    idx.clear("b")
    assert idx.match([1, 2]) == {"a": 1}
    assert idx.workers() == ["a"]
    idx.clear("nobody")
    idx.remove("nobody", [1])


def test_bad_capacity_raises() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(0)
    with pytest.raises(ValueError):
        PrefixIndex(1).set_capacity("a", 0)


def test_hybrid_entries_speculative_until_confirmed_then_exact() -> None:
    """An exact worker's routed blocks are speculative for the TTL; its BlockStored confirms them."""
    idx = PrefixIndex(100, speculative_ttl_s=2.0)
    idx.set_kind("e", "exact")
    idx.insert_routed("e", [1, 2, 3], now_s=0.0)
    idx.insert_routed("a", [1, 2], now_s=0.0)  # approximate worker: plain routing history
    assert idx.match([1, 2, 3]) == {"e": 3, "a": 2}
    assert idx.match_kind("e", [1, 2, 3], 3) == "speculative"
    assert idx.match_kind("a", [1, 2, 3], 2) == "approximate"
    assert idx.match_kind("a", [1, 2, 3], 0) == "none"
    idx.insert("e", [1, 2], now_s=1.0)  # the engine stored blocks 1, 2 (not 3)
    assert idx.match_kind("e", [1, 2, 3], 2) == "exact"
    assert idx.match_kind("e", [1, 2, 3], 3) == "speculative"
    assert idx.expire(1.9) == 0
    assert idx.expire(2.0) == 1  # block 3 was never confirmed
    assert idx.match([1, 2, 3]) == {"e": 2, "a": 2}
    assert idx.speculative_size("e") == 0 and idx.size("a") == 2  # approximate entries do not expire


def test_re_routing_refreshes_a_speculative_entry_and_removal_wins() -> None:
    idx = PrefixIndex(100, speculative_ttl_s=2.0)
    idx.set_kind("e", "exact")
    idx.insert_routed("e", [1, 2], now_s=0.0)
    idx.insert_routed("e", [1, 2], now_s=1.5)  # routed again: lives until 3.5
    assert idx.expire(2.5) == 0 and idx.match([1, 2]) == {"e": 2}
    idx.remove("e", [2])  # BlockRemoved of an unconfirmed block
    assert idx.speculative_size("e") == 1 and idx.expire(3.5) == 1 and idx.match([1]) == {}
    idx.insert("e", [7], now_s=4.0)
    idx.insert_routed("e", [7], now_s=4.0)  # held exactly: only touched, stays exact
    assert idx.speculative_size("e") == 0 and idx.expire(100.0) == 0 and idx.match([7]) == {"e": 1}


def test_eviction_and_clear_drop_speculative_marks_and_a_kind_back_to_approximate() -> None:
    idx = PrefixIndex(2, speculative_ttl_s=2.0)
    idx.set_kind("e", "exact")
    # capacity 2, and as many speculative entries again: block 5 (the tail) is evicted
    idx.insert_routed("e", [1, 2, 3, 4, 5], now_s=0.0)
    assert idx.size("e") == 4 and idx.speculative_size("e") == 4 and idx.match([1, 2, 3, 4, 5]) == {"e": 4}
    idx.clear("e")
    assert idx.speculative_size("e") == 0 and idx.expire(10.0) == 0
    idx.insert_routed("e", [5], now_s=0.0)
    idx.set_kind("e", "approximate")  # its agent stopped publishing: the entry is plain history
    assert (
        idx.expire(10.0) == 0 and idx.match([5]) == {"e": 1} and idx.match_kind("e", [5], 1) == "approximate"
    )
    with pytest.raises(ValueError, match="index kind"):
        idx.set_kind("e", "oracle")
    with pytest.raises(ValueError, match="speculative_ttl_s"):
        PrefixIndex(1, speculative_ttl_s=0)


def test_speculative_entries_do_not_evict_what_an_exact_worker_holds() -> None:
    """An exact worker at capacity: routing a new prompt there adds speculative entries before the
    engine's BlockRemoved for its victims arrives. They must not push out confirmed entries: the mirror
    would evict by its own order (here the head of a chain stored in two batches, so the whole prefix
    stops matching) where the engine evicts by its own (the tail), and a block the engine keeps is not
    stored again, so the entry would not come back. The engine's BlockRemoved is the eviction."""
    idx = PrefixIndex(10, speculative_ttl_s=3.0)
    idx.set_kind("e", "exact")
    a, b, c = [1, 2, 3, 4, 5, 6], [11, 12, 13, 14], [21, 22, 23]
    idx.insert("e", a[:3], now_s=0.0)  # BlockStored of a chunked prefill: two batches, head first
    idx.insert("e", a[3:], now_s=0.1)
    idx.insert("e", b, now_s=0.2)  # 10 blocks: the engine's KV is full
    idx.insert_routed("e", c, now_s=1.0)  # a new prompt routed to it
    assert idx.match(a) == {"e": 6} and idx.match(b) == {"e": 4} and idx.match(c) == {"e": 3}
    assert idx.match_kind("e", c, 3) == "speculative"
    idx.remove("e", a[3:])  # the engine evicted a's tail ...
    idx.insert("e", c, now_s=1.2)  # ... to store c
    assert idx.match(a) == {"e": 3} and idx.match(c) == {"e": 3} and idx.size("e") == 10
    assert idx.match_kind("e", c, 3) == "exact" and idx.speculative_size("e") == 0


@pytest.mark.parametrize("seed", range(20))
def test_match_and_match_kind_equal_their_definition(seed: int) -> None:
    """`match_kind` is a set test over the matched blocks (`match` the walk): both equal the definition on
    random chains, replicas, removals and speculative entries (worker -> leading blocks it holds; any
    matched block unconfirmed)."""
    rng = random.Random(seed)
    idx = PrefixIndex(rng.choice([8, 40, 1000]))
    workers = ["a", "b", "c"]
    for w in workers[: rng.randint(1, 3)]:
        idx.set_kind(w, "exact")
    chains = [[rng.getrandbits(62) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    for step in range(60):
        chain, w = rng.choice(chains), rng.choice(workers)
        head = chain[: rng.randint(1, len(chain))]
        action = rng.random()
        if action < 0.45:
            idx.insert(w, head, float(step))
        elif action < 0.75:
            idx.insert_routed(w, head, float(step))
        elif action < 0.95:
            idx.remove(w, rng.sample(chain, min(len(chain), rng.randint(1, 3))))
        else:
            idx.clear(w)
        idx.expire(step - 3.0)
        query = [*rng.choice(chains), rng.getrandbits(62)]
        expected = {}
        for v in workers:
            n = 0
            while n < len(query) and v in idx.holders(query[n]):
                n += 1
            if n:
                expected[v] = n
        assert idx.match(query) == expected
        for v, n in expected.items():
            unconfirmed = idx._speculative.get(v, {})
            kind = "approximate" if idx.kind(v) != "exact" else "exact"
            if kind == "exact" and any(h in unconfirmed for h in query[:n]):
                kind = "speculative"
            assert idx.match_kind(v, query, n) == kind
