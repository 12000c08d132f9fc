"""Image-text rows for vision-language models (training/vision_records.py, vision_data.py, hf/processing.py): each row
is what transformers' processor and the checkpoint's chat template give (ids, every pixel and per-token tensor), the
labels exactly the assistant tokens (transformers' own assistant mask where the template has generation markers, the
assistant turns' text otherwise), never an image token; TRL's record forms and a datasets.Dataset read alike; the
collator; every bad input refused with its file and line before training.

    .venv-vision/bin/python -m pytest tests/test_vision_data.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.chat import write_jsonl
from tests.helpers.vision_data import chat_records, vision_checkpoint, write_images

pytestmark = pytest.mark.vision
TYPES = ("qwen2_5_vl", "llava")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{model_type: checkpoint directory}, the data directory (images/, data.jsonl) and its records."""
    root = tmp_path_factory.mktemp("vision")
    images = write_images(root / "images")
    records = chat_records([str(p.relative_to(root)) for p in images])
    write_jsonl(root / "data.jsonl", records)
    return {t: vision_checkpoint(root / t, t) for t in TYPES}, root, records


def _dataset(files, model_type, source=None, **kw):
    from tptrain.training.vision_data import build_vision_data, vision_encoder

    checkpoints, root, _ = files
    encoder = vision_encoder(checkpoints[model_type], assistant_only_loss=kw.pop("assistant_only_loss", True))
    config = _config(checkpoints[model_type])
    return build_vision_data(source or str(root / "data.jsonl"), encoder, config=config, **{"seq_len": 256, **kw})


def _config(path):
    import transformers
    return transformers.AutoConfig.from_pretrained(path)


def _transformers_messages(chat):
    """The record as transformers' processor takes it: each image item carrying its (decoded) image."""
    from PIL import Image

    images = iter(chat.images)
    return [{**m, "content": [{"type": "image", "image": Image.open(next(images))} if c["type"] == "image" else c
                              for c in m["content"]]} for m in chat.messages]


@pytest.mark.parametrize("model_type", TYPES)
def test_rows_are_the_processors_and_labels_the_assistant_tokens(files, model_type):
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(files[0][model_type])
    data = _dataset(files, model_type)
    assert (data.num_samples, data.num_images, data.num_truncated) == (5, 5, 0)
    for index, row in enumerate(data.rows):
        chat = data.records[index]
        want = processor.apply_chat_template(_transformers_messages(chat), tokenize=True, return_dict=True,
                                             return_tensors="pt", return_assistant_tokens_mask=True)
        mask = want.pop("assistant_masks")[0].bool()
        assert set(row) == {*want, "labels"}, index
        for key, value in want.items():
            value = value[0] if value.dim() == 2 and value.shape == (1, row["input_ids"].numel()) else value
            assert torch.equal(row[key], value), (index, key)
        targets = row["labels"] != -100
        assert torch.equal(row["labels"][targets], row["input_ids"][targets])
        assert not (targets & (row["input_ids"] == processor.image_token_id)).any()
        if mask.any():  # generation markers (LLaVA's template): transformers' assistant mask, bar the first token
            mask[0] = False
            assert torch.equal(targets, mask), index
        else:  # Qwen's template has none: the assistant turns' text and their end, found turn by turn
            turns = [c["text"] for m in chat.messages if m["role"] == "assistant" for c in m["content"]]
            assert processor.tokenizer.decode(row["input_ids"][targets]) == "".join(t + "<|im_end|>\n" for t in turns)
            starts = [i for i in range(1, len(targets)) if targets[i] and not targets[i - 1]]
            assert len(starts) == len(turns) and all(processor.tokenizer.decode(row["input_ids"][:i]).endswith(
                "<|im_start|>assistant\n") for i in starts)


def test_every_token_but_image_tokens_without_assistant_only_loss(files):
    data = _dataset(files, "qwen2_5_vl", assistant_only_loss=False)
    row = data[0]
    image = data.encoder.multimodal_tokens(row["input_ids"])
    assert image.sum() == 4 and torch.equal(row["labels"] != -100, ~image & (torch.arange(len(image)) > 0))


