"""The SSE meter: forwards every byte of complete lines, whatever the chunking, and meters usage."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from plugin.streaming import SseMeter, meter_json_body


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


CHUNKS = [{"choices": [{"delta": {"content": f"t{i}"}}]} for i in range(5)]
USAGE = {
    "choices": [],
    "usage": {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 64}},
}
STREAM = b"".join(event(c) for c in CHUNKS) + event(USAGE) + b"data: [DONE]\n\n"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def joined(result: bytes | list[bytes]) -> bytes:
    assert result != b"", "an empty chunk would end the client's chunked response"
    return result if isinstance(result, bytes) else b"".join(result)


def run(meter: SseMeter, stream: bytes, cuts: list[int]) -> bytes:
    out = []
    last = 0
    for cut in sorted(set(cuts)):
        if cut > last:
            out.append(joined(meter(stream[last:cut])))
        last = cut
    if last < len(stream):
        out.append(joined(meter(stream[last:])))
    out.append(joined(meter(b"")))
    return b"".join(out)


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=30))
def test_any_chunking_forwards_everything(cuts: list[int]) -> None:
    meter = SseMeter(strip_usage=False)
    assert run(meter, STREAM, cuts) == STREAM
    usage = meter.finish()
    assert (usage.output_tokens, usage.prompt_tokens, usage.cached_tokens, usage.done) == (5, 100, 64, True)


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=30))
def test_usage_chunk_removed_when_client_did_not_ask(cuts: list[int]) -> None:
    meter = SseMeter(strip_usage=True)
    expected = b"".join(event(c) for c in CHUNKS) + b"data: [DONE]\n\n"
    assert run(meter, STREAM, cuts) == expected
    assert meter.finish().cached_tokens == 64


def test_first_token_time_is_the_first_data_event() -> None:
    clock = FakeClock()
    meter = SseMeter(strip_usage=False, clock=clock)
    assert meter(b": keep-alive comment\n\n") == b": keep-alive comment\n\n"
    assert meter.usage.first_token_at is None
    assert meter(b'data: {"choi') == []  # an unfinished line is held back; nothing is sent
    assert meter(b'ces": []}\n\n') == b'data: {"choices": []}\n\n'
    assert meter.usage.first_token_at == 1.0


def test_without_usage_chunk_tokens_are_counted_from_events() -> None:
    meter = SseMeter(strip_usage=False)
    meter(b"".join(event(c) for c in CHUNKS) + b"data: [DONE]\n\n")
    usage = meter.finish()
    assert (usage.output_tokens, usage.cached_tokens, usage.done) == (4, None, True)


def test_truncated_stream_is_not_done() -> None:
    meter = SseMeter(strip_usage=False)
    assert meter(event(CHUNKS[0]) + b'data: {"cho') == event(CHUNKS[0])
    assert meter(b"") == b'data: {"cho'
    assert not meter.finish().done


def test_json_body_usage() -> None:
    usage = meter_json_body(json.dumps({"usage": USAGE["usage"]}).encode())
    assert (usage.output_tokens, usage.cached_tokens, usage.done) == (5, 64, True)
    assert meter_json_body(b"<html>").done is False
