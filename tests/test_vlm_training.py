"""The Trainer on a vision-language model over data-parallel ranks, and its checkpoints across layouts (fp64, CPU/gloo):

- FSDP2 at tp 2 x dp_shard 2 and HSDP at dp_replicate 2 x dp_shard 2, each dp rank its own rows (images or text
  only), give transformers' own training on one process: 3 AdamW steps' losses and the final weights, the tower's
  included. The steps cover two ranks with different images, a rank with an image beside a text-only one (the
  tower reached on one dp rank only: training/input_reach.py), a step without any image (the tower skipped by
  AdamW, as on one process), and LLaVA's last CLIP layer, which no input reaches;
- resumable checkpoints saved at tp 2 resume at tp 1 x dp 2 and back, with the uninterrupted run's losses;
- sequence parallelism is refused by the rule table, naming why.

    .venv-vision/bin/python -m pytest tests/test_vlm_training.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.chat import write_jsonl
from tests.helpers.vision_data import chat_records, vision_checkpoint, write_images

pytestmark = pytest.mark.vision
TYPES = ("qwen2_5_vl", "llava")
TOL = dict(rtol=1e-6, atol=1e-6)  # transformers' loss and norms in fp32, tptrain's sums in another order
WEIGHTS_TOL = dict(rtol=1e-5, atol=1e-5)  # AdamW divides by sqrt(v): a near-zero gradient's rounding, magnified
SEED = 1  # DataOrder's seed: its three global batches of two rows cover the cases above (asserted)
TEXT_ONLY = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
             for q, a in (("Say hello.", "Hello there."), ("Count to three.", "One, two, three."),
                          ("Name a colour.", "Blue."))]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """({model_type: checkpoint}, root): six rows, three with images (one of them two) and three text-only."""
    root = tmp_path_factory.mktemp("vlm_training")
    images = write_images(root / "images")
    records = chat_records([str(p.relative_to(root)) for p in images])
    write_jsonl(root / "data.jsonl", [records[0], records[1], records[4], *TEXT_ONLY])
    return {t: vision_checkpoint(root / t, t) for t in TYPES}, root


def _args(output_dir, tp: int, *, shard: int = 1, replicate: int = 1, **kw):
    from tptrain.training.args import ParallelismConfig, TrainingArguments

    settings = dict(per_device_train_batch_size=1, max_steps=3, seq_len=128, learning_rate=1e-3, weight_decay=0.1,
                    warmup_steps=1, max_grad_norm=1.0, seed=SEED,
                    parallelism_config=ParallelismConfig(tp, dp_shard_size=shard, dp_replicate_size=replicate))
    return TrainingArguments(output_dir=str(output_dir), **{**settings, **kw})


LAYOUTS = {"fsdp": dict(tp=2, shard=2), "hsdp": dict(tp=1, shard=2, replicate=2)}


def _train_worker(checkpoints: dict, root: Path) -> None:
    from tptrain import AutoModelForImageTextToText, DistributedConfig, Trainer

    for model_type, path in checkpoints.items():
        for layout, sizes in LAYOUTS.items():
            model = AutoModelForImageTextToText.from_pretrained(
                path, dtype=torch.float64, distributed_config=DistributedConfig(tp_size=sizes["tp"]))
            out = Trainer(model=model, args=_args(root / f"{model_type}-{layout}", **sizes),
                          train_dataset=str(root / "data.jsonl")).train()
            if torch.distributed.get_rank() == 0:
                (root / f"{model_type}-{layout}.json").write_text(json.dumps(out.losses))


def _reference(path, root: Path, global_batch: int):
    """transformers' model trained on one process on the same global batches: (its losses, the model)."""
    import transformers
    from tptrain.training.vision_data import build_vision_data, collate_vision, vision_encoder

    hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64).train()
    encoder = vision_encoder(path)
    rows = build_vision_data(str(root / "data.jsonl"), encoder, seq_len=128, config=hf.config)
    losses = reference_losses(hf, rows, _args(root / "unused", 1), global_batch,
                              collate_rows=lambda batch: collate_vision(batch, pad_id=encoder.eos_token_id))
    return losses, hf


