"""`kvgate bench tokenize`: what the gateway's own tokenizer costs per request, and the loop stall.

    kvgate bench tokenize [--json out/tokenize.json] [--tokenizer DIR] [--rounds 50]

Warm: a chat of `--prefix-tokens` (30k) tokens has been seen; each round sends it again with a new
user message, about `--prompt-tokens` (32k) in all, and times `LocalTokenizer.blocks_async` (render the
template, find the seen prefix, encode and hash the rest): p50 / p99 in seconds; `p50_new_text_encode`
is the tokenizer's own share, the new message's text alone encoded as the warm path encodes it
(`p50_new_text_library_encode`: by the `tokenizers` library alone), `p50_unseen_words` the warm p50
with the pre-token cache emptied before each round (plugin/word_encoder.py), and `p50_loop_cpu` the CPU
time of the loop's thread per round (its Python; the encode's threads are not counted, machine load
matters less). Cold: a fresh tokenizer (empty caches) gets a whole new 32k-token chat while a ticker on
the same event loop wakes every millisecond; `loop_stall_p99` (and `_max`) is how late the ticker woke,
i.e. how long another flow on the loop would have waited. The model directory is bench/toy_model.py's
(made on the spot) unless `--tokenizer` names one. Writes {"prompt_tokens", "cached_prefix_tokens",
"p50", "p99", "loop_stall_p99", ...} to --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Coroutine, Generator
from pathlib import Path
from typing import Any, cast

from bench import toy_model
from plugin.local_tokenizer import PARALLEL_MIN_CHUNKS, LocalTokenizer
from runtime.tasks import spawn

MODEL = "bench"
BLOCK = 16
TICK_S = 0.001


def chat(seed: int, tokens: int, tok: LocalTokenizer, words_per_message: int = 300) -> list[dict[str, Any]]:
    """A chat of alternating user/assistant messages of about `tokens` tokens in all (template included)."""
    rng, vocab = random.Random(seed), toy_model.words(7)
    messages: list[dict[str, Any]] = [{"role": "system", "content": toy_model.sentence(rng, vocab, 200)}]
    while tok.blocks({"messages": messages}, MODEL, BLOCK).prompt_tokens < tokens:
        role = "user" if messages[-1]["role"] != "user" else "assistant"
        messages.append({"role": role, "content": toy_model.sentence(rng, vocab, words_per_message)})
    return messages


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def warm_rounds(
    tok: LocalTokenizer,
    prefix: list[dict[str, Any]],
    extra_words: int,
    rounds: int,
    empty_words: bool = False,
) -> Any:
    """Per round the seen prefix and a new user message. The pre-token cache (plugin/word_encoder.py)
    starts empty after the prefix, so the rounds fill it as a gateway's requests do (the first rounds miss);
    with `empty_words` it is emptied before every round (a new message of words never seen)."""
    rng, vocab = random.Random(11), toy_model.words(7)
    tok.blocks({"messages": prefix}, MODEL, BLOCK)  # the 30k tokens are seen
    words = tok.words
    times: list[float] = []
    cpu, loop_cpu, encode, library, last = [], [], [], [], None
    for _ in range(rounds):
        content = toy_model.sentence(rng, vocab, extra_words)
        body = {"messages": [*prefix, {"role": "user", "content": content}]}
        if words is not None and (empty_words or not times):
            words.clear()
        started, started_cpu, started_loop = time.perf_counter(), time.process_time(), time.thread_time()
        last = await tok.blocks_async(body, MODEL, BLOCK)
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
        loop_cpu.append(time.thread_time() - started_loop)
        # the new message's text alone, encoded as the warm path encodes it, then by the library alone
        # (its chunks in one call), which the warm path used before the pre-token cache
        started = time.perf_counter()
        tok._encode([content], False)
        encode.append(time.perf_counter() - started)
        chunks = tok.chunks(content)
        batch = tok.tokenizer.encode_batch if len(chunks) >= PARALLEL_MIN_CHUNKS else tok._fast
        started = time.perf_counter()
        batch(chunks, add_special_tokens=False)
        library.append(time.perf_counter() - started)
    return times, cpu, loop_cpu, encode, library, last


class Stepped:
    """Awaits a coroutine and times each of its steps on the loop (from one suspension to the next) in
    CPU time of the loop thread: the longest is what the code itself holds the loop for, without the
    waits for a core or the GIL that a busy machine adds to the ticker's lateness. `walls` are the same
    steps in wall time: a step that waits for a GIL-releasing encode on the loop thread is long there."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro, self.steps, self.walls = coro, cast(list[float], []), cast(list[float], [])

    def __await__(self) -> Generator[Any, Any, Any]:
        send: Any = None
        thrown: BaseException | None = None
        while True:
            started, wall = time.thread_time(), time.perf_counter()
            try:
                awaited = self.coro.send(send) if thrown is None else self.coro.throw(thrown)
            except StopIteration as done:
                self.steps.append(time.thread_time() - started)
                self.walls.append(time.perf_counter() - wall)
                return done.value
            self.steps.append(time.thread_time() - started)
            self.walls.append(time.perf_counter() - wall)
            try:
                send, thrown = (yield awaited), None
            except BaseException as e:  # cancellation: the coroutine gets it where it waits
                send, thrown = None, e


