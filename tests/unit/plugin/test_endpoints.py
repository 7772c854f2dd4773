"""plugin/endpoints.py: the table is the one place an OpenAI endpoint is declared."""

from __future__ import annotations

import json

import pytest

from plugin.config import LimitsSection
from plugin.endpoints import COMPLETIONS, ENDPOINTS, ROUTES, route_for
from plugin.errors import GatewayError
from plugin.parse import parse_completion
from plugin.tokenize import TokenizeFailed

LIMITS = LimitsSection()


def test_every_entry_is_routed_by_its_path_and_takes_post() -> None:
    assert {e.path for e in ENDPOINTS.values()} == {"/v1/chat/completions", "/v1/completions"}
    for endpoint in ENDPOINTS.values():
        assert route_for("POST", endpoint.path) is endpoint
        assert ROUTES[endpoint.path] == (endpoint, "POST")
        with pytest.raises(GatewayError) as info:
            route_for("GET", endpoint.path)
        assert info.value.status == 405


@pytest.mark.parametrize(
    ("name", "body", "text", "tokenize"),
    [
        pytest.param(
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            '<|tools|>[{"type":"function"}]\n<|user|>hi\n',
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            id="chat",
        ),
        pytest.param(
            "completions",
            {"model": "m", "prompt": "once upon", "add_special_tokens": False},
            "once upon",
            {"model": "m", "prompt": "once upon", "add_special_tokens": False},
            id="completions",
        ),
        pytest.param("completions", {"model": "m", "prompt": [5, 6]}, "<tokens:5,6>", [5, 6], id="token ids"),
    ],
)
def test_an_entry_validates_renders_and_tokenizes_its_body(
    name: str, body: dict[str, object], text: str, tokenize: object
) -> None:
    endpoint = ENDPOINTS[name]
    parsed = parse_completion(endpoint, json.dumps(body).encode(), LIMITS)
    assert parsed.endpoint is endpoint
    assert endpoint.prefix_text(parsed.body) == text
    assert endpoint.tokenize_request(parsed.body, "m") == tokenize


def test_a_completions_body_is_rendered_from_its_prompt_whatever_else_it_carries() -> None:
    body = {"model": "m", "prompt": "p", "messages": "not a chat request"}
    assert COMPLETIONS.prefix_text(body) == "p"


def test_usage_is_requested_where_the_endpoint_can_stream_it() -> None:
    for endpoint in ENDPOINTS.values():
        assert endpoint.request_usage is not None
        raw = json.dumps({"model": "m", "stream": True}).encode()
        asked = json.loads(endpoint.request_usage(raw, json.loads(raw)))
        assert asked["stream_options"] == {"include_usage": True}
        usage = endpoint.meter_body(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2}}')
        assert (usage.prompt_tokens, usage.output_tokens) == (3, 2)


def test_a_prompt_batch_is_not_tokenized() -> None:
    with pytest.raises(TokenizeFailed):
        COMPLETIONS.tokenize_request({"prompt": ["a", "b"]}, "m")
