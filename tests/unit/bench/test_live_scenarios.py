"""TenantPromptsScenario sized in a tokenizer's own tokens (bench/exact_demo.py's prompts)."""

from __future__ import annotations

from bench.emulator.tokenizer import count_tokens
from bench.live_scenarios import TenantPromptsScenario


def two_chars_per_token(text: str) -> int:  # a tokenizer that makes one token of two characters
    return -(-len(text) // 2)


def test_the_fake_tokenizer_keeps_the_scenario_as_it_was() -> None:
    scenario = TenantPromptsScenario(requests=20)
    sized = scenario.sized_for(count_tokens)
    assert sized.chars_per_token == scenario.chars_per_token
    assert [r.body for r in sized.build()] == [r.body for r in scenario.build()]
    assert abs(scenario.working_set_tokens(count_tokens) - scenario.working_set_tokens()) < 0.01 * (
        scenario.working_set_tokens()
    )


def test_prompts_have_system_tokens_of_the_given_tokenizer() -> None:
    scenario = TenantPromptsScenario(requests=20)
    assert scenario.working_set_tokens(two_chars_per_token) > 1.9 * scenario.working_set_tokens()
    sized = scenario.sized_for(two_chars_per_token)
    per_prompt = [two_chars_per_token(p) for p in sized.system_prompts()]
    assert all(abs(n - scenario.system_tokens) < 0.02 * scenario.system_tokens for n in per_prompt)
    assert abs(sized.working_set_tokens(two_chars_per_token) - scenario.working_set_tokens()) <= 0.01 * (
        scenario.working_set_tokens()
    )
    body = sized.build()[0].body
    assert body["messages"][0]["content"] in sized.system_prompts()  # type: ignore[index]
