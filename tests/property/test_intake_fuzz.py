"""Hypothesis over the intake (plugin/fuzz_target.py): bodies, headers and header values of every
kind get a clear 4xx or are accepted; none raises (a 500), and what is accepted is forwardable."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.fuzz_target import intake_outcome

PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/nope", "/healthz"])
HEADER_NAMES = st.sampled_from(
    [b"x-request-id", b"x-kvgate-priority", b"x-kvgate-max-wait-ms", b"x-kvgate-ttft-slo-ms",
     b"authorization", b"content-type", b"x-other"]
)  # fmt: skip
HEADER_VALUES = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"high", b"low", b"+5", "١".encode(), b"-1", b"99999999999999999999", b"Bearer k"]),
    st.text(max_size=50).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
HEADERS = st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "bad", 3]), "content": JSON | st.text()}
    ),
    max_size=4,
)
BODIES = st.one_of(
    st.binary(max_size=300),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"model": st.sampled_from(["m", "", "a{b}", 5]), "messages": MESSAGES},
        optional={"stream": JSON, "max_tokens": JSON, "stream_options": JSON, "prompt": JSON, "n": JSON},
    ).map(lambda v: json.dumps(v).encode()),
    st.integers(min_value=60, max_value=3000).map(lambda n: b"[" * n + b"]" * n),
)


@settings(max_examples=400, deadline=None)
@given(path=PATHS, headers=HEADERS, body=BODIES)
def test_every_input_gets_a_clear_answer(path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    status = intake_outcome(path, headers, body)
    assert status == 200 or 400 <= status < 500
