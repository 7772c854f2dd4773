"""Does the tokenizers binding release the GIL? A thread encodes a ~36k-token text while the main thread
sleeps 1 ms in a loop; few wake-ups mean the encode held the GIL (docs/BENCHMARKS.md, exact6 section).

    python -m bench.tokenize_gil
"""

from __future__ import annotations

import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench import toy_model
from plugin.local_tokenizer import LocalTokenizer


def ticks(fn: Callable[[], object]) -> str:
    """Run `fn` on a thread; how often and how late the main thread woke from 1 ms sleeps meanwhile."""
    done, late = threading.Event(), []

    def work() -> None:
        fn()
        done.set()

    thread = threading.Thread(target=work)
    thread.start()
    while not done.is_set():
        due = time.perf_counter() + 0.001
        time.sleep(0.001)
        late.append(time.perf_counter() - due)
    thread.join()
    late.sort()
    return f"wake-ups={len(late)} p99={late[int(0.99 * len(late))] * 1e3:.2f}ms max={late[-1] * 1e3:.2f}ms"


def main() -> int:
    tok = LocalTokenizer.load(toy_model.build(Path(tempfile.mkdtemp()) / "m")).tokenizer
    text = toy_model.sentence(random.Random(1), toy_model.words(7), 24000)
    print("tokens", len(tok.encode(text).ids))
    cases: list[tuple[str, Callable[[], object]]] = [
        ("encode", lambda: tok.encode(text, add_special_tokens=False)),
        ("encode+ids", lambda: tok.encode(text, add_special_tokens=False).ids),
        ("encode_batch", lambda: tok.encode_batch([text], add_special_tokens=False)),
        ("encode_batch+ids", lambda: [e.ids for e in tok.encode_batch([text], add_special_tokens=False)]),
    ]
    for name, fn in cases:
        for switch in (0.005, 0.0005):
            sys.setswitchinterval(switch)
            print(name, "switch", switch, ticks(fn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
