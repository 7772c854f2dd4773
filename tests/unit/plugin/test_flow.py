"""plugin/flow.py helpers: `put_headers` ends where `headers[name] = value` per header would; `header`
and `body_of` read what mitmproxy's `headers.get` and `content` read."""

from __future__ import annotations

import gzip
from collections.abc import Callable

import pytest
from mitmproxy import http
from mitmproxy.test import tutils

from plugin.flow import body_of, header, put_headers


@pytest.mark.parametrize(
    ("before", "pairs", "after"),
    [
        pytest.param([], [("x-a", "1")], {"x-a": "1"}, id="absent: added"),
        pytest.param(
            [("X-A", "old"), ("other", "k")],
            [("x-a", "1")],
            {"x-a": "1", "other": "k"},
            id="present in another case: replaced",
        ),
        pytest.param(
            [("x-a", "o1"), ("x-a", "o2")],
            [("x-a", "1"), ("x-b", "2")],
            {"x-a": "1", "x-b": "2"},
            id="repeated: one left",
        ),
        pytest.param([], [("x-a", "ü")], {"x-a": "ü"}, id="non-ASCII value"),
    ],
)
def test_put_headers_as_setting_each(
    before: list[tuple[str, str]], pairs: list[tuple[str, str]], after: dict[str, str]
) -> None:
    mine = http.Headers([(k.encode(), v.encode()) for k, v in before])
    reference = http.Headers([(k.encode(), v.encode()) for k, v in before])
    put_headers(mine, pairs)
    for name, value in pairs:
        reference[name] = value
    assert {k.lower(): mine.get_all(k) for k in mine} == {k.lower(): reference.get_all(k) for k in reference}
    assert {k.lower(): mine[k] for k in mine} == after


@pytest.mark.parametrize(
    "fields",
    [
        (),
        ((b"Content-Type", b"text/event-stream"),),
        ((b"content-type", b"application/json"), (b"CONTENT-TYPE", b"text/plain; charset=\xc3\xa9")),
        ((b"Content-Encoding", b"gzip"), (b"content-type", b"application/json")),
        ((b"content-encoding", b""),),
        ((b"x-other", b"1"), (b"Content-Encoding", b"identity")),
    ],
)
@pytest.mark.parametrize("make", [tutils.treq, tutils.tresp])
def test_header_and_body_of_read_what_mitmproxy_reads(
    fields: tuple[tuple[bytes, bytes], ...], make: Callable[..., http.Message]
) -> None:
    """`header` and `body_of` (one pass over the fields) against mitmproxy's `headers.get` and
    `content`, on bodies with and without a Content-Encoding (a gzip body decoded), folded headers."""
    message = make()
    message.headers.fields = fields
    raw = b'{"a": 1}'
    message.raw_content = gzip.compress(raw) if (b"Content-Encoding", b"gzip") in fields else raw
    for name in ("content-type", "content-encoding", "x-other", "absent"):
        assert header(message, name.encode()) == message.headers.get(name)
    assert body_of(message) == message.content == raw
    message.raw_content = None
    assert body_of(message) is message.content is None
