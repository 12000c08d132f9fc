"""SFT records -> tokens and label masks, checked token by token against transformers on the same template."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.chat import CHATML_GENERATION, CHATS, QWEN3, chat_checkpoint
from tptrain.losses import IGNORE_INDEX
from tptrain.text import load_chat_template, load_tokenizer
from tptrain.training.sft_data import SampleEncoder, build_sft_dataset, collate, read_records

transformers = pytest.importorskip("transformers")


def _setup(tmp_path, template):
    model_dir = chat_checkpoint(tmp_path / "ckpt", template)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    return model_dir, hf, load_tokenizer(model_dir), load_chat_template(model_dir)


def _encode(tokenizer, template, record, **kw):
    return SampleEncoder(tokenizer, chat_template=template, **kw)(record, 0)


def test_generation_markers_match_transformers_assistant_mask(tmp_path):
    _, hf, tok, template = _setup(tmp_path, CHATML_GENERATION)
    for chat in CHATS:
        out = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        sample = _encode(tok, template, {"messages": chat})
        assert sample.input_ids == list(out["input_ids"])
        expected = [i if m else IGNORE_INDEX for i, m in zip(out["input_ids"], out["assistant_masks"])]
        expected[0] = IGNORE_INDEX  # a sample's first token is never a target
        assert sample.labels == expected
        assert sum(out["assistant_masks"]) > 0
        # the targets are exactly the assistant contents and their end-of-turn tokens
        targets = hf.decode([i for i in sample.labels if i != IGNORE_INDEX])
        assert targets == "".join(m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant")


def test_qwen3_template_spans_by_prefix_rendering(tmp_path):
    _, hf, tok, template = _setup(tmp_path, QWEN3)
    assert not template.has_generation_markers
    for chat in CHATS:
        full = hf.apply_chat_template(chat, tokenize=False)
        enc = hf(full, add_special_tokens=False)
        ids = hf.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        assert list(enc["input_ids"]) == list(ids)
        mask = [0] * len(ids)
        last = max(i for i, m in enumerate(chat) if m["role"] == "assistant")
        for i, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            start = len(hf.apply_chat_template(chat[:i], tokenize=False, add_generation_prompt=True))
            turn = ("<think>\n\n</think>\n\n" if i == last else "") + message["content"] + "<|im_end|>\n"
            assert full[start:start + len(turn)] == turn
            for t in range(enc.char_to_token(start), enc.char_to_token(start + len(turn) - 1) + 1):
                mask[t] = 1
        sample = _encode(tok, template, {"messages": chat})
        assert sample.input_ids == list(ids)
        expected = [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]
        expected[0] = IGNORE_INDEX
        assert sample.labels == expected


def test_no_assistant_only_loss_and_prompt_completion(tmp_path):
    _, hf, tok, template = _setup(tmp_path, CHATML_GENERATION)
    chat = CHATS[1]
    sample = _encode(tok, template, {"messages": chat}, assistant_only_loss=False)
    assert sample.labels == [IGNORE_INDEX] + sample.input_ids[1:]
    # strings: loss on the completion and the eos after it
    sample = _encode(tok, template, {"prompt": "To be, or", "completion": " not to be"})
    prompt_ids, completion_ids = hf.encode("To be, or", add_special_tokens=False), hf.encode(" not to be",
                                                                                            add_special_tokens=False)
    assert sample.input_ids == prompt_ids + completion_ids + [tok.eos_token_id]
    assert sample.labels == [IGNORE_INDEX] * len(prompt_ids) + completion_ids + [tok.eos_token_id]
    # conversational: the completion is what follows the prompt's generation prompt
    prompt, completion = chat[:-1], chat[-1:]
    sample = _encode(tok, template, {"prompt": prompt, "completion": completion})
    ids = hf.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    n_prompt = len(hf.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)[
        "input_ids"])
    assert sample.input_ids == list(ids)
    assert sample.labels == [IGNORE_INDEX] * n_prompt + list(ids[n_prompt:])


def test_packing_rows_positions_and_truncation(tmp_path, capsys):
    model_dir, _, tok, template = _setup(tmp_path, CHATML_GENERATION)
    records = [{"messages": c} for c in CHATS] + [{"text": "Ham. To be"}, {"prompt": "a", "completion": "b"}]
    samples = [SampleEncoder(tok, chat_template=template)(r, i) for i, r in enumerate(records)]
    lengths = [len(s.input_ids) for s in samples]
    seq_len = max(lengths) + 4
    packed = build_sft_dataset(("recs", records), tok, seq_len, chat_template=template)
    assert all(row["input_ids"].numel() == seq_len for row in packed.rows)
    assert packed.num_truncated == 0 and packed.num_samples == len(records)
    flat_ids = torch.cat([r["input_ids"][r["labels"] != IGNORE_INDEX] for r in packed.rows]).tolist()
    assert flat_ids == [t for s in samples for t in s.labels if t != IGNORE_INDEX]
    starts = [int((r["position_ids"] == 0).sum()) for r in packed.rows]
    assert sum(starts) >= len(records)  # every sample (and each row's padding) starts at position 0
    unpacked = build_sft_dataset(("recs", records), tok, seq_len, chat_template=template, packing=False)
    assert [r["input_ids"].numel() for r in unpacked.rows] == lengths
    batch = collate([unpacked[0], unpacked[1]], pad_id=tok.eos_token_id, multiple=4)
    assert batch["input_ids"].shape[1] == -(-max(lengths[:2]) // 4) * 4
    assert (batch["labels"][0, lengths[0]:] == IGNORE_INDEX).all()
    assert batch["position_ids"][0].tolist() == list(range(batch["input_ids"].shape[1]))
    short = build_sft_dataset(("recs", records), tok, 8, chat_template=template)
    assert short.num_truncated == sum(n > 8 for n in lengths)
    with pytest.raises(ValueError, match=r"record 0 has \d+ tokens, more than seq_len=8"):
        build_sft_dataset(("recs", records), tok, 8, chat_template=template, truncation="error")


def test_read_records_formats(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in CHATS) + "\n")
    name, records = read_records(path)
    assert name == str(path) and len(records) == 3
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "plain"}) + "\n")
    assert read_records(text) is None  # plain language modelling: training/data.py's blocks
    assert read_records(["a", "b"]) is None
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}])
    assert read_records(ds)[1] == [{"prompt": "a", "completion": "b"}]


def test_bad_records_raise_clear_errors(tmp_path):
    model_dir, _, tok, template = _setup(tmp_path, CHATML_GENERATION)
    build = lambda recs, **kw: build_sft_dataset(("data.jsonl", recs), tok, 64, chat_template=template, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"record 1 \(\['question'\]\) matches no format"):
        build([{"text": "ok"}, {"question": "?"}])
    with pytest.raises(ValueError, match="is empty"):
        build([])
    with pytest.raises(ValueError, match=r"record 0: messages\[1\] has the unknown role 'robot'"):
        build([{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}])
    with pytest.raises(ValueError, match="no target token at all"):
        build([{"messages": [{"role": "user", "content": "hi"}]}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_records(empty) or build_sft_dataset((str(empty), []), tok, 64)
    bare = chat_checkpoint(tmp_path / "bare", None)
    with pytest.raises(ValueError, match="has no chat template.*--chat-template FILE"):
        load_chat_template(bare)
    override = tmp_path / "t.jinja"
    override.write_text(CHATML_GENERATION)
    assert load_chat_template(bare, override).has_generation_markers
    with pytest.raises(ValueError, match="record 0 is a chat .* no chat template"):
        build_sft_dataset(("d", [{"messages": CHATS[0]}]), tok, 64)
