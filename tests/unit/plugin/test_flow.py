"""plugin/flow.py helpers: `put_headers` ends where `headers[name] = value` per header would."""

from __future__ import annotations

import pytest
from mitmproxy import http

from plugin.flow import put_headers


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
