"""Fixtures of the SFT tests: a ChatML tokenizer (the bundled one plus <|im_start|>/<|im_end|>) and chat templates."""
from __future__ import annotations

import json
import shutil
from importlib.resources import files
from pathlib import Path

BUNDLED = Path(str(files("tptrain") / "data" / "tiny-qwen3"))

# ChatML with {% generation %} around what the assistant writes (as TRL's training templates).
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Qwen3's template (no generation markers; the final assistant turn gets an empty think block).
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

CHATS = [
    [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "Shakespeare, around 1600."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "To be?"},
     {"role": "assistant", "content": "Or not to be."}, {"role": "user", "content": "That is the question."},
     {"role": "assistant", "content": "Whether 'tis nobler in the mind."}],
    [{"role": "user", "content": "Count: one, two"}, {"role": "assistant", "content": "three, four, five"},
     {"role": "user", "content": "and?"}, {"role": "assistant", "content": "six"}],
]


def chat_checkpoint(directory: Path, template: str | None, *, config: dict | None = None) -> Path:
    """A checkpoint directory with the ChatML tokenizer (vocab 4098), `template` in tokenizer_config.json and
    the bundled config.json (vocab_size raised to 4160 so the model can hold the new ids), or `config`."""
    from tokenizers import AddedToken, Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(directory / "tokenizer.json"))
    tok_config = json.loads((BUNDLED / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = "<|im_end|>"
    if template is not None:
        tok_config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if config is None:
        config = json.loads((BUNDLED / "config.json").read_text())
        config["vocab_size"] = 4160
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def copy_bundled(directory: Path) -> Path:
    shutil.copytree(BUNDLED, directory)
    return directory
