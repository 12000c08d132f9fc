"""Context and pipeline parallelism of vision-language models (tptrain.AutoModelForImageTextToText): the tower and
projector run on the whole batch's images, their features are placed into the whole sequence, the multimodal position
ids (Qwen2.5-VL's rows for time, height and width) are computed on it, and only then is the sequence split over cp, at
the text decoder's entry; a pipeline's first stage holds the tower and projector beside the embedding, each
microbatch taking its own samples' images. Against transformers on one process (fp64): the loss, every gradient (the
tower's included) and 3 AdamW steps at cp 2 and tp 2 x cp 2; the Trainer (image-text records through the
checkpoint's processor) at cp 2, pp 2 and (slow) tp 2 x cp 2 x pp 2; what cannot compose refused before any worker.

    .venv-vision/bin/python -m pytest tests/test_vlm_axes.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.vlm import F64, IMAGE, TOL, batch, equivalence, gathered_grads, transformers_model, write_checkpoint

pytestmark = pytest.mark.vision
CP_TYPES = ("qwen2_5_vl", "llava", "gemma3")


def cp_batch(model_type: str, hf, multiple: int = 4) -> dict[str, torch.Tensor]:
    """helpers.vlm's batch with text appended up to a multiple of `multiple` tokens (2 x cp chunks), and Qwen's
    mm_token_type_ids (what its processor returns: transformers then computes the multimodal RoPE positions)."""
    inputs = batch(model_type, hf)
    ids = inputs["input_ids"]
    extra = -ids.shape[1] % multiple + multiple
    more = torch.randint(3, IMAGE, (ids.shape[0], extra), generator=torch.Generator().manual_seed(5))
    for key, tail in (("input_ids", more), ("labels", more), ("attention_mask", torch.ones_like(more))):
        inputs[key] = torch.cat([inputs[key], tail], dim=1)
    if "token_type_ids" in inputs:
        inputs["token_type_ids"] = (inputs["input_ids"] == IMAGE).long()
    if model_type == "qwen2_5_vl":
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE).int()
    return inputs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for model_type in CP_TYPES:
        path, hf = write_checkpoint(tmp_path_factory.mktemp(model_type), model_type)
        out[model_type] = (path, cp_batch(model_type, hf))
    return out


def test_the_cut_and_the_refusals_before_any_process_group():
    """Qwen2.5-VL's tower beside the embedding on the first stage, its text decoder's attention alone split over cp
    (the tower's runs on the whole batch's images): tp 2 x cp 2 x pp 2 passes the rule table. Llama 4's tower sits
    beside its causal LM, outside the base model a stage runs: pp refused naming it, cp not."""
    from tptrain import DistributedConfig
    from tptrain.hf.vlm import TransformersImageTextToText
    from tptrain.parallel.facts import model_facts
    from tptrain.parallel.parallelize import check
    from tests.helpers.vlm import FAMILIES

    qwen = TransformersImageTextToText.from_config(FAMILIES["qwen2_5_vl"].config(), device="meta")
    assert set(qwen.pp_first) == {"model.visual", "model.language_model.embed_tokens"}
    assert qwen.pp_last == ("model.language_model.norm", "lm_head") and qwen.cp_sequence_entry == "model.language_model"
    assert model_facts(qwen).attention == 2  # the decoder's two layers; not the tower's two blocks
    check(qwen, DistributedConfig(tp_size=2, cp_size=2, pp_size=2), world_size=8)
    llama4 = TransformersImageTextToText.from_config(FAMILIES["llama4"].config(), device="meta")
    with pytest.raises(ValueError, match=r"\(llama4\) cannot be cut into pipeline stages \(pp_size=2\): .*its vision_model "
                                         r"\(Llama4VisionModel\) runs before the decoder layers outside its base model "
                                         r"language_model.*load it with pp_size=1"):
        check(llama4, DistributedConfig(pp_size=2, tp_size=1), world_size=2)
    check(llama4, DistributedConfig(cp_size=2, tp_size=2), world_size=4)


def test_a_tower_goes_to_the_first_stage_when_the_probe_cannot_run():
    """The cut's fallback where the meta forward of the text probe fails (Step3p7's, Qwen2.5-Omni's thinker's): the
    tower and projector beside the text decoder go to the first stage with the embedding, not to the last (there a
    later stage ran transformers' get_image_features on a placeholder tower, failed on that rank alone, and the
    pp 2 survey hung)."""
    import transformers

    from tptrain.hf.vlm import TransformersImageTextToText

    for model_type, tower in (("step3p7", "model.vision_model"), ("qwen2_5_omni_thinker", "model.visual")):
        model = TransformersImageTextToText.from_config(transformers.CONFIG_MAPPING[model_type](), device="meta")
        assert tower in model.pp_first and tower not in model.pp_last, (model_type, model.pp_first, model.pp_last)


def _cp(checkpoints: dict, **layout) -> None:
    """The model's forward at `layout` against transformers: loss, every gradient, 3 AdamW steps."""
    from tptrain import AutoModelForImageTextToText, DistributedConfig
    for model_type, (path, inputs) in checkpoints.items():
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=F64, distributed_config=DistributedConfig(**layout)).train()
        assert model.parallel.cp is not None and model.parallel.cp.entry
        equivalence(model, transformers_model(path), inputs)


