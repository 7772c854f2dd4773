"""The gateway's intake as one pure function of raw input, for property tests and fuzzing.

`intake_outcome(path, headers, body)` runs what intake runs before any I/O (endpoint table, header
decoding, caller, correlation id, body validation) and returns the status the client would get
(200 = accepted for admission). The rule both tests/property/test_intake_fuzz.py and
`kvgate bench fuzz` check: every input ends in a clear answer (a GatewayError with a 4xx status),
never an exception, and an accepted request is one the gateway may forward.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from mitmproxy import http

from plugin.auth import Auth
from plugin.config import GatewayConfig
from plugin.endpoints import route_for
from plugin.errors import GatewayError
from plugin.intake import HeaderMap, correlation_id
from plugin.parse import parse_completion

CONFIG = GatewayConfig()
AUTH = Auth(CONFIG)


def intake_outcome(path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> int:
    """The status intake answers (200: accepted); raises only on a bug."""
    try:
        endpoint = route_for("POST", path)
        if isinstance(endpoint, str):
            return 200  # a local endpoint (GET only): 405 for POST is raised above
        header_map = HeaderMap.of(http.Headers(list(headers)))
        correlation_id(header_map.get("x-request-id"))
        AUTH.caller(header_map)
        parsed = parse_completion(endpoint, body, CONFIG.limits)
        try:
            parsed.endpoint.prefix_text(parsed.body)
        except ValueError:  # intake answers 400 for a shape it cannot hash
            return 400
        ask_usage = parsed.endpoint.request_usage
        if ask_usage is not None:  # what dispatch would forward must still be the same JSON object
            forwarded = json.loads(ask_usage(body, parsed.body))
            if not isinstance(forwarded, dict) or forwarded.get("model") != parsed.model:
                raise AssertionError("the rewritten body is not the request the client sent")
    except GatewayError as e:
        if not 400 <= e.status < 500:
            raise AssertionError(f"intake answered {e.status} for client input: {e.message}") from e
        return e.status
    return 200
