"""What turns a request into the emulated worker's prompt token ids.

`FakeTokenizer` (the default) is bench/emulator/tokenizer.py: 4-character pieces, a Llama-3-style
template. `HfTokenizer` (`kvgate worker --tokenizer DIR`) loads a real model directory's tokenizer.json
and chat template through transformers, as vLLM does: chat requests are rendered with
`apply_chat_template(tokenize=False)` (tools, documents, add_generation_prompt,
continue_final_message, chat_template_kwargs passed on) and encoded without special tokens;
completions prompts are encoded with them. transformers is a dev dependency, imported only here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from bench.emulator import tokenizer as fake


class EngineTokenizer(Protocol):
    vocab_size: int

    def chat(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a chat request; raises fake.TemplateError (a 400) for bad messages."""
        ...

    def text(self, prompt: str, add_special_tokens: bool = True) -> list[int]: ...


class FakeTokenizer:
    vocab_size = fake.VOCAB_SIZE

    def chat(self, body: Mapping[str, Any]) -> list[int]:
        return fake.tokenize(fake.render_chat(body.get("messages")))

    def text(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return fake.tokenize(prompt)


class HfTokenizer:
    """A model directory's tokenizer through transformers (the engine's own code path)."""

    def __init__(self, directory: str | Path) -> None:
        from transformers import PreTrainedTokenizerFast  # dev dependency: only with --tokenizer

        path = Path(directory)
        config = json.loads((path / "tokenizer_config.json").read_text())
        specials = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        self.tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **specials)
        self.tok.chat_template = config.get("chat_template")
        self.vocab_size = len(self.tok)

    def chat(self, body: Mapping[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise fake.TemplateError("messages: must be a non-empty list")
        tools = body.get("tools")
        if tools is not None:  # vLLM's pydantic dump: the three function fields, None when missing
            tools = [
                {"type": t.get("type", "function"), "function": {k: t["function"].get(k) for k in
                 ("name", "description", "parameters")}}
                for t in tools
            ]  # fmt: skip
        cont = bool(body.get("continue_final_message", False))
        kwargs = dict(body.get("chat_template_kwargs") or {})
        try:
            text = self.tok.apply_chat_template(
                [_vllm_message(m) for m in messages],
                tools=tools,
                documents=body.get("documents"),
                add_generation_prompt=bool(body.get("add_generation_prompt", not cont)),
                continue_final_message=cont,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:  # jinja2 and transformers raise several kinds for a bad conversation
            raise fake.TemplateError(f"chat template: {e}") from None
        return self.text(str(text), bool(body.get("add_special_tokens", False)))

    def text(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.tok(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        return ids


def _vllm_message(message: Any) -> Any:
    """vLLM's `string` content format (text parts joined by newlines), tool-call arguments decoded."""
    if not isinstance(message, Mapping):
        return message
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_decoded_call(c) for c in calls]
    return out


def _decoded_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return call
    return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"] or "{}")}}


def load(directory: str | None) -> EngineTokenizer:
    return HfTokenizer(directory) if directory else FakeTokenizer()