def _pipeline_step(checkpoints: dict, **layout) -> None:
    """One pipeline step (2 microbatches, each one sample and its image) at `layout`: the loss and every gradient
    (the tower's, on the first stage) against transformers' forward and backward of the whole batch."""
    from tptrain import AutoModelForImageTextToText, DistributedConfig
    from tptrain.distributed.state import ROWS
    from tptrain.losses import shift_labels
    from tptrain.parallel.parallelize import ParallelOptions, parallelize

    for model_type, (path, inputs) in checkpoints.items():
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=F64, distributed_config=DistributedConfig(**layout)).train()
        pipeline = parallelize(model, model.parallel.mesh, ParallelOptions(train=True, pp_microbatches=2),
                               device=torch.device("cpu")).pipeline
        ids = inputs["input_ids"]
        rows = {k + ROWS: torch.tensor([v.shape[0] // len(ids)] * len(ids)) for k, v in inputs.items()
                if v.shape[:2] != ids.shape}  # the images' inputs: one image per sample
        loss = pipeline.step({**inputs, **rows}, int((shift_labels(inputs["labels"]) != -100).sum()))
        torch.distributed.all_reduce(loss, group=model.parallel.mesh["pp"].get_group())  # the last stage's
        pipeline.ties.sync_grads()
        ref = transformers_model(path)
        ref_loss = ref(**inputs).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach().to(F64), **TOL, msg=lambda m: f"{model_type} loss: {m}")
        want = dict(ref.named_parameters())
        grads = _full_grads(model)
        assert any(".visual." in n or ".vision_tower." in n for n in grads) == model.parallel.pp.holds(0)
        for name, grad in grads.items():
            if name in want:  # (a tied head's copy: its gradient is the embedding's)
                torch.testing.assert_close(grad, want[name].grad, **TOL, msg=lambda m: f"{model_type} {name}: {m}")


def _full_grads(model) -> dict:
    """helpers.vlm.gathered_grads, FSDP2's shards (under cp the pipeline's stages are wrapped over cp) gathered first."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p.grad, DTensor):
            p.grad = p.grad.full_tensor()
    return gathered_grads(model)


def _two_ranks(checkpoints: dict) -> None:
    _cp(checkpoints, cp_size=2, tp_size=1)
    _pipeline_step({t: checkpoints[t] for t in ("qwen2_5_vl", "gemma3")}, pp_size=2, tp_size=1)


@pytest.mark.distributed
def test_cp2_and_pp2_match_transformers(checkpoints):
    run_distributed(_two_ranks, 2, checkpoints, timeout=900)


def _four_ranks(checkpoints: dict) -> None:
    _cp({t: checkpoints[t] for t in ("qwen2_5_vl", "gemma3")}, cp_size=2, tp_size=2)
    # gemma3's images attend within themselves both ways (its token types' blocks), over the cp ranks of each stage
    _pipeline_step({"gemma3": checkpoints["gemma3"]}, pp_size=2, cp_size=2, tp_size=1)


@pytest.mark.distributed
def test_tp2_cp2_and_pp2_cp2_match_transformers(checkpoints):
    run_distributed(_four_ranks, 4, checkpoints, timeout=900)


# ------------------------------------------------------------------ the Trainer on image-text records


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """{model_type: a tiny checkpoint with its processor}, and the directory of data.jsonl (image-text chats: one
    image, two images, none; images of different sizes, so Qwen's patches per sample differ)."""
    from tests.helpers.chat import write_jsonl
    from tests.helpers.vision_data import chat_records, vision_checkpoint, write_images

    root = tmp_path_factory.mktemp("records")
    images = write_images(root / "images")
    write_jsonl(root / "data.jsonl", chat_records([str(p.relative_to(root)) for p in images]) * 2)
    return {t: vision_checkpoint(root / t, t) for t in ("qwen2_5_vl", "llava")}, root


def _trainer_args(output_dir, **kwargs):
    from tptrain.training.args import TrainingArguments

    return TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=3, seq_len=128,
                             learning_rate=1e-3, warmup_steps=1, max_grad_norm=1.0, seed=3, **kwargs)


def _train(checkpoints: dict, root, layouts: dict[str, dict], out) -> None:
    """3 Trainer steps of each checkpoint laid out as each of `layouts` (global batch 4); rank 0 writes the losses."""
    import json

    from tptrain import AutoModelForImageTextToText, DistributedConfig, Trainer
    from tptrain.training.args import ParallelismConfig

    for where, layout in layouts.items():
        for model_type, path in checkpoints.items():
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=F64,
                                                                distributed_config=DistributedConfig(**layout))
            parallelism = ParallelismConfig(pp_microbatches=2) if layout.get("pp_size", 1) > 1 else None
            trainer = Trainer(model=model, args=_trainer_args(out / where / model_type, parallelism_config=parallelism),
                              train_dataset=str(root / "data.jsonl"))
            losses = trainer.train().losses
            if torch.distributed.get_rank() == 0:
                (out / where / f"{model_type}.json").write_text(json.dumps(losses))


