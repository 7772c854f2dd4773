"""plugin/jsonbody.py: `loads` is `json.loads`: the same values, and the same errors, for bodies of every
encoding json detects, bad UTF-8 and bad JSON included."""

from __future__ import annotations

import json
import random

import pytest

from plugin.jsonbody import loads

VALUE = {"model": "m", "messages": [{"role": "user", "content": 'héllo \U0001f600 \\ " \u0000'}], "n": 1.5}


def outcome(f: object, raw: object) -> tuple[str, object]:
    try:
        return "value", f(raw)  # type: ignore[operator]
    except Exception as e:  # the error's type and text must match too
        return type(e).__name__, str(e)


TEXT = json.dumps(VALUE)
CASES = [
    TEXT.encode(), json.dumps(VALUE, ensure_ascii=False).encode(),
    *(TEXT.encode(codec) for codec in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig")),
    b"{", b"{}", b"{\x00", b"{\x00\x00\x00", b"{}x", b'{"a": 1} ', b"{\xff}", b'{"a": "\xed\xa0\x80"}',
    b" {}", b"[1]", b"", b"{" * 2000 + b"}" * 2000, "{}", '{"a": 1}', b'{"a": NaN}',
]  # fmt: skip


@pytest.mark.parametrize("raw", CASES)
def test_loads_is_json_loads(raw: bytes | str) -> None:
    assert outcome(loads, raw) == outcome(json.loads, raw)


def test_loads_is_json_loads_on_random_bytes_after_a_brace() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        raw = b"{" + bytes(rng.randrange(256) for _ in range(rng.randrange(6)))
        assert outcome(loads, raw) == outcome(json.loads, raw)