async def cold_rounds(
    directory: Path, tokens: int, rounds: int
) -> tuple[list[float], list[float], list[float], list[float], list[float], int]:
    """Per round a fresh tokenizer and a new chat; the ticker's lateness samples while it runs, and the
    CPU time of each step of the tokenizer's coroutine on the loop (`Stepped`)."""
    lateness: list[float] = []
    steps: list[float] = []
    walls: list[float] = []
    durations: list[float] = []
    running = asyncio.Event()

    async def ticker() -> None:
        while True:
            due = time.perf_counter() + TICK_S
            await asyncio.sleep(TICK_S)
            if running.is_set():
                lateness.append(max(0.0, time.perf_counter() - due))

    probe = LocalTokenizer.load(directory)
    bodies = [{"messages": chat(100 + i, tokens, probe)} for i in range(rounds)]
    prompt_tokens = probe.blocks(bodies[0], MODEL, BLOCK).prompt_tokens
    task = spawn(ticker(), name="bench-tokenize-ticker")
    try:
        running.set()  # the ticker alone first: the machine's own lateness, to compare with
        await asyncio.sleep(0.5)
        running.clear()
        idle = list(lateness)
        lateness.clear()
        for body in bodies:
            tok = LocalTokenizer.load(directory)
            await asyncio.sleep(0.01)
            running.set()
            started = time.perf_counter()
            stepped = Stepped(tok.blocks_async(body, MODEL, BLOCK))
            await stepped
            durations.append(time.perf_counter() - started)
            steps += stepped.steps
            walls += stepped.walls
            running.clear()
    finally:
        task.cancel()
    return durations, lateness, steps, walls, idle, prompt_tokens


async def run(
    directory: Path, prefix_tokens: int, prompt_tokens: int, rounds: int, cold: int
) -> dict[str, Any]:
    tok = LocalTokenizer.load(directory)
    prefix = chat(1, prefix_tokens, tok)
    per_word = tok.blocks({"messages": prefix}, MODEL, BLOCK).prompt_tokens / sum(
        len(m["content"].split()) for m in prefix
    )
    tok = LocalTokenizer.load(directory)  # measured from a clean cache holding only the prefix
    extra_words = max(1, int((prompt_tokens - prefix_tokens) / per_word))
    times, cpu, loop_cpu, encode, library, last = await warm_rounds(tok, prefix, extra_words, rounds)
    tok = LocalTokenizer.load(directory)
    unseen_words = (await warm_rounds(tok, prefix, extra_words, max(1, rounds // 5), empty_words=True))[0]
    cold_times, lateness, steps, walls, idle, cold_tokens = await cold_rounds(directory, prompt_tokens, cold)
    whole = LocalTokenizer.load(directory)
    text, special = whole.prompt_text({"messages": prefix})
    started = time.perf_counter()
    whole.encode(text, special)
    return {
        "prompt_tokens": last.prompt_tokens,
        "cached_prefix_tokens": last.cached_tokens,
        "p50": quantile(times, 0.5),
        "p99": quantile(times, 0.99),
        "p50_cpu": statistics.median(cpu),  # CPU of all threads (the loop's and the encoder's) per round
        "p50_loop_cpu": statistics.median(loop_cpu),  # CPU of the loop's thread per round (not the encoder's)
        "p50_new_text_encode": statistics.median(encode),  # the tokenizer's part of a warm round
        "p50_new_text_library_encode": statistics.median(library),  # the same text by `tokenizers` alone
        "p50_unseen_words": statistics.median(unseen_words),  # warm, with the pre-token cache emptied
        "loop_stall_p99": quantile(lateness, 0.99) if lateness else 0.0,
        "loop_stall_max": max(lateness, default=0.0),
        "loop_stall_idle_p99": quantile(idle, 0.99) if idle else 0.0,  # the ticker with nothing to wait for
        "loop_step_cpu_p99": quantile(steps, 0.99),  # CPU of one step of the cold tokenizations on the loop
        "loop_step_cpu_max": max(steps),
        "loop_step_wall_max": max(walls),  # the same steps in wall time (an encode on the loop thread)
        "loop_steps": len(steps) / cold,  # steps per cold prompt
        "cold_prompt_tokens": cold_tokens,
        "cold_p50": statistics.median(cold_times),
        "whole_prefix_encode_s": time.perf_counter() - started,
        "rounds": rounds,
        "cold_rounds": cold,
        "incremental": tok.incremental,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench tokenize", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--tokenizer", help="model directory (default: bench/toy_model.py's, made on the spot)")
    p.add_argument("--prefix-tokens", type=int, default=30_000)
    p.add_argument("--prompt-tokens", type=int, default=32_000)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--cold-rounds", type=int, default=5)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not 0 < args.prefix_tokens < args.prompt_tokens or args.rounds < 1 or args.cold_rounds < 1:
        p.error("need 0 < --prefix-tokens < --prompt-tokens and at least one round of each")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.tokenizer) if args.tokenizer else toy_model.build(Path(tmp) / "model")
        out = asyncio.run(
            run(directory, args.prefix_tokens, args.prompt_tokens, args.rounds, args.cold_rounds)
        )
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
