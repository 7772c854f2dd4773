"""Error responses are OpenAI-style JSON with the right status, type and Retry-After."""

from __future__ import annotations

import json

import pytest

from plugin.errors import GatewayError, openai_error


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (503, "service_unavailable"),
        (502, "upstream_error"),
    ],
)
def test_error_shape(status: int, error_type: str) -> None:
    response = openai_error(status, "some_code", "what happened")
    body = json.loads(response.content or b"")
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert body["error"]["type"] == error_type
    assert (body["error"]["message"], body["error"]["code"]) == ("what happened", "some_code")
    assert "retry-after" not in response.headers


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert openai_error(429, "queue_full", "x", retry_after_s=0.2).headers["retry-after"] == "1"
    assert openai_error(429, "queue_full", "x", retry_after_s=2.1).headers["retry-after"] == "3"


def test_gateway_error_carries_extra_fields() -> None:
    error = GatewayError(429, "queue_full", "full", retry_after_s=4, extra={"estimated_wait_s": 3.5})
    body = json.loads(error.to_response().content or b"")
    assert body["error"]["estimated_wait_s"] == 3.5


def test_mitmproxy_protocol_errors_become_json() -> None:
    from mitmproxy.proxy.layers.http import _http1

    from plugin.errors import install_json_protocol_errors, json_protocol_error

    raw = json_protocol_error(502, "Connection refused")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 502") and b"content-type: application/json" in head
    assert json.loads(body)["error"] == {"message": "Connection refused", "type": "upstream_error",
                                         "param": None, "code": "upstream_error"}  # fmt: skip
    assert install_json_protocol_errors()
    assert _http1.make_error_response is json_protocol_error
