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

Rendering from a message on (`compile_from`): for a template of the *message-local* form, the text of
`messages[:j]` is the same in every chat that starts with `messages[:j + 1]` (same tools, documents,
kwargs and `add_generation_prompt`), so a caller that kept it renders only `messages[j:]` (and the
tail). The form, checked on the template's AST: one top-level `{% for %}` over `messages` (or a name
set to it); before it, `messages` only as `messages[0]`; in its body, `messages` only as
`messages[loop.index0 - 1]` / `[loop.index0 + 1]`, `loop` only as `index0`, `index`, `first`, `last`,
no `{% set ns.x %}` (nothing carries from one message to the next); no macro, include or block that
reads `messages`; no `strftime_now`, `joiner`, `cycler` or `lipsum` anywhere (a date or a state that
would be kept with the text). After the loop anything goes: it is always rendered. The compiled
template loops over `messages[kvgate__from:]` with the body's `loop.index0`, `index` and `first`
shifted by `kvgate__from`, and calls `kvgate__mark` (where the body's text starts) at its top.
tests/property/test_chat_template_from.py checks that the kept text plus the rendering from `j` on
equals the whole rendering, on random chats with the templates this form accepts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from itertools import chain
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


FROM_VAR, MARK_VAR = "kvgate__from", "kvgate__mark"  # the names compile_from adds to the template
_LOOP_ATTRS = frozenset({"index0", "index", "first", "last"})  # the same for a message in every chat
_STATEFUL = frozenset({"strftime_now", "joiner", "cycler", "lipsum", FROM_VAR, MARK_VAR})


def compile_from(source: str) -> jinja2.Template | None:
    """The template compiled to render from a message on (module docstring), or None if it is not of
    the message-local form (then it is always rendered whole)."""
    env = compile_template(source).environment
    ast = env.parse(source)
    loop = _message_loop(ast)
    if loop is None:
        return None
    # {% for message in messages[kvgate__from:] %}, the body's loop.index0 / index / first shifted by
    # kvgate__from (loop.last is the same), and {{ kvgate__mark(index) }} at its top
    start = jinja2.nodes.Name(FROM_VAR, "load")
    loop.iter = jinja2.nodes.Getitem(loop.iter, jinja2.nodes.Slice(start, None, None), "load")
    loop.body = [_shifted(node) for node in loop.body]
    mark = jinja2.nodes.Call(jinja2.nodes.Name(MARK_VAR, "load"), [_index0()], [], None, None)
    loop.body.insert(0, jinja2.nodes.Output([mark]))
    for node in (loop.iter, *loop.body):
        node.set_lineno(loop.lineno)
        node.set_environment(env)
    return env.from_string(ast)


def reads_ahead(source: str) -> bool:
    """Whether the text of a message may depend on the next one: the template is not of the
    message-local form, or its loop's body reads `messages[loop.index0 + 1]`. If not, the text of
    `messages[:j]` is the same in every chat that starts with `messages[:j]` and has a message j
    (`loop.last` is false for each of them in all such chats)."""
    ast = compile_template(source).environment.parse(source)
    loop = _message_loop(ast)
    if loop is None:
        return True
    return any(
        isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Add)
        for top in loop.body
        for node in (top, *(child for _, child in _children(top)))
    )


def _index0() -> jinja2.nodes.Expr:
    """`loop.index0 + kvgate__from`: the message's index in the whole list."""
    loop_index0 = jinja2.nodes.Getattr(jinja2.nodes.Name("loop", "load"), "index0", "load")
    return jinja2.nodes.Add(loop_index0, jinja2.nodes.Name(FROM_VAR, "load"))


