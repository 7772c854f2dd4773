"""A small model directory made on the spot: a byte-level BPE `tokenizer.json` trained with the
`tokenizers` trainer on generated text, and a `tokenizer_config.json` with a real chat template
(Llama 3 Instruct's or Qwen 2.5's, tools included). Nothing is downloaded; the same seed gives the
same files. Tests, `kvgate bench tokenize` and the emulated workers (`--tokenizer DIR`) use it.
"""

from __future__ import annotations

# ruff: noqa: E501  (the chat templates are quoted as their models ship them)
import json
import random
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# meta-llama/Meta-Llama-3-8B-Instruct's chat template
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen/Qwen2.5-7B-Instruct's chat template (tools, tool calls, tool responses)
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TEMPLATES = {"llama3": LLAMA3_TEMPLATE, "qwen25": QWEN25_TEMPLATE}
SPECIALS = {
    "llama3": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
    "qwen25": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(seed: int, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 8))) for _ in range(n)]


def sentence(rng: random.Random, vocab: list[str], n_words: int) -> str:
    """Generated text in the trained tokenizer's domain (about 1.3 words per token)."""
    return " ".join(rng.choice(vocab) for _ in range(n_words)).capitalize() + "."


def build(
    directory: str | Path,
    flavour: str = "llama3",
    seed: int = 7,
    vocab_size: int = 6000,
    extra_corpus: Sequence[str] = (),
) -> Path:
    """Write tokenizer.json + tokenizer_config.json for `flavour` (llama3 | qwen25) into `directory`;
    `extra_corpus` is trained on too (e.g. indented text, so that runs of spaces get tokens of their own)."""
    if flavour not in TEMPLATES:
        raise ValueError(f"unknown flavour {flavour!r}; known: {', '.join(TEMPLATES)}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng, vocab = random.Random(seed), words(seed)
    corpus = [sentence(rng, vocab, 60) + ' {"name": "get_weather", "arguments": {}}\n' for _ in range(800)]
    corpus += extra_corpus
    specials = SPECIALS[flavour]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    bos = specials[0] if flavour == "llama3" else None
    if bos is not None:  # Llama 3: the post-processor adds BOS (completions add special tokens)
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATES[flavour],
        "bos_token": bos,
        "eos_token": "<|eot_id|>" if flavour == "llama3" else "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out