def _batches_cover_every_case(root: Path) -> None:
    """The three global batches of two rows (one epoch) at SEED: an image and text, two images, then text only (the
    tower's AdamW moments non-zero by then: a zero gradient would move it)."""
    from tptrain.training.data import DataOrder

    has_image = ['"image' in line for line in (root / "data.jsonl").read_text().splitlines()]
    order = DataOrder(len(has_image), seed=SEED, dp_rank=0, dp_size=1, global_batch=2)
    kinds = [sum(has_image[i] for i in order.next_batch()) for _ in range(3)]
    assert kinds == [1, 2, 0], kinds


@pytest.mark.distributed
def test_fsdp_and_hsdp_equal_transformers_on_one_process(files):
    import transformers

    checkpoints, root = files
    _batches_cover_every_case(root)
    run_distributed(_train_worker, 4, checkpoints, root, timeout=600)
    for model_type, path in checkpoints.items():
        for layout, sizes in LAYOUTS.items():
            want, hf = _reference(path, root, global_batch=sizes["shard"] * sizes.get("replicate", 1))
            got = json.loads((root / f"{model_type}-{layout}.json").read_text())
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                       **TOL, msg=lambda m: f"{model_type} {layout}: {m}")
            final = transformers.AutoModelForImageTextToText.from_pretrained(
                root / f"{model_type}-{layout}" / "final", dtype=torch.float64)
            trained = dict(hf.named_parameters())
            for name, p in final.named_parameters():
                torch.testing.assert_close(p, trained[name], **WEIGHTS_TOL,
                                           msg=lambda m: f"{model_type} {layout} {name}: {m}")


def _resume_worker(path, root: Path) -> None:
    from tptrain import AutoModelForImageTextToText, DistributedConfig, Trainer

    def run(name: str, tp: int, resume=None, **kw):
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64,
                                                            distributed_config=DistributedConfig(tp_size=tp))
        args = _args(root / name, tp, shard=2 // tp, per_device_train_batch_size=tp, max_steps=4, **kw)
        return Trainer(model=model, args=args, train_dataset=str(root / "data.jsonl")).train(
            resume_from_checkpoint=resume).losses

    full = run("tp2", 2, save_steps=2)  # uninterrupted, at tp 2: checkpoints 2 and 4
    dp = run("dp2", 1, resume=root / "tp2" / "checkpoint-2", save_steps=1)  # tp 2 -> tp 1 x dp_shard 2
    back = run("back", 2, resume=root / "dp2" / "checkpoint-3")  # and back
    torch.testing.assert_close(torch.tensor(dp), torch.tensor(full[2:]), **TOL)
    torch.testing.assert_close(torch.tensor(back), torch.tensor(full[3:]), **TOL)


@pytest.mark.distributed
def test_resume_across_layouts(files):
    import transformers

    checkpoints, root = files
    run_distributed(_resume_worker, 2, checkpoints["qwen2_5_vl"], root, timeout=600)
    finals = [transformers.AutoModelForImageTextToText.from_pretrained(root / run / "final", dtype=torch.float64)
              for run in ("tp2", "back")]
    for (name, p), (_, q) in zip(finals[0].named_parameters(), finals[1].named_parameters(), strict=True):
        torch.testing.assert_close(p, q, **WEIGHTS_TOL, msg=lambda m: f"{name}: {m}")


def test_sequence_parallel_is_refused_naming_why():
    from tests.helpers.vlm import FAMILIES
    from tptrain import DistributedConfig
    from tptrain.hf.vlm import TransformersImageTextToText
    from tptrain.parallel.parallelize import check

    model = TransformersImageTextToText.from_config(FAMILIES["qwen2_5_vl"].config(), device="meta")
    with pytest.raises(ValueError, match=r"TransformersImageTextToText \(qwen2_5_vl\) cannot run with "
                                         r"enable_sequence_parallel: its decoder's input, the merged sequence .* "
                                         r"Qwen2_5_VLForConditionalGeneration before the first decoder layer.*; drop "
                                         r"enable_sequence_parallel \(--sequence-parallel\)"):
        check(model, DistributedConfig(tp_size=2, enable_sequence_parallel=True), world_size=2)