def _equal_transformers(checkpoints: dict, root, out) -> None:
    """The losses and the final checkpoint (written from the stages) of `_train`: transformers' model trained on
    one process on the same batches."""
    import json

    import transformers

    from tests.helpers.references import reference_losses
    from tptrain.training.vision_data import build_vision_data, collate_vision, vision_encoder

    for model_type, path in checkpoints.items():
        hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=F64).train()
        encoder = vision_encoder(path)
        rows = build_vision_data(str(root / "data.jsonl"), encoder, seq_len=128, config=hf.config)
        want = reference_losses(hf, rows, _trainer_args(out / "unused"), 4,
                                collate_rows=lambda batch: collate_vision(batch, pad_id=encoder.eos_token_id))
        got = json.loads((out / f"{model_type}.json").read_text())
        torch.testing.assert_close(torch.tensor(got, dtype=F64), torch.tensor(want, dtype=F64), rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"{model_type} losses: {m}")
        saved = transformers.AutoModelForImageTextToText.from_pretrained(out / model_type / "final", dtype=F64)
        trained = dict(hf.named_parameters())
        for name, p in saved.named_parameters():
            torch.testing.assert_close(p, trained[name].detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{model_type} {name} after 3 steps: {m}")


@pytest.mark.distributed
def test_trainer_pp2_and_cp2_equal_transformers(records, tmp_path):
    checkpoints, root = records
    layouts = {"pp2": dict(pp_size=2, tp_size=1), "cp2": dict(cp_size=2, tp_size=1)}
    run_distributed(_train, 2, checkpoints, root, layouts, tmp_path, timeout=900)
    for where in layouts:
        _equal_transformers(checkpoints, root, tmp_path / where)


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_tp2_cp2_pp2_equals_transformers(records, tmp_path):
    checkpoints, root = records
    run_distributed(_train, 8, checkpoints, root, {"3d": dict(tp_size=2, cp_size=2, pp_size=2)}, tmp_path,
                    timeout=1200)
    _equal_transformers(checkpoints, root, tmp_path / "3d")