def test_trl_forms_and_a_datasets_dataset_give_the_same_rows(files):
    import datasets
    from PIL import Image

    _, root, records = files
    data = _dataset(files, "qwen2_5_vl")
    # {"images", "messages" with string contents}: TRL puts the images at the start of the first user turn
    assert data.records[2].messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    assert data.records[4].images == [root / "images/image0.png", root / "images/image2.png"]
    listed = [{**r, "images": [str(root / p) for p in r["images"]]} for r in (records[1], records[4])]
    table = datasets.Dataset.from_list([{"images": [Image.open(root / p) for p in r["images"]],
                                         "messages": r["messages"]} for r in listed])
    for source in (listed, table):
        rows = _dataset(files, "qwen2_5_vl", source=source).rows
        for got, want in zip(rows, (data[1], data[4]), strict=True):
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_micro_batch_pads_tokens_and_joins_the_images(files):
    from tptrain.training.sft_data import collate

    for model_type in TYPES:
        data = _dataset(files, model_type)
        rows = data.rows
        batch = collate(rows, pad_id=7, multiple=4)
        longest = max(r["input_ids"].numel() for r in rows)
        assert batch["input_ids"].shape == (5, -(-longest // 4) * 4) and "position_ids" not in batch
        for i, row in enumerate(rows):
            n = row["input_ids"].numel()
            assert torch.equal(batch["input_ids"][i, :n], row["input_ids"]) and (batch["input_ids"][i, n:] == 7).all()
            assert (batch["labels"][i, n:] == -100).all() and batch["attention_mask"][i].sum() == n
        images = [r["pixel_values"] for r in rows if "pixel_values" in r]
        assert torch.equal(batch["pixel_values"], torch.cat(images))  # the text-only row adds none


def test_a_long_row_loses_its_text_tail_never_an_image_token(files):
    data = _dataset(files, "qwen2_5_vl", seq_len=50)
    assert data.num_truncated == 3 and all(r["input_ids"].numel() <= 50 for r in data.rows)
    with pytest.raises(ValueError, match=r"data.jsonl line 1 has 51 tokens, more than seq_len=50"):
        _dataset(files, "qwen2_5_vl", seq_len=50, truncation="error")


# ------------------------------------------------------------------ bad input: named by file and line, before training


def _bad(files, tmp_path, records, match, model_type="qwen2_5_vl", **kw):
    _, root, _ = files
    path = write_jsonl(root / f"bad-{tmp_path.name}.jsonl", records)
    with pytest.raises(ValueError, match=match):
        _dataset(files, model_type, source=str(path), **kw)


def test_an_image_that_does_not_exist_or_decode(files, tmp_path):
    _, root, records = files
    missing = {"images": ["images/nowhere.png"], "messages": records[1]["messages"]}
    _bad(files, tmp_path, [records[0], missing], r"line 2: image 'images/nowhere.png' does not exist \(looked for "
                                                 r".*images/nowhere.png")
    (root / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    broken = {"images": ["images/broken.png"], "messages": records[1]["messages"]}
    _bad(files, tmp_path, [records[3], records[0], broken], r"line 3: image .*broken.png does not decode as an image")


def test_placeholders_and_images_must_pair_up(files, tmp_path):
    _, _, records = files
    two = {"images": records[1]["images"], "messages": records[4]["messages"]}  # 2 placeholders, 1 image
    _bad(files, tmp_path, [two], r"line 1 has more image placeholders than images: 2 image items, 1 image\(s\)")
    extra = {"images": records[4]["images"], "messages": records[1]["messages"]}  # 1 placeholder, 2 images
    _bad(files, tmp_path, [records[3], extra], r"line 2 has more images than image placeholders: 1 of the 2")


def test_an_image_too_large_for_seq_len_names_the_processor_setting(files, tmp_path):
    _, _, records = files
    # image1 (32 x 24 pixels) makes 12 tokens from position 22: seq_len 30 would cut them
    _bad(files, tmp_path, [records[1]], r"line 1 has 58 tokens, 12 of them for its 1 image\(s\) \(32x24 pixels\) at the "
                                        r"processor's size limits, Qwen2VLImageProcessor's size=\{.*'longest_edge': "
                                        r"1024.*max_pixels.*seq_len=30 would cut", seq_len=30)


def test_packing_is_refused_for_image_text_rows(files):
    with pytest.raises(ValueError, match=r"packing .* qwen2_5_vl computes its multimodal rotary positions"):
        _dataset(files, "qwen2_5_vl", packing=True)
    with pytest.raises(ValueError, match=r"packing .* llava's forward takes one sample per row"):
        _dataset(files, "llava", packing=True)


def test_a_checkpoint_without_a_processor(files, tmp_path):
    from tptrain.training.vision_data import vision_encoder

    bare = vision_checkpoint(tmp_path / "bare", "llava", processor=False)
    with pytest.raises(ValueError, match=rf"{bare} holds no processor \(no preprocessor_config.json or "
                                         r"processor_config.json\)"):
        vision_encoder(bare)


def test_image_records_for_a_text_only_checkpoint(files, tmp_path):
    from tests.helpers.chat import CHATML_GENERATION, chat_checkpoint
    from tptrain.text import load_tokenizer
    from tptrain.training.sft_data import build_training_data, scan_data_file

    _, root, records = files
    model_dir = chat_checkpoint(tmp_path / "text", CHATML_GENERATION)
    text = [{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}]
    path = write_jsonl(root / "mixed.jsonl", text + records[1:2])
    with pytest.raises(ValueError, match=r"mixed.jsonl line 2 holds images, but the model being trained reads text"):
        scan_data_file(path)  # `tptrain train`'s check before any worker starts
    with pytest.raises(ValueError, match=r"record 1 holds images, but the model being trained reads text only"):
        build_training_data(text + records[1:2], load_tokenizer(model_dir), 64, model_dir=model_dir)