def _shifted(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """`node` of the loop's body with the loop's own `loop.index0`, `index` and `first` counted in the
    whole message list (not inside a nested for, whose `loop` is its own)."""
    if (
        isinstance(node, jinja2.nodes.Getattr)
        and isinstance(node.node, jinja2.nodes.Name)
        and node.node.name == "loop"
        and node.attr in ("index0", "index", "first")
    ):
        if node.attr == "index0":
            return _index0()
        if node.attr == "index":
            return jinja2.nodes.Add(_index0(), jinja2.nodes.Const(1))
        return jinja2.nodes.Compare(_index0(), [jinja2.nodes.Operand("eq", jinja2.nodes.Const(0))])
    for name, value in node.iter_fields():
        if isinstance(node, jinja2.nodes.For) and name != "iter":
            continue
        if isinstance(value, jinja2.nodes.Node):
            setattr(node, name, _shifted(value))
        elif isinstance(value, list):
            setattr(node, name, [_shifted(v) if isinstance(v, jinja2.nodes.Node) else v for v in value])
    return node


def _message_loop(ast: jinja2.nodes.Template) -> jinja2.nodes.For | None:
    """The top-level `for` over the messages if the template is of the message-local form, else None."""
    names = {"messages"}
    aliases: set[int] = set()  # the ids of those `set` nodes
    loop: jinja2.nodes.For | None = None
    for node in ast.body:
        if (  # {% set loop_messages = messages %} before the loop
            loop is None
            and isinstance(node, jinja2.nodes.Assign)
            and isinstance(node.target, jinja2.nodes.Name)
            and isinstance(node.node, jinja2.nodes.Name)
            and node.node.name in names
        ):
            names.add(node.target.name)
            aliases.add(id(node))
            continue
        if isinstance(node, jinja2.nodes.For) and loop is None and _iterates(node, names):
            if node.test is not None or node.recursive or node.else_:
                return None
            loop = node
            if not all(_body_ok(child, names, node) for child in node.body):
                return None
            continue
        if loop is None and not _header_ok(node, names):
            return None
    if loop is None or not _safe_everywhere(ast, names, aliases):
        return None
    return loop


def _iterates(node: jinja2.nodes.For, names: set[str]) -> bool:
    return isinstance(node.iter, jinja2.nodes.Name) and node.iter.name in names


def _children(node: jinja2.nodes.Node) -> Iterator[tuple[jinja2.nodes.Node, jinja2.nodes.Node]]:
    """(parent, child) for every node below `node`."""
    for child in node.iter_child_nodes():
        yield node, child
        yield from _children(child)


def _header_ok(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """Before the loop: the messages only as `messages[0]` (the first message is in every key)."""
    for parent, child in [(None, node), *_children(node)]:
        read = isinstance(child, jinja2.nodes.Name) and child.name in names and child.ctx == "load"
        first = (
            isinstance(parent, jinja2.nodes.Getitem)
            and parent.node is child
            and isinstance(parent.arg, jinja2.nodes.Const)
            and parent.arg.value == 0
        )
        if read and not first:
            return False
    return True


def _neighbour(arg: jinja2.nodes.Node) -> bool:
    """`loop.index0 - 1` or `loop.index0 + 1`."""
    return (
        isinstance(arg, jinja2.nodes.Add | jinja2.nodes.Sub)
        and isinstance(arg.left, jinja2.nodes.Getattr)
        and isinstance(arg.left.node, jinja2.nodes.Name)
        and arg.left.node.name == "loop"
        and arg.left.attr == "index0"
        and isinstance(arg.right, jinja2.nodes.Const)
        and arg.right.value == 1
    )


def _body_ok(node: jinja2.nodes.Node, names: set[str], outer: jinja2.nodes.For) -> bool:
    """In the loop's body: the messages only as their neighbours, `loop` only by its position, no
    namespace assignment; `loop` inside a nested for is that loop's own."""
    stack: list[tuple[jinja2.nodes.Node | None, jinja2.nodes.Node, bool]] = [(None, node, False)]
    while stack:
        parent, child, nested = stack.pop()
        if isinstance(child, jinja2.nodes.NSRef):
            return False
        if isinstance(child, jinja2.nodes.Name) and child.ctx == "load":
            if child.name in names:
                if nested or not (
                    isinstance(parent, jinja2.nodes.Getitem)
                    and parent.node is child
                    and _neighbour(parent.arg)
                ):
                    return False
            elif child.name == "loop" and not nested and not _position(parent):
                return False
        if isinstance(child, jinja2.nodes.Name) and child.ctx != "load" and child.name in names:
            return False
        for grandchild in child.iter_child_nodes():
            inner = nested or (isinstance(child, jinja2.nodes.For) and grandchild is not child.iter)
            stack.append((child, grandchild, inner))
    return True


def _position(parent: jinja2.nodes.Node | None) -> bool:
    """`loop.index0`, `index`, `first` or `last`."""
    return isinstance(parent, jinja2.nodes.Getattr) and parent.attr in _LOOP_ATTRS


def _reads(node: jinja2.nodes.Node, names: set[str]) -> bool:
    return any(isinstance(n, jinja2.nodes.Name) and n.name in names for _, n in _children(node))


def _safe_everywhere(ast: jinja2.nodes.Template, names: set[str], aliases: set[int]) -> bool:
    """No stateful global, no include / import / block, no macro or call block that reads the messages,
    and the messages never reassigned (the alias `set`s before the loop aside)."""
    for parent, child in _children(ast):
        if isinstance(child, jinja2.nodes.Extends | jinja2.nodes.Include | jinja2.nodes.Import):
            return False
        if isinstance(child, jinja2.nodes.FromImport | jinja2.nodes.Block):
            return False
        if isinstance(child, jinja2.nodes.Name) and child.name in _STATEFUL:
            return False
        if isinstance(child, jinja2.nodes.Macro) and _reads(child, names | {"loop"}):
            return False
        if isinstance(child, jinja2.nodes.CallBlock) and _reads(child, names):
            return False
        reassigned = isinstance(child, jinja2.nodes.Name) and child.ctx != "load" and child.name in names
        if reassigned and id(parent) not in aliases:
            return False
    return True


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


# fields of a message that template_messages changes when they are strings
_REWRITTEN = frozenset({"tool_calls", "reasoning_content", "reasoning"})


def plain_messages(messages: list[Any]) -> bool:
    """Whether every message is a dict of strings with a role and none of the fields template_messages
    rewrites (the usual chat): then each is as the template sees it. Checked without a Python loop per
    message (a 30k-token chat has ~70; the loop took ~0.1-0.2 ms of a warm round, docs/BENCHMARKS.md)."""
    return (
        set(map(type, messages)) == {dict}
        and set(map(type, chain.from_iterable(map(dict.values, messages)))) == {str}
        and all(map(dict.__contains__, messages, ["role"] * len(messages)))
        and _REWRITTEN.isdisjoint(chain.from_iterable(messages))
    )


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI `messages` as the template sees them (see the module docstring)."""
    return _template_messages(messages)[0]


def _template_messages(messages: Any) -> tuple[list[dict[str, Any]], bool]:
    """template_messages, and whether the messages were plain (`plain_messages`)."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages: must be a non-empty list")
    if plain_messages(messages):
        return list(map(dict, messages)), True
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
    return out, False


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
        self,
        template: jinja2.Template,
        body: Mapping[str, Any],
        specials: Mapping[str, str],
        start: int = 0,
    ) -> None:
        """`start`: with a template from `compile_from`, render the messages from this one on (the text
        before it, the loop's, is left out); `marks` then gets where each rendered message's text starts
        in the output (message index -> characters)."""
        messages, self.plain = _template_messages(body.get("messages"))  # plain: every value a string
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
        self.messages = messages
        self.length = 0  # characters generated so far
        self.marks: dict[int, int] = {}
        self.context: dict[str, Any] = {
            **specials,
            **kwargs,
            "messages": messages,
            "tools": template_tools(body.get("tools")),
            "documents": documents,
            "add_generation_prompt": bool(add_gen),
            FROM_VAR: start,
            MARK_VAR: self._mark,
        }

    def _mark(self, index: int) -> str:
        # called as the template generates, so self.length is what was generated before this message
        self.marks[index] = self.length
        return ""

    def parts(self) -> Iterator[str]:
        try:
            for part in self.template.generate(**self.context):
                self.length += len(part)
                yield part
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from None

    def finish(self, text: str) -> str:
        if self.cont:
            at = text.rfind(CONTINUE_TAG.strip())
            if at < 0 or self.final.strip() not in text:
                raise TemplateError("continue_final_message: the template dropped the final message")
            text = text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
        return text
