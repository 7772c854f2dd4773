"""Workloads for live runs (demo, live benchmarks): real chat requests with real text.

The simulator's scenarios carry block ids; a live run needs prompts that tokenize into shared
prefixes, so these build text: each tenant has its own long system prompt, each request adds a
short unique question. Deterministic from the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


def filler_text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of deterministic English-like filler."""
    words: list[str] = []
    chars = 0
    while chars < tokens * CHARS_PER_TOKEN:
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
    """

    tenants: int = 12
    system_tokens: int = 6000
    question_tokens: int = 40
    max_tokens: int = 24
    requests: int = 240
    rate_rps: float = 8.0
    model: str = "demo-model"
    seed: int = 1

    def working_set_tokens(self) -> int:
        return self.tenants * self.system_tokens

    def build(self) -> list[LiveRequest]:
        rng = random.Random(self.seed)
        prompts = [
            f"You are assistant {t} for tenant {t}. " + filler_text(rng, self.system_tokens)
            for t in range(self.tenants)
        ]
        out: list[LiveRequest] = []
        send_at = 0.0
        for i in range(self.requests):
            send_at += rng.expovariate(self.rate_rps)
            tenant = rng.randrange(self.tenants)
            question = f"Question {i}: " + filler_text(rng, self.question_tokens)
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
