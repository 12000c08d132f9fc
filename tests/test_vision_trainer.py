"""The Trainer on a vision-language model: image-text chat records (a .jsonl beside its images) through the
checkpoint's processor, at tp 2 on two processes, give the losses (3 steps, then the eval loss) of transformers' own
model trained on one process on the same batches (fp64; transformers computes its loss in fp32); a record whose image
does not decode is refused on every rank before training; `tptrain train` runs such a checkpoint end to end.

    .venv-vision/bin/python -m pytest tests/test_vision_trainer.py -q
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.chat import write_jsonl
from tests.helpers.launch import tptrain_train
from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.vision_data import chat_records, vision_checkpoint, write_images

pytestmark = pytest.mark.vision
TYPES = ("qwen2_5_vl", "llava")
TOL = dict(rtol=1e-6, atol=1e-6)  # transformers' loss in fp32, tptrain's in fp64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    images = write_images(root / "images")
    records = chat_records([str(p.relative_to(root)) for p in images])
    write_jsonl(root / "data.jsonl", records * 2)
    write_jsonl(root / "eval.jsonl", records)
    (root / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    write_jsonl(root / "broken.jsonl", [records[0], {**records[1], "images": ["images/broken.png"]}])
    return {t: vision_checkpoint(root / t, t) for t in TYPES}, root


def _args(output_dir):
    from tptrain.training.args import TrainingArguments

    return TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=3, max_steps=3, seq_len=128,
                             learning_rate=1e-3, warmup_steps=1, max_grad_norm=1.0, seed=3)


def _train(checkpoints: dict, root) -> None:
    from tptrain import AutoModelForImageTextToText, DistributedConfig, Trainer

    for model_type, path in checkpoints.items():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64,
                                                            distributed_config=DistributedConfig(tp_size=2))
        with pytest.raises(ValueError, match=r"broken.jsonl line 2: image .*broken.png does not decode"):
            Trainer(model=model, args=_args(root / "refused"), train_dataset=str(root / "broken.jsonl"))  # each rank
        trainer = Trainer(model=model, args=_args(root / f"run-{model_type}"), train_dataset=str(root / "data.jsonl"))
        losses = trainer.train().losses
        evaluated = trainer.evaluate(str(root / "eval.jsonl"))["eval_loss"]  # in batches of 3 rows
        if torch.distributed.get_rank() == 0:
            (root / f"{model_type}.json").write_text(json.dumps([losses, evaluated]))


@pytest.mark.distributed
def test_tp2_trainer_equals_transformers_on_one_process(files):
    import transformers
    from tptrain.training.vision_data import build_vision_data, collate_vision, vision_encoder

    checkpoints, root = files
    run_distributed(_train, 2, checkpoints, root, timeout=400)
    for model_type, path in checkpoints.items():
        hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64).train()
        encoder = vision_encoder(path)
        rows = build_vision_data(str(root / "data.jsonl"), encoder, seq_len=128, config=hf.config)
        want = reference_losses(hf, rows, _args(root / "unused"), 3,
                                collate_rows=lambda batch: collate_vision(batch, pad_id=encoder.eos_token_id))
        got, evaluated = json.loads((root / f"{model_type}.json").read_text())
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), **TOL,
                                   msg=lambda m: f"{model_type}: {m}")
        with torch.no_grad():  # the trained reference, every eval row in one batch: the mean over their targets
            held = build_vision_data(str(root / "eval.jsonl"), encoder, seq_len=128, config=hf.config).rows
            want_eval = hf.eval()(**collate_vision(held, pad_id=encoder.eos_token_id)).loss.item()
        assert abs(evaluated - want_eval) < 1e-6, (model_type, evaluated, want_eval)
        assert (root / f"run-{model_type}" / "final" / "processor_config.json").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_tptrain_train_runs_a_vision_language_checkpoint(files, tmp_path):
    checkpoints, root = files
    out = tptrain_train("--model", str(checkpoints["qwen2_5_vl"]), "--data", str(root / "data.jsonl"), "--tp-size",
                        "2", "--seq-len", "128", "--output-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "qwen2_5_vl loaded from" in out.stdout and "10 samples (10 images, " in out.stdout
    assert "greedy reply to " in out.stdout and "data.jsonl line 1 (1 image(s)): '<image> What is in the picture?'" \
        in out.stdout
    assert (tmp_path / "run" / "final" / "processor_config.json").is_file()
    refused = tptrain_train("--model", str(checkpoints["qwen2_5_vl"]), "--data", str(root / "data.jsonl"),
                            "--packing", "--output-dir", str(tmp_path / "packed"))
    assert refused.returncode == 2 and "--packing is not available for image-text rows: qwen2_5_vl computes" in \
        refused.stderr
