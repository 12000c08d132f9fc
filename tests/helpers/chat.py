"""The SFT tests' chats: a ChatML tokenizer (the bundled one plus <|im_start|>/<|im_end|>), chat templates, random
chat records, a transformers-written checkpoint to fine-tune with `tptrain train`, and what its exports give in
peft + transformers."""
from __future__ import annotations

import json
import random
import shutil
from importlib.resources import files
from pathlib import Path

import torch

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


WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()


def chat_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)

    def say(k):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, k)))

    out = []
    for i in range(n):
        chat = [{"role": "user", "content": say(6)}, {"role": "assistant", "content": say(10)}]
        if i % 3 == 0:
            chat += [{"role": "user", "content": say(4)}, {"role": "assistant", "content": say(6)}]
        out.append({"messages": chat} if i % 4 else {"prompt": say(5), "completion": " " + say(8)})
    return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------ `tptrain train` fine-tuning (test_sft_cli.py,
# test_pipeline_save.py)

SFT_TINY = dict(vocab_size=4160, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


def sft_checkpoint(tmp_path):
    """A transformers-written Qwen3 checkpoint with the ChatML tokenizer and a {% generation %} chat template."""
    import transformers

    directory = chat_checkpoint(tmp_path / "ckpt", CHATML_GENERATION)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SFT_TINY))
    hf.save_pretrained(directory)
    return directory


def exported_logits(ckpt, adapter, merged) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, the base checkpoint's logits, peft's with the exported adapter on it, the merged checkpoint's), in
    transformers, fp32."""
    import peft
    import transformers

    ids = torch.randint(0, 4098, (2, 12), generator=torch.Generator().manual_seed(5))
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        folded = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(ids).logits
    assert (adapted - plain).abs().max() > 1e-3  # the adapter trained
    torch.testing.assert_close(folded, adapted, rtol=1e-5, atol=1e-5)
    return ids, plain, adapted, folded
