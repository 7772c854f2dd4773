"""Workloads for live runs (demo, live benchmarks): real chat requests with real text.

The simulator's scenarios carry block ids; a live run needs prompts that tokenize into shared
prefixes, so these build text: each tenant has its own long system prompt, each request adds a
short unique question. Deterministic from the seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from bench.loadgen import LiveRequest
from policy.prefix import CHARS_PER_TOKEN  # the one estimate (PEERS §5: 4 characters per token)

# ~4 characters per token in the emulated worker's tokenizer (bench/emulator)
_WORDS = [
    "model",
    "cache",
    "prefix",
    "token",
    "worker",
    "router",
    "queue",
    "latency",
    "policy",
    "tenant",
    "stream",
    "batch",
    "decode",
    "prefill",
    "memory",
    "budget",
    "request",
    "priority",
    "lease",
    "quota",
    "gateway",
    "cluster",
    "replica",
    "index",
    "block",
    "hash",
    "agent",
    "drain",
]


def filler_text(rng: random.Random, tokens: int, chars_per_token: float = CHARS_PER_TOKEN) -> str:
    """About `tokens` tokens of deterministic English-like filler, for a tokenizer that makes one token
    of `chars_per_token` characters of it (the emulated worker's fake tokenizer: 4)."""
    words: list[str] = []
    chars = 0
    while chars < tokens * chars_per_token:
        word = rng.choice(_WORDS)
        words.append(word)
        chars += len(word) + 1
    return " ".join(words)


@dataclass(frozen=True)
class TenantPromptsScenario:
    """Many tenants, each with its own long system prompt, sharing a cluster.

    Cache pressure = tenants × system_tokens ÷ per-worker KV capacity: above 1 one worker cannot
    hold every tenant's prompt (round-robin makes every worker try, and thrash), below the worker
    count the cluster can hold them all if requests are partitioned by prefix.

    `system_tokens` and `question_tokens` are tokens of a tokenizer making one token of
    `chars_per_token` characters of the filler: the fake tokenizer's 4 by default. For another
    tokenizer, `sized_for(count)` measures it and returns the scenario whose prompts have that many
    of its tokens.
    """

    tenants: int = 12
    system_tokens: int = 6000
    question_tokens: int = 40
    max_tokens: int = 24
    requests: int = 240
    rate_rps: float = 8.0
    model: str = "demo-model"
    seed: int = 1
    chars_per_token: float = CHARS_PER_TOKEN

    def working_set_tokens(self, count: Callable[[str], int] | None = None) -> int:
        """The system prompts' tokens: `system_tokens` each, or as `count` tokenizes them."""
        if count is None:
            return self.tenants * self.system_tokens
        return sum(map(count, self.system_prompts()))

    def system_prompts(self, rng: random.Random | None = None) -> list[str]:
        """The tenants' system prompts, drawn from `rng` (default: a fresh one of the seed, as in `build`)."""
        rng = random.Random(self.seed) if rng is None else rng
        return [
            f"You are assistant {t} for tenant {t}. "
            + filler_text(rng, self.system_tokens, self.chars_per_token)
            for t in range(self.tenants)
        ]

    def sized_for(self, count: Callable[[str], int], rounds: int = 4) -> TenantPromptsScenario:
        """This scenario with `chars_per_token` measured on `count` (a tokenizer's token count of a text):
        its system prompts then have `system_tokens` of those tokens on average (within 1 %)."""
        scenario = self
        for _ in range(rounds):
            actual = scenario.working_set_tokens(count) / scenario.tenants
            if abs(actual - self.system_tokens) <= 0.01 * self.system_tokens:
                break
            scenario = replace(
                scenario, chars_per_token=scenario.chars_per_token * self.system_tokens / actual
            )
        return scenario

    def build(self) -> list[LiveRequest]:
        rng = random.Random(self.seed)
        prompts = self.system_prompts(rng)
        out: list[LiveRequest] = []
        send_at = 0.0
        for i in range(self.requests):
            send_at += rng.expovariate(self.rate_rps)
            tenant = rng.randrange(self.tenants)
            question = f"Question {i}: " + filler_text(rng, self.question_tokens, self.chars_per_token)
            body = {
                "model": self.model,
                "messages": [
                    {"role": "system", "content": prompts[tenant]},
                    {"role": "user", "content": question},
                ],
                "max_tokens": self.max_tokens,
            }
            out.append(LiveRequest(send_at_s=send_at, body=body))
        return out
