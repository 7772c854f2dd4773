"""Token ids of plain ASCII text without the tokenizer's own regex pass: a pre-token cache.

For a byte-level BPE (GPT-2's regex, or the Llama 3 / Qwen 2 split pattern then byte level; no
normalizer, no dropout) the ids of a text are the BPE ids of its pre-tokens in order, and a pre-token's
ids depend on that pre-token alone. In `tokenizers` the regex split (Oniguruma) is most of an encode's
time: for a 7k-character chat message it took about as long as the whole encode, ~10 times Python's
`re.findall` with the same rules (docs/BENCHMARKS.md §62). `WordEncoder` splits with
Python's `re` instead and maps each pre-token through a dict of ids seen before; a pre-token not in it
is given to the tokenizer's own model (`model.tokenize` of its byte-level form, the step an encode runs
per pre-token), then kept.

Only text made of printable ASCII, tab, newline and carriage return is split here (`ids` returns None
for anything else, which the caller encodes with the tokenizer). On that alphabet the patterns below are
the tokenizer's: `\\p{L}` is `[A-Za-z]`, `\\p{N}` is `[0-9]`, `\\s` is `[\\t\\n\\r ]` (Python's `\\s`
would also take `\\x1c`-`\\x1f`, Oniguruma's would not, so neither is written as `\\s`). Both engines are
leftmost-first backtracking matchers, and every pattern matches every character of the alphabet, so the
split leaves no gaps. `for_tokenizer` returns None unless the pre-tokenizer is one of the three, and
checks the split and the byte mapping against the tokenizer's own pre-tokenizer on a probe text.
tests/property/test_local_tokenizer_incremental.py compares the ids with a whole-text encode.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable, Mapping
from typing import Any

from tokenizers import Tokenizer as HfTokenizer

# GPT-2's byte-level regex (tokenizers' ByteLevel with use_regex:
# 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) on the alphabet above
_GPT2_ASCII = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\t\n\r A-Za-z0-9]+|[\t\n\r ]+(?![^\t\n\r ])|[\t\n\r ]+"
)
# the Llama 3 / cl100k and Qwen 2 split patterns (tokenizer.json) and theirs
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_ASCII = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}| ?[^\t\n\r A-Za-z0-9]+[\r\n]*"
    r"|[\t\n\r ]*[\r\n]+|[\t\n\r ]+(?![^\t\n\r ])|[\t\n\r ]+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN2_ASCII = _LLAMA3_ASCII.replace("[0-9]{1,3}", "[0-9]")
SPLITS = {_LLAMA3: _LLAMA3_ASCII, _QWEN2: _QWEN2_ASCII}
# any character outside the alphabet the patterns are written for
_OUTSIDE = re.compile(r"[^\t\n\r -~]")
_ALPHABET = "\t\n\r" + "".join(map(chr, range(0x20, 0x7F)))
# every kind of neighbour for the rules above: contractions, spaces before words / digits / symbols,
# whitespace runs before letters and at the end, newlines after symbols, digit groups
_PROBE = (
    "It's  we'LL\tgo:  x1234567 ab12 ?!  \n\n  end\r\n\r\n 'd'S've 9 99 999 9999 $%^ \t \n"
    "a.b,c;  (d)[e]{f} <g> ~`|\\ \"q\" 're'm 'T  \t\tz" + _ALPHABET + " " + _ALPHABET[::-1] + "   "
)
MAX_WORDS = 1 << 17  # pre-tokens kept; when full the cache starts again (a few MB)


def _byte_level() -> dict[int, str]:
    """GPT-2's byte -> character map (tokenizers' ByteLevel), for the bytes of the alphabet."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return {ord(c): out[ord(c)] for c in _ALPHABET}


def ascii_pattern(spec: Mapping[str, Any]) -> str | None:
    """The split pattern on the alphabet, for the pre-tokenizers WordEncoder knows, else None."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return _GPT2_ASCII
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if isinstance(steps, list) and len(steps) == 2 and steps[0].get("type") == "Split":
        regex = (steps[0].get("pattern") or {}).get("Regex")
        return SPLITS.get(regex) if isinstance(regex, str) else None
    return None


class WordEncoder:
    """`ids(text)`: the tokenizer's ids of `text` (no special tokens), or None if it is not all in the
    alphabet; the caller has checked the rest of the pipeline (plugin/local_tokenizer.py `_chunkable`:
    no normalizer, a BPE without dropout, no prefix space)."""

    def __init__(self, tokenizer: HfTokenizer, pattern: str, max_words: int = MAX_WORDS) -> None:
        self._split: Callable[[str], list[str]] = re.compile(pattern).findall
        self._tokenize = tokenizer.model.tokenize
        self._byte_level = _byte_level()
        # a pre-token's ids as the bytes of an array("I"): a text's ids are one bytes join, no Python loop
        self._words: dict[str, bytes] = {}
        self.max_words = max_words

    @classmethod
    def for_tokenizer(cls, tokenizer: HfTokenizer, spec: Mapping[str, Any]) -> WordEncoder | None:
        """A WordEncoder if the pre-tokenizer is one of the known three and splits and maps the probe text
        as this one does, and nothing truncates or pads; else None."""
        pattern = ascii_pattern(spec)
        pre = tokenizer.pre_tokenizer
        if pattern is None or pre is None or tokenizer.truncation or tokenizer.padding:
            return None
        out = cls(tokenizer, pattern)
        theirs: list[str] = [piece for piece, _ in pre.pre_tokenize_str(_PROBE)]
        ours = [w.translate(out._byte_level) for w in out._split(_PROBE)]
        return out if ours == theirs else None

    def ids(self, text: str) -> array[int] | None:
        """The ids of `text` as an array("I"), or None if it is not all in the alphabet."""
        if _OUTSIDE.search(text) is not None:
            return None
        words = self._split(text)
        parts = list(map(self._words.get, words))
        try:
            joined = b"".join(parts)  # type: ignore[arg-type]  # a None (a pre-token not cached) raises
        except TypeError:
            joined = b"".join(
                [part if part is not None else self._word(words[i]) for i, part in enumerate(parts)]
            )
        out = array("I")
        out.frombytes(joined)
        return out

    def clear(self) -> None:
        self._words.clear()

    def _word(self, word: str) -> bytes:
        found = self._words.get(word)  # the same word earlier in this text
        if found is None:
            if len(self._words) >= self.max_words:
                self._words.clear()
            tokens = self._tokenize(word.translate(self._byte_level))
            found = self._words[word] = array("I", [t.id for t in tokens]).tobytes()
        return found
