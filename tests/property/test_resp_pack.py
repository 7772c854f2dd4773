"""store/resp.py: `_bulk`'s one-text path packs exactly what the argument-by-argument path does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from store.resp import _bulk, _bulk_bytes, pack

ARG = st.one_of(
    st.text(max_size=12),  # any characters: non-ASCII ones take the bytes path
    st.text(alphabet="abcdefgh:-_0123456789", max_size=12),  # the admission scripts' ids and names
    st.integers(min_value=-(2**63), max_value=2**63),
    st.booleans(),
    st.floats(allow_nan=False),
    st.binary(max_size=8),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(ARG, max_size=12))
def test_bulk_agrees_with_the_argument_by_argument_packing(args: list[object]) -> None:
    packed = tuple(args)
    assert _bulk(packed) == _bulk_bytes(packed)


def test_a_bytes_argument_is_sent_as_it_is_not_as_its_repr() -> None:
    assert pack(("SET", b"k", 1)) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n"
    assert pack(("SET", "ключ")) == b"*2\r\n$3\r\nSET\r\n$8\r\n" + "ключ".encode() + b"\r\n"
