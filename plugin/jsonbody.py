"""`json.loads` of a request or response body, with fewer Python-level steps in the common case."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

# the scanner `json.loads(text)` runs when given no options (an instance attribute, not in the stubs)
_scan: Callable[[str, int], tuple[Any, int]] = vars(json.JSONDecoder())["scan_once"]
_space = re.compile(r"[ \t\n\r]*", re.VERBOSE | re.MULTILINE | re.DOTALL).match  # json.decoder.WHITESPACE


def loads(raw: bytes | str) -> Any:
    """`json.loads(raw)`: the same value, the same errors. A body that starts with "{" then a byte other
    than NUL is UTF-8 by json's own detection (`json.detect_encoding`): it is decoded as `json.loads`
    decodes it and scanned as `JSONDecoder.decode` and `raw_decode` scan it, without their four Python
    calls (bench.hook_cost)."""
    if not (isinstance(raw, bytes) and raw[:1] == b"{" and raw[1:2] != b"\x00"):
        return json.loads(raw)
    text = raw.decode("utf-8", "surrogatepass")
    try:
        value, end = _scan(text, 0)  # (no leading whitespace: it starts with "{")
    except StopIteration as e:
        raise json.JSONDecodeError("Expecting value", text, e.value) from None
    end = _space(text, end).end()  # type: ignore[union-attr]
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value
