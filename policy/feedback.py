"""Hit feedback: what the engine's reported cached tokens say about an approximate index.

An approximate index guesses a worker's cache from where requests were sent (policy/index.py), blind
to evictions, restarts and traffic that bypassed the router. Every response reports how many prompt
tokens the engine found cached (vLLM / SGLang `usage.prompt_tokens_details.cached_tokens`). A request
routed to W expecting E leading blocks, for which W reports fewer, is evidence against the index:

    W's engine no longer held block A (the first one it did not report) when the request was admitted.
    An LRU engine evicts its least recently used blocks first, so every block W's index last saw used
    before block A's last use (as the index saw it at routing) is gone too.

`stale_before` is that rule: the time before which W's entries are stale, or None when the report
agrees with the index. The caller drops W's entries last touched before it
(`PrefixIndex.forget_before`). It needs no constant: the missing block's own last use is the evidence.
A restart is the same rule at its strongest: A = 0, so everything W was believed to hold before the
prompt's root was last routed there goes at once; entries routed to W since then survive, and the next
miss (if any) removes what is left. The request's own chain is not dropped: it was touched when this
request was routed, after the threshold, and its prefill cached it again.

One block of slack: the engine never serves the last prompt token from cache (a full hit recomputes
the last block) and reports its cached tokens in its own block size, which may not align with the
index's blocks (the gateway's approximate text chunks), so a report one block short is no evidence.
"""

from __future__ import annotations

from collections.abc import Sequence

SLACK_BLOCKS = 1  # see the module docstring: last-block recompute and block-size rounding


def reported_blocks(cached_tokens: int, block_tokens: Sequence[int]) -> int:
    """Leading blocks of the prompt wholly covered by `cached_tokens`."""
    covered = 0
    for i, tokens in enumerate(block_tokens):
        covered += tokens
        if covered > cached_tokens:
            return i
    return len(block_tokens)


def stale_before(
    cached_tokens: int, block_tokens: Sequence[int], expected_touched_s: Sequence[float]
) -> float | None:
    """The index time before which a worker's entries are stale, given what its engine reported.

    `expected_touched_s[i]`: when the index last saw block i of the prompt used on the worker, as it
    stood at routing, for each of the E blocks it expected the worker to hold (E = its length).
    `cached_tokens`: the prompt tokens the engine reported cached, in the same units as `block_tokens`.
    None: the report agrees with the index (within SLACK_BLOCKS)."""
    expected = len(expected_touched_s)
    got = reported_blocks(max(0, cached_tokens), block_tokens)
    if got + SLACK_BLOCKS >= expected:
        return None
    return expected_touched_s[got]


def scaled_cached_tokens(
    cached_tokens: int, reported_prompt_tokens: int | None, estimated_prompt_tokens: int
) -> int:
    """The engine's cached tokens in the units of the index's blocks: the gateway's approximate blocks
    carry estimated token counts (characters ÷ 4), the engine's counts are real tokens, so the cached
    share of the prompt is what carries over."""
    if not reported_prompt_tokens or reported_prompt_tokens <= 0:
        return cached_tokens
    return round(cached_tokens * estimated_prompt_tokens / reported_prompt_tokens)
