"""OpenAI-style JSON error responses, the only error shape kvgate sends to clients.

`{"error": {"message", "type", "code"}}` with the matching HTTP status; mitmproxy's own HTML error
pages stay rare because every expected failure is answered here first (MITMPROXY.md §5).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

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


DRAIN_MAX_BYTES = 256 * 1024 * 1024  # past this an oversized body is cut off (the connection closed)


def install_oversized_body_drain(max_body_bytes: int) -> bool:
    """Answer a request body over mitmproxy's `body_size_limit` with a 413 the client can read.

    mitmproxy writes its 413 and then neither reads nor closes the connection: a client that sends
    its whole body before reading (httpx, the openai SDK: no `Expect: 100-continue`) blocks on a full
    socket until its own timeout (600 s for the SDK). Instead the rest of the body is read and dropped
    (up to DRAIN_MAX_BYTES, as nginx's lingering close), then the 413 goes out with
    `connection: close`. Returns False if this mitmproxy's HTTP layer differs (nothing patched)."""
    from mitmproxy.net.http.http1 import expected_http_body_size
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http import HttpStream
    from mitmproxy.proxy.layers.http._events import RequestData, RequestEndOfMessage
    from mitmproxy.utils import human

    original = getattr(HttpStream, "check_body_size", None)
    if original is None or getattr(original, "kvgate_drain", False):
        return original is not None

    def check_body_size(self: HttpStream, request: bool) -> Any:
        limit = human.parse_size(self.context.options.body_size_limit)
        if not request or limit is None or self.flow.response is not None:
            return (yield from original(self, request))
        try:
            size = len(self.request_body_buf) or expected_http_body_size(self.flow.request, None)
        except ValueError:
            size = None
        if size is None or size <= limit:
            return (yield from original(self, request))
        if size > DRAIN_MAX_BYTES:
            return (yield from original(self, request))
        response = openai_error(
            413, "request_too_large", f"body is over {size} bytes; limit {max_body_bytes}"
        )
        response.headers["connection"] = "close"
        self.flow.response = response
        drained = [len(self.request_body_buf)]
        self.request_body_buf.clear()

        def drain(event: Any) -> Any:
            if isinstance(event, RequestData):
                drained[0] += len(event.data)
                if drained[0] > DRAIN_MAX_BYTES:
                    self.client_state = self.state_errored
                    yield commands.CloseConnection(self.context.client)
            elif isinstance(event, RequestEndOfMessage):
                self.client_state = self.state_done
                yield from self.send_response()

        self.client_state = drain
        return True

    check_body_size.kvgate_drain = True  # type: ignore[attr-defined]
    HttpStream.check_body_size = check_body_size  # type: ignore[method-assign]
    return True


def sse_error_event(message: str) -> bytes:
    """An OpenAI-style error as the last event of a stream (what the openai SDK raises from)."""
    error = {"message": message, "type": "server_error", "param": None, "code": "upstream_stream_broken"}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def install_sse_error_on_broken_stream() -> bool:
    """End a server-sent-event stream whose worker broke off mid-way with an OpenAI-style error event
    and a proper end of the chunked body, instead of cutting the client's connection: SDKs then raise
    a clear error rather than return truncated output. Only for a chunked `text/event-stream`
    response already streaming to the client; every other protocol error is mitmproxy's as before.
    Returns False if this mitmproxy's HTTP layer differs (nothing patched)."""
    from mitmproxy.flow import Error
    from mitmproxy.proxy.layers.http import DropStream, HttpStream, SendHttp
    from mitmproxy.proxy.layers.http._events import ResponseData, ResponseEndOfMessage, ResponseProtocolError
    from mitmproxy.proxy.layers.http._hooks import HttpErrorHook

    original = getattr(HttpStream, "handle_protocol_error", None)
    if original is None or getattr(original, "kvgate_sse", False):
        return original is not None

    def handle_protocol_error(self: HttpStream, event: Any) -> Any:
        response = self.flow.response if self.flow is not None else None
        streaming = (
            isinstance(event, ResponseProtocolError)
            and response is not None
            and self.server_state == self.state_stream_response_body
            and self.client_state != self.state_errored
            and response.headers.get("content-type", "").startswith("text/event-stream")
            and "chunked" in response.headers.get("transfer-encoding", "").lower()
        )
        if not streaming:
            return (yield from original(self, event))
        self.flow.error = Error(f"worker stream broke off: {event.message}")
        yield HttpErrorHook(self.flow)
        message = "the worker stopped mid-stream; the output is incomplete (retry the request)"
        yield SendHttp(ResponseData(self.stream_id, sse_error_event(message)), self.context.client)
        yield SendHttp(ResponseEndOfMessage(self.stream_id), self.context.client)
        self.server_state = self.state_errored
        self.client_state = self.state_done
        self.flow.live = False
        yield DropStream(self.stream_id)

    handle_protocol_error.kvgate_sse = True  # type: ignore[attr-defined]
    HttpStream.handle_protocol_error = handle_protocol_error  # type: ignore[method-assign]
    return True


def install_connect_retry(retarget: Callable[[Any], bool], attempts: int = 2) -> bool:
    """Route a request again when its worker refuses the connection: nothing was sent to that worker
    and nothing to the client yet, so it is safe (vllm-router retries, Dynamo migrates). `retarget`
    (the addon's) points the flow at another worker and returns False when there is none; at most
    `attempts` more connections per request, then mitmproxy's 502 as before. Returns False if this
    mitmproxy's HTTP layer differs (nothing patched)."""
    from mitmproxy.proxy.layers.http import HttpStream

    original = getattr(HttpStream, "make_server_connection", None)
    if original is None or getattr(original, "kvgate_retry", False):
        return original is not None

    def make_server_connection(self: HttpStream) -> Any:
        from mitmproxy.proxy.layers.http import GetHttpConnection

        for _ in range(attempts):
            connection, err = yield GetHttpConnection(
                (self.flow.request.host, self.flow.request.port),
                self.flow.request.scheme == "https",
                self.flow.server_conn.via,
                self.flow.server_conn.transport_protocol,
            )
            if not err:
                self.context.server = self.flow.server_conn = connection
                return True
            if not retarget(self.flow):
                break
        return (yield from original(self))

    make_server_connection.kvgate_retry = True  # type: ignore[attr-defined]
    HttpStream.make_server_connection = make_server_connection  # type: ignore[method-assign]
    return True


def install_retry_before_first_byte(retarget: Callable[[Any], bool], attempts: int = 2) -> bool:
    """Route a request again when its worker accepted the connection but broke it (reset, closed,
    killed) before sending any response byte: nothing reached the client, and the buffered request
    is sent whole to the worker `retarget` (the addon's) points the flow at, at most `attempts` times
    per request. Once a response byte arrived the error is mitmproxy's (or the SSE error event of
    `install_sse_error_on_broken_stream`) as before. Returns False if this mitmproxy's HTTP layer
    differs (nothing patched)."""
    from mitmproxy.proxy.layers.http import HttpStream, SendHttp
    from mitmproxy.proxy.layers.http._events import (
        RequestData,
        RequestEndOfMessage,
        RequestHeaders,
        ResponseProtocolError,
    )

    original = getattr(HttpStream, "handle_protocol_error", None)
    if original is None or getattr(original, "kvgate_first_byte", False):
        return original is not None

    def handle_protocol_error(self: HttpStream, event: Any) -> Any:
        flow = self.flow
        retry = (
            isinstance(event, ResponseProtocolError)
            and flow is not None
            and flow.response is None
            and self.server_state == self.state_wait_for_response_headers
            and self.client_state == self.state_done  # the whole request was read (and buffered)
            and not flow.request.stream
            and not flow.request.trailers
            and flow.metadata.get("kvgate_first_byte_retries", 0) < attempts
        )
        if not retry or not retarget(flow):
            return (yield from original(self, event))
        flow.metadata["kvgate_first_byte_retries"] = flow.metadata.get("kvgate_first_byte_retries", 0) + 1
        if not (yield from self.make_server_connection()):
            return None
        content = flow.request.raw_content
        yield SendHttp(RequestHeaders(self.stream_id, flow.request, not content), self.context.server)
        if content:
            yield SendHttp(RequestData(self.stream_id, content), self.context.server)
        yield SendHttp(RequestEndOfMessage(self.stream_id), self.context.server)
        return None

    handle_protocol_error.kvgate_first_byte = True  # type: ignore[attr-defined]
    HttpStream.handle_protocol_error = handle_protocol_error  # type: ignore[method-assign]
    return True
