"""plugin/parse.py: the small-body depth walk gives too_deep's answer, or leaves it to the full check."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.parse import too_deep, too_deep_small

JSON = st.recursive(
    st.none() | st.integers(min_value=-5, max_value=5) | st.text(max_size=4),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=3), children, max_size=4)
    ),
    max_leaves=80,
)


def nested(depth: int, inner: object) -> object:
    for i in range(depth):
        inner = [inner] if i % 2 else {"k": inner}
    return inner


@settings(max_examples=400, deadline=None)
@given(JSON, st.integers(min_value=1, max_value=6), st.integers(min_value=0, max_value=80))
def test_small_walk_agrees_with_too_deep(value: object, limit: int, budget: int) -> None:
    small = too_deep_small(value, limit, budget)
    assert small is None or small == too_deep(value, limit)


def test_small_walk_decides_small_bodies_and_defers_large_ones() -> None:
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": "x" * 10_000}, {"role": "user", "content": "q"}],
    }
    assert too_deep_small(chat) is False
    assert too_deep_small(nested(65, "x")) is True  # 65 levels: one value each
    assert too_deep_small(nested(64, "x")) is False
    assert too_deep_small({"prompt": list(range(1000))}) is None  # left to the bracket count
