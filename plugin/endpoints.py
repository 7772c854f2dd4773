"""The endpoint table: one entry per OpenAI endpoint kvgate admits and routes.

An entry says everything the request path needs to know about an endpoint: its path; how its own
body fields are validated (the fields every completion shares are parse.py's) and how its prefix is
rendered for approximate hashing (both by policy/request.py); how it is tokenized in exact mode (the
worker's /tokenize body, plugin/tokenize.py); and how usage is requested from a stream and metered. Adding
`/v1/responses` or `/v1/embeddings` is one entry here and its tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from plugin.config import LimitsSection
from plugin.errors import GatewayError
from plugin.streaming import Usage, meter_json_body
from plugin.tokenize import TokenizeRequest, chat_tokenize_request, completion_tokenize_request
from policy.request import InvalidRequest, chat_text, check_chat, check_completion, completion_text

LocalEndpoint = Literal["models", "readyz"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One OpenAI endpoint that is admitted, routed and metered."""

    name: str  # decision records and metric labels use it
    path: str
    check_body: Callable[[dict[str, Any], LimitsSection], None]  # its own fields; GatewayError 400/413
    prefix_text: Callable[[Mapping[str, object]], str]  # canonical text for approximate prefix hashing
    tokenize_request: Callable[[Mapping[str, object], str], TokenizeRequest]  # exact mode
    # `stream_options.include_usage` added when a streamed request did not ask for the usage chunk
    # (stripped again on the way out); None: the endpoint has no usage chunk to ask for
    request_usage: Callable[[bytes, dict[str, object]], bytes] | None
    meter_body: Callable[[bytes | None], Usage]  # usage of a response that was not streamed


def with_usage_requested(raw: bytes, body: dict[str, object]) -> bytes:
    """The body with `stream_options.include_usage = true` (cheap splice when the key is absent)."""
    if "stream_options" not in body:
        start = raw.find(b"{")
        return raw[: start + 1] + b'"stream_options":{"include_usage":true},' + raw[start + 1 :]
    options = dict(body["stream_options"]) if isinstance(body["stream_options"], dict) else {}
    return json.dumps({**body, "stream_options": {**options, "include_usage": True}}).encode()


def _checked(check: Callable[[], None]) -> None:
    """Run a shape check of policy/request.py; its InvalidRequest as the client's error."""
    try:
        check()
    except InvalidRequest as e:
        raise GatewayError(e.status, e.code, str(e), param=e.param) from None


def _check_chat(body: dict[str, Any], limits: LimitsSection) -> None:
    try:  # `_checked` inline: two Python calls less on every chat request
        check_chat(body, max_messages=limits.max_messages, max_prompt_chars=limits.max_prompt_chars)
    except InvalidRequest as e:
        raise GatewayError(e.status, e.code, str(e), param=e.param) from None


def _check_completion(body: dict[str, Any], limits: LimitsSection) -> None:
    _checked(lambda: check_completion(body, max_prompt_chars=limits.max_prompt_chars))


# name, path, check_body, prefix_text, tokenize_request, request_usage, meter_body
CHAT = Endpoint("chat", "/v1/chat/completions", _check_chat, chat_text, chat_tokenize_request,
                with_usage_requested, meter_json_body)  # fmt: skip
COMPLETIONS = Endpoint("completions", "/v1/completions", _check_completion, completion_text,
                       completion_tokenize_request, with_usage_requested, meter_json_body)  # fmt: skip
ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in (CHAT, COMPLETIONS)}

# path -> (endpoint, allowed method); the gateway's own endpoints answer GET (and HEAD)
ROUTES: dict[str, tuple[Endpoint | LocalEndpoint, str]] = {
    **{e.path: (e, "POST") for e in ENDPOINTS.values()},
    "/v1/models": ("models", "GET"),
    "/readyz": ("readyz", "GET"),  # a load balancer checks the port it sends traffic to
}
# only on the metrics port (plugin/metrics_server.py, issue 10): scrapes and liveness probes never
# wait for a saturated proxy, and the proxy port exposes no operator data to clients
METRICS_PORT_ONLY = frozenset({"/metrics", "/healthz"})


def route_for(method: str, path: str) -> Endpoint | LocalEndpoint:
    """The endpoint for a method and path (query string ignored); GatewayError 404/405 otherwise."""
    bare = path.split("?", 1)[0].rstrip("/") or "/"
    found = ROUTES.get(bare)
    if found is None and bare in METRICS_PORT_ONLY:
        raise GatewayError(
            404, "not_found",
            f"{bare} is served on the gateway's metrics port (--metrics-port, default 9464), "
            "not the proxy port",
        )  # fmt: skip
    if found is None:
        raise GatewayError(404, "not_found", f"kvgate serves no {bare}")
    endpoint, allowed = found
    if method != allowed and not (allowed == "GET" and method == "HEAD"):
        raise GatewayError(405, "method_not_allowed", f"{bare} takes {allowed}, not {method}")
    return endpoint
