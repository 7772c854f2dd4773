"""policy/request.py: every body either fails its shape check with an InvalidRequest, or renders.

The renderers take only checked bodies and do no checks of their own, so a shape the check lets
through but the renderer cannot render would be a 500 at the gateway; hypothesis looks for one.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from policy.request import (
    InvalidRequest,
    canonical_text,
    chat_text,
    check_chat,
    check_completion,
    completion_text,
)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-5, max_value=5) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=12,
)
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "input_text", "image_url", "input_audio", 7])},
    optional={"text": JSON, "image_url": JSON | st.fixed_dictionaries({"url": JSON})},
)
CALL = st.fixed_dictionaries(
    {}, optional={"id": JSON, "function": st.fixed_dictionaries({"name": JSON}) | JSON}
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bad", 3])},
    optional={
        "content": JSON | st.text() | st.lists(PART | JSON, max_size=3),
        "name": JSON,
        "tool_call_id": JSON,
        "tool_calls": st.lists(CALL | JSON, max_size=2) | JSON,
        "reasoning_content": JSON,
    },
)
CHAT = st.fixed_dictionaries(
    {}, optional={"messages": st.lists(MESSAGE | JSON, max_size=3) | JSON, "tools": JSON}
)
COMPLETION = st.fixed_dictionaries(
    {},
    optional={
        "prompt": JSON
        | st.lists(st.integers(0, 9), max_size=4)
        | st.lists(st.lists(st.integers(0, 9), max_size=3))
    },
)


CASES = st.one_of(
    CHAT.map(lambda body: (check_chat, chat_text, body)),
    COMPLETION.map(lambda body: (check_completion, completion_text, body)),
)


@settings(max_examples=900, deadline=None)
@given(case=CASES)
def test_a_body_is_refused_or_rendered(
    case: tuple[Callable[..., None], Callable[..., str], dict[str, object]],
) -> None:
    check, render, body = case
    try:
        check(body)
    except InvalidRequest as e:
        assert e.status == 400 and e.code
        return
    assert render(body) == canonical_text(body)


def test_limits_give_413_and_too_many_messages() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 10}] * 3}
    for kwargs, status, code in [
        ({"max_prompt_chars": 29}, 413, "prompt_too_large"),
        ({"max_messages": 2}, 400, "too_many_messages"),
    ]:
        try:
            check_chat(body, **kwargs)
        except InvalidRequest as e:
            assert (e.status, e.code) == (status, code)
        else:
            raise AssertionError(f"{kwargs} let the body through")
    check_chat(body, max_prompt_chars=30, max_messages=3)
