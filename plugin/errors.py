"""OpenAI-style JSON error responses, the only error shape kvgate sends to clients.

`{"error": {"message", "type", "code"}}` with the matching HTTP status; mitmproxy's own HTML error
pages stay rare because every expected failure is answered here first (MITMPROXY.md §5).
"""

from __future__ import annotations

import json
import math

from mitmproxy import http

# status -> OpenAI error type
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class GatewayError(Exception):
    """A request kvgate answers itself with an error; raised by the pure checks, turned into a response."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 retry_after_s: float | None = None, extra: dict[str, object] | None = None,
                 ) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.extra = extra or {}

    def to_response(self) -> http.Response:
        return openai_error(
            self.status,
            self.code,
            self.message,
            param=self.param,
            retry_after_s=self.retry_after_s,
            extra=self.extra,
        )


def error_body(status: int, code: str, message: str, *, param: str | None = None, **extra: object) -> bytes:
    error: dict[str, object] = {
        "message": message,
        "type": ERROR_TYPES.get(status, "server_error"),
        "param": param,
        "code": code,
    }
    error.update(extra)
    return json.dumps({"error": error}).encode()


def openai_error(
    status: int,
    code: str,
    message: str,
    *,
    param: str | None = None,
    retry_after_s: float | None = None,
    extra: dict[str, object] | None = None,
) -> http.Response:
    """A JSON error response; 429/503 carry `Retry-After` (whole seconds, at least 1) when given."""
    headers = {"content-type": "application/json"}
    if retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(retry_after_s)))
    return http.Response.make(
        status, error_body(status, code, message, param=param, **(extra or {})), headers
    )


def json_response(status: int, payload: object) -> http.Response:
    return http.Response.make(status, json.dumps(payload).encode(), {"content-type": "application/json"})


PROTOCOL_ERROR_CODES = {400: "bad_request", 408: "timeout", 413: "request_too_large", 502: "upstream_error",
                        504: "upstream_timeout"}  # fmt: skip


def json_protocol_error(status_code: int, message: str = "") -> bytes:
    """A drop-in for mitmproxy's `_http1.make_error_response`: the same status, as OpenAI-style JSON."""
    from mitmproxy import version
    from mitmproxy.net.http import http1

    code = PROTOCOL_ERROR_CODES.get(status_code, "proxy_error")
    response = http.Response.make(
        status_code,
        error_body(status_code, code, message or f"HTTP {status_code}"),
        {"server": version.MITMPROXY, "connection": "close", "content-type": "application/json"},
    )
    return bytes(http1.assemble_response(response))


def install_json_protocol_errors() -> bool:
    """Make mitmproxy's own HTTP/1 error responses (worker unreachable 502, body over
    body_size_limit 413, malformed HTTP 400) JSON instead of its HTML page. Hooks cannot restyle
    them (MITMPROXY.md §5), so this replaces the module function they are built with; returns False
    if this mitmproxy version has no such function (the HTML pages stay)."""
    from mitmproxy.proxy.layers.http import _http1

    if not callable(getattr(_http1, "make_error_response", None)):
        return False
    _http1.make_error_response = json_protocol_error
    return True
