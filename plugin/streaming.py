"""Metering a response as it streams through: TTFT, output tokens, cached tokens.

`SseMeter` is set as `flow.response.stream`: mitmproxy calls it with each chunk as read from the
worker (TCP reads, so events can be split anywhere) and finally with b"", and forwards the chunks
it returns (a list; empty when there is nothing to send yet). It forwards complete
lines at once and holds only an unfinished line, so nothing is buffered beyond one event line. It
reads the worker's usage chunk (`stream_options.include_usage`, which the gateway may add) for
output and cached tokens, and drops that chunk when the client did not ask for it.
Non-streamed responses are metered from their JSON body with `meter_json_body`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from plugin import jsonbody


@dataclass(slots=True)
class Usage:
    first_token_at: float | None = None  # clock() when the first data event passed through
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    events: int = 0  # data events other than [DONE]
    done: bool = False  # [DONE] seen (the stream completed)


class SseMeter:
    """A `flow.response.stream` callable: forwards SSE lines unchanged and meters them."""

    def __init__(
        self,
        *,
        strip_usage: bool,
        clock: Callable[[], float] = time.monotonic,
        on_first_event: Callable[[], None] | None = None,
    ) -> None:
        self.usage = Usage()
        self._on_first_event = on_first_event
        self.strip_usage = strip_usage  # the client did not ask for the usage chunk: drop it
        self._clock = clock
        self._partial = b""
        self._usage_seen = False
        self._skip_blank = False

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        # Never return b"" mid-stream: mitmproxy would forward it as an empty HTTP/1 chunk, which
        # is the chunked-encoding terminator and ends the client's response. [] sends nothing.
        if not chunk:  # end of stream: flush whatever is left
            rest, self._partial = self._partial, b""
            return _nonempty(self._filter(rest)) if rest else []
        data = self._partial + chunk if self._partial else chunk
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        return _nonempty(self._filter(data[:cut])) if cut else []

    def _filter(self, block: bytes) -> bytes:
        if b"data:" not in block and not self._skip_blank:
            return block
        out: list[bytes] = []
        changed = False
        for line in block.splitlines(keepends=True):
            if self._skip_blank:
                self._skip_blank = False
                if not line.strip():  # the blank line ending a removed event goes with it
                    changed = True
                    continue
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.usage.done = True
                else:
                    if self.usage.first_token_at is None:
                        self.usage.first_token_at = self._clock()
                        if self._on_first_event is not None:
                            self._on_first_event()
                    self.usage.events += 1
                    if b'"usage"' in payload and self._read_usage(payload) and self.strip_usage:
                        self._skip_blank = True
                        changed = True
                        continue
            out.append(line)
        return b"".join(out) if changed else block

    def _read_usage(self, payload: bytes) -> bool:
        """Read a chunk's usage; True when it is the usage-only chunk (no choices)."""
        try:
            event = jsonbody.loads(payload)
        except ValueError:
            return False
        usage = event.get("usage") if isinstance(event, dict) else None
        if not isinstance(usage, dict):
            return False
        read_usage(self.usage, usage)
        self._usage_seen = True
        return not event.get("choices")

    def finish(self) -> Usage:
        """Final figures; without a usage chunk, output tokens are estimated as content events."""
        if not self._usage_seen:
            self.usage.output_tokens = max(0, self.usage.events - 1)  # first event carries the role
        return self.usage


def _nonempty(data: bytes) -> bytes | list[bytes]:
    return data if data else []


def read_usage(into: Usage, usage: dict[str, object]) -> None:
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    if isinstance(completion, int):
        into.output_tokens = completion
    if isinstance(prompt, int):
        into.prompt_tokens = prompt
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        into.cached_tokens = details["cached_tokens"]


def meter_json_body(content: bytes | None, clock: Callable[[], float] = time.monotonic) -> Usage:
    """Usage of a non-streamed completion (TTFT = when the whole body arrived)."""
    result = Usage(first_token_at=clock())
    try:
        body = jsonbody.loads(content or b"")
    except ValueError:
        return result
    if isinstance(body, dict) and isinstance(body.get("usage"), dict):
        read_usage(result, body["usage"])
        result.done = True
    return result
