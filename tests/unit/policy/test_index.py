"""policy/index.py: PrefixIndex matching, LRU bounds, removal."""

from __future__ import annotations

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
