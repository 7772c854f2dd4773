"""A model's chat template rendered as vLLM renders it (transformers' `apply_chat_template`), pure.

transformers compiles `tokenizer_config.json`'s `chat_template` in a jinja2 ImmutableSandboxedEnvironment
with `trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension and a `{% generation %}` tag, a
`tojson` filter that does not escape HTML (`json.dumps`, ensure_ascii False), and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`. It renders with `messages`, `tools`,
`documents`, `add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...)
and the request's `chat_template_kwargs`; messages lose their `None` fields first, and
`reasoning_content` is also offered as `thinking`. `continue_final_message` renders the last message
open (the text after its content is cut).

vLLM, before that (its OpenAI server, `string` content format): each message's content parts are
joined with a newline into one string, a tool call's JSON `arguments` string is decoded into an object,
and each tool is `{"type": "function", "function": {"name", "description", "parameters"}}` with `None`
for a missing field (its pydantic model dumped). `add_generation_prompt` defaults to true.

Every bad input raises `TemplateError` with a client-facing message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


class TemplateError(ValueError):
    """A request the chat template cannot render; the message is client-facing."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace without underscore attributes (transformers' sandbox hardening)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' environment; TemplateError if it does not parse."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=dict, namespace=_Namespace
    )
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not parse: {e}") from None


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """`bos_token` etc. of a tokenizer_config.json (a string, or an AddedToken object's `content`)."""
    out: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _content(content: Any, where: str) -> Any:
    """vLLM's `string` content format: text parts joined with newlines."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateError(f"{where}.content: must be a string, a list of content parts or null")
    texts = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise TemplateError(f"{where}.content[{i}].text: must be a string")
            texts.append(part["text"])
        else:
            raise TemplateError(f"{where}.content[{i}]: only text parts are rendered locally")
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[Any]:
    if not isinstance(calls, list):
        raise TemplateError(f"{where}.tool_calls: must be a list")
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise TemplateError(f"{where}.tool_calls[{j}]: must be an object with a 'function'")
        fn = dict(call["function"])
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args else {}
            except ValueError:
                raise TemplateError(f"{where}.tool_calls[{j}].function.arguments: not JSON") from None
        out.append({**call, "function": fn})
    return out


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI `messages` as the template sees them (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages: must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TemplateError(f"{where}: must be an object with a string 'role'")
        item = {k: v for k, v in message.items() if v is not None}
        if "content" in item:
            item["content"] = _content(item["content"], where)
        if "tool_calls" in item:
            item["tool_calls"] = _tool_calls(item["tool_calls"], where)
        reasoning = item.get("reasoning_content", item.get("reasoning"))
        if reasoning is not None:
            item = {"thinking": reasoning, **item, "reasoning_content": reasoning}
        out.append(item)
    return out


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI `tools` as vLLM hands them to the template (pydantic dump: missing fields are None)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TemplateError("tools: must be a list")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise TemplateError(f"tools[{i}].function.name: must be a string")
        out.append(
            {
                "type": tool.get("type", "function"),
                "function": {
                    "name": fn["name"],
                    "description": fn.get("description"),
                    "parameters": fn.get("parameters"),
                },
            }
        )
    return out


def render(template: jinja2.Template, body: Mapping[str, Any], specials: Mapping[str, str]) -> str:
    """The prompt text vLLM's chat endpoint renders for an OpenAI chat request `body`."""
    rendering = Rendering(template, body, specials)
    return rendering.finish("".join(rendering.parts()))


class Rendering:
    """One `render` in steps: `parts()` yields the template's output as jinja2 generates it (a message at
    a time for the usual templates), `finish` the joined parts gives the text; so that a caller on an
    event loop can yield between parts of a long chat. TemplateError from the constructor, the iteration
    or `finish`."""

    def __init__(
        self, template: jinja2.Template, body: Mapping[str, Any], specials: Mapping[str, str]
    ) -> None:
        messages = template_messages(body.get("messages"))
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise TemplateError("chat_template_kwargs: must be an object")
        documents = body.get("documents")
        if documents is not None and not (
            isinstance(documents, list) and all(isinstance(d, Mapping) for d in documents)
        ):
            raise TemplateError("documents: must be a list of objects")
        self.cont = bool(body.get("continue_final_message", False))
        add_gen = body.get("add_generation_prompt", not self.cont)
        self.final = ""
        if self.cont:
            last = messages[-1]
            if not isinstance(last.get("content"), str):
                raise TemplateError("continue_final_message: the last message has no text content")
            self.final = last["content"]
            messages[-1] = {**last, "content": self.final + CONTINUE_TAG}
        self.template = template
        self.context: dict[str, Any] = {
            **specials,
            **kwargs,
            "messages": messages,
            "tools": template_tools(body.get("tools")),
            "documents": documents,
            "add_generation_prompt": bool(add_gen),
        }

    def parts(self) -> Iterator[str]:
        try:
            yield from self.template.generate(**self.context)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from None

    def finish(self, text: str) -> str:
        if self.cont:
            at = text.rfind(CONTINUE_TAG.strip())
            if at < 0 or self.final.strip() not in text:
                raise TemplateError("continue_final_message: the template dropped the final message")
            text = text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
        return text
