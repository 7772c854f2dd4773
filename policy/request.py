"""An OpenAI chat or completions request's prompt fields: their shape rules, and their canonical text.

The gateway checks a body with `check_chat` / `check_completion` before anything else reads it
(plugin/endpoints.py turns an `InvalidRequest` into its OpenAI-style error). The renderers
(`chat_text`, `completion_text`) take only bodies that passed, so each field is validated in one
place and rendering never meets a shape it cannot render; `canonical_text` does both, for callers
holding a body nobody checked. The canonical text is what approximate prefix hashing cuts into
blocks (policy/prefix.py): the same tools + system prompt + history give the same leading
characters. Pure: no I/O.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from policy.prefix import CHARS_PER_TOKEN, canonical_json

# the chat roles an OpenAI request may carry; others are refused
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
TEXT_PARTS = ("text", "input_text")
UNLIMITED = sys.maxsize


class InvalidRequest(ValueError):
    """A body that is not a valid request: the status (400, or 413 for a prompt over the limit), an
    error code and the offending parameter, for the client's error object."""

    def __init__(self, code: str, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


# --- shape rules ----------------------------------------------------------------------------------


def check_chat(
    body: Mapping[str, object], *, max_messages: int = UNLIMITED, max_prompt_chars: int = UNLIMITED
) -> None:
    """`tools` and `messages` of a chat request; the text of its messages within `max_prompt_chars`."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("invalid_request", "tools must be a list", param="tools")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("missing_messages", "'messages' must be a non-empty array", param="messages")
    if len(messages) > max_messages:
        raise InvalidRequest(
            "too_many_messages", f"{len(messages)} messages; limit {max_messages}", param="messages"
        )
    chars = 0
    for i, m in enumerate(messages):  # a loop, not sum(genexpr): one call less per message (hot path)
        chars += _message_chars(m, i)
    if chars > max_prompt_chars:
        raise InvalidRequest(
            "prompt_too_large", f"prompt has {chars} characters; limit {max_prompt_chars}", status=413
        )


def check_completion(body: Mapping[str, object], *, max_prompt_chars: int = UNLIMITED) -> None:
    """`prompt` of a completions request: text, texts, token ids or lists of token ids, within
    `max_prompt_chars` (a token id counts as CHARS_PER_TOKEN characters)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        size = len(prompt)
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            size = sum(len(p) for p in prompt if isinstance(p, str))
        elif _is_token_list(prompt):
            size = len(prompt) * CHARS_PER_TOKEN
        elif all(_is_token_list(p) for p in prompt):
            size = sum(len(p) for p in prompt if isinstance(p, list)) * CHARS_PER_TOKEN
        else:
            raise InvalidRequest(
                "invalid_prompt", "'prompt' must be a string, strings, or token ids", param="prompt"
            )
    else:
        raise InvalidRequest("missing_prompt", "'prompt' must be a non-empty string or array", param="prompt")
    if size > max_prompt_chars:
        raise InvalidRequest(
            "prompt_too_large", f"prompt has {size} characters; limit {max_prompt_chars}", status=413
        )


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _where(i: int) -> str:
    """The name of message `i` in an error (built only when there is one)."""
    return f"messages[{i}]"


def _message_chars(message: object, i: int) -> int:
    """Check message `i`'s fields; the characters of its text content."""
    if not isinstance(message, Mapping):
        raise InvalidRequest("invalid_message", f"{_where(i)} must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest("invalid_role", f"{_where(i)}.role must be one of {sorted(ROLES)}")
    for name in ("name", "tool_call_id"):
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            raise InvalidRequest("invalid_request", f"{_where(i)}.{name} must be a string")
    calls = message.get("tool_calls")
    if calls is not None:
        where = _where(i)
        if not isinstance(calls, list):
            raise InvalidRequest("invalid_request", f"{where}.tool_calls must be a list")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise InvalidRequest(
                    "invalid_request", f"{where}.tool_calls[{j}].function.name must be a string"
                )
    content = message.get("content")
    if isinstance(content, str):  # the common case, without a call
        return len(content)
    return _content_chars(content, _where(i))


def _content_chars(content: object, where: str) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        raise InvalidRequest("invalid_content", f"{where}.content must be a string or an array")
    chars = 0
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise InvalidRequest("invalid_content", f"{where}.content[{j}] must be an object with a 'type'")
        text = part.get("text")
        if part["type"] in TEXT_PARTS and not isinstance(text, str):
            raise InvalidRequest("invalid_request", f"{where}.content[{j}].text must be a string")
        if part["type"] == "image_url" and not isinstance(_image_url(part), str):
            raise InvalidRequest("invalid_request", f"{where}.content[{j}].image_url.url must be a string")
        chars += len(text) if isinstance(text, str) else 0
    return chars


def _image_url(part: Mapping[str, object]) -> object:
    ref = part.get("image_url")
    return ref.get("url") if isinstance(ref, Mapping) else ref


# --- canonical text (of checked bodies) -----------------------------------------------------------


def canonical_text(body: Mapping[str, object]) -> str:
    """A body nobody checked yet: checked (InvalidRequest, a ValueError, naming the offending field),
    then rendered by `chat_text` when it has `messages`, else `completion_text`."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("invalid_body", "request body must be a JSON object")
    if "messages" in body:
        check_chat(body)
        return chat_text(body)
    if "prompt" in body:
        check_completion(body)
        return completion_text(body)
    raise InvalidRequest(
        "invalid_request", "request has neither 'messages' (chat) nor 'prompt' (completions)"
    )


def chat_text(body: Mapping[str, object]) -> str:
    """A checked chat request: `tools` (canonical JSON, first: they act like a system prompt), then
    each message as `<|role name=.. call=..|>content<call id fn>args\\n`."""
    tools = body.get("tools")
    parts = [f"<|tools|>{canonical_json(tools)}\n"] if tools is not None else []
    messages = body["messages"]
    assert isinstance(messages, list)
    parts.extend([_message_text(m) for m in messages])
    return "".join(parts)


def completion_text(body: Mapping[str, object]) -> str:
    """A checked completions request: `prompt` as text, token ids as `<tokens:1,2,3>`."""
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return prompt
    assert isinstance(prompt, list)
    if all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    if _is_token_list(prompt):
        return _tokens_text(prompt)
    return "\n".join(_tokens_text(p) for p in prompt)


def _tokens_text(ids: list[int]) -> str:
    return "<tokens:" + ",".join(map(str, ids)) + ">"


def _message_text(msg: Mapping[str, object]) -> str:
    head = f"<|{msg['role']}"
    if msg.get("name") is not None:
        head += f" name={msg['name']}"
    if msg.get("tool_call_id") is not None:
        head += f" call={msg['tool_call_id']}"
    content = msg.get("content")
    text = content if isinstance(content, str) else _content_text(content)  # the common case: no call
    calls = msg.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        fn = call["function"]
        args = fn.get("arguments", "")
        args_text = args if isinstance(args, str) else canonical_json(args)
        text += f"<call {call.get('id', '')} {fn['name']}>{args_text}"
    reasoning = msg.get("reasoning_content")
    if isinstance(reasoning, str):
        text = f"<think>{reasoning}</think>" + text
    return f"{head}|>{text}\n"


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    assert isinstance(content, list)
    out: list[str] = []
    for part in content:
        kind = part["type"]
        if kind in TEXT_PARTS:
            out.append(part["text"])
        elif kind == "image_url":
            out.append(f"<image:{_image_url(part)}>")
        else:  # input_audio, file, ...: canonical JSON stands for the part
            out.append(f"<{kind}:{canonical_json(part)}>")
    return "".join(out)
