"""Context parallelism on the transformers backend (tptrain/hf/attention.py): tptrain's attention and mask functions
registered with transformers' attention interfaces, each rank's queries against the whole sequence's keys and values,
the masks from the tokens' global indices. Tiny random checkpoints written by transformers (hub layout), fp64, against
the backend on one process: the loss, every gradient and the local logits on a packed batch (documents restarting
inside each row, windows and chunks shorter than the documents) and on plain rows, at cp 2 and tp 2 x cp 2, 3 AdamW
steps at cp 2; the Trainer at cp 2 with a checkpoint resumed at cp 1. A hybrid's gated DeltaNet (qwen3_next) runs on the
whole sequence gathered beside its split attention, against one process too; an indexer of the keys is refused.

    .venv/bin/python -m pytest tests/test_hf_context_parallel.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.backend import (AXES_CHECKPOINTS, AXES_FAMILIES as FAMILIES, AXES_TINY as TINY, AXES_TYPES as TYPES,
                                   axes_config as config, eager_experts, one_process)
from tests.helpers.batches import PACKED_SEQ as SEQ, packed_batch
from tests.helpers.configs import F64
from tests.helpers.ranks import run_distributed

# fp64, but transformers keeps fp32 islands in it (eager attention's softmax, Gemma's norms, routers), where another
# order of sums rounds otherwise: up to ~4e-7 of a soft-capped logit; a layout bug moves them by ~1e-2
TOL = dict(rtol=1e-6, atol=1e-6)
TP_TOL = dict(rtol=1e-5, atol=1e-5)  # llama4_text at tp 2 alone: 1.7e-6 of its logits (its MoE's fp32 islands)
# qwen3_next's gated delta rule runs in fp32 whatever the model's dtype (transformers' torch fallback): 1.1e-6 of a
# conv weight's gradient at cp 2
ISLAND_TOL = {"qwen3_next": TP_TOL}
TP_CP = ("gpt_neox", "cohere2", "granitemoe", "deepseek_v2", "llama4_text", "gemma2", "qwen3_next")  # and tp 2 x cp 2


CHECKPOINTS = AXES_CHECKPOINTS  # {model_type: directory}


# ------------------------------------------------------------------ no process group


def test_masks_are_rows_of_transformers_whole_masks():
    """The mask builder on the whole batch's positions, any rows and key order: transformers' own masks of the whole
    sequence (causal, sliding window, chunked; packed documents from restarting position ids; padding), indexed."""
    from transformers.masking_utils import (chunked_causal_mask_function, find_packed_sequence_indices,
                                            packed_sequence_compatibility_function, sdpa_mask,
                                            sliding_window_causal_mask_function)

    from tptrain.hf.attention import attention_masks

    positions = packed_batch()["position_ids"]
    rows, keys = torch.tensor([1, 4, 6, 9, 13, 15]), torch.randperm(SEQ, generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, SEQ, dtype=torch.long)
    padding[1, -3:] = 0
    for function in (sliding_window_causal_mask_function(3), chunked_causal_mask_function(5, torch.zeros(2).long())):
        for pad in (None, padding):
            whole = function
            if pad is None:  # transformers finds the documents only without a padding mask
                whole = packed_sequence_compatibility_function(function, positions, find_packed_sequence_indices(
                    positions))
            want = sdpa_mask(2, SEQ, SEQ, mask_function=whole, attention_mask=pad, allow_is_causal_skip=False)
            got = attention_masks(positions, pad, {(function, 2)}, query_index=rows, key_index=keys)[(function, 2)]
            assert torch.equal(got, want[:, :, rows][..., keys]), (function, pad)


def test_the_decoder_entry_splits_every_per_token_input():
    """Where the sequence enters a vision-language model's text decoder (`cp_sequence_entry`): this rank's rows of
    every (batch, seq, ...) input by name, Gemma 4's per-layer inputs (batch, seq, layers, width) beside the embeddings
    (its decoder adds them per token: left whole, the cp 2 survey failed with 6 != 12), and its positions; a
    (batch, seq / cp) tensor already this rank's and the rest as given; Qwen3-VL's deepstack features (cohere_compass:
    a row per image token, added where `visual_pos_masks` holds) those of this rank's image tokens."""
    from tptrain.parallel.context_parallel import CPContext, _entering, gathered_index, local_index

    seq, gen = 12, torch.Generator().manual_seed(0)
    ctx = CPContext("cp", 2, 1, entry=True, query_index=local_index(seq, 2, 1), key_index=gathered_index(seq, 2))
    whole = dict(inputs_embeds=torch.randn(2, seq, 8, generator=gen), per_layer_inputs=torch.randn(
        2, seq, 3, 4, generator=gen), attention_mask=torch.ones(2, seq, dtype=torch.long), position_ids=None)
    mine = torch.randn(2, seq // 2, 8, generator=gen)
    _, got = _entering(ctx, torch.nn.Identity(), (), {**whole, "hidden": mine, "use_cache": False})
    rows = ctx.query_index
    for name in ("inputs_embeds", "per_layer_inputs", "attention_mask"):
        assert torch.equal(got[name], whole[name][:, rows]), name
    assert torch.equal(got["position_ids"], rows[None]) and got["hidden"] is mine and got["use_cache"] is False
    visual = torch.rand(2, seq, generator=gen) < 0.5  # Qwen3-VL's deepstack: a feature row per image token
    features = torch.randn(int(visual.sum()), 8, generator=gen)
    _, got = _entering(ctx, torch.nn.Identity(), (), dict(whole, visual_pos_masks=visual,
                                                          deepstack_visual_embeds=[features, 2 * features]))
    placed = torch.zeros(2, seq, 8, dtype=features.dtype)
    placed[visual] = features
    assert torch.equal(got["visual_pos_masks"], visual[:, rows])
    assert torch.equal(got["deepstack_visual_embeds"][0], placed[:, rows][visual[:, rows]])
    assert torch.equal(got["deepstack_visual_embeds"][1], 2 * got["deepstack_visual_embeds"][0])


def test_token_mixers_run_on_the_whole_sequence_and_key_indexers_are_refused():
    """qwen3_next's gated DeltaNet (a recurrence) runs on the whole sequence under cp (`cp_whole_sequence`, against
    one process below); DeepSeek-V3.2's indexer picks keys from all of them for its attention: refused before any
    collective, naming it."""
    import transformers

    from tptrain import DistributedConfig
    from tptrain.hf.model import TransformersCausalLM
    from tptrain.parallel import parallelize

    model = TransformersCausalLM.from_config(config("qwen3_next"), device="meta")
    assert model.cp_whole_sequence == {"model.layers.0.linear_attn": "Qwen3NextGatedDeltaNet"}
    assert not model.sequence_mixers
    parallelize.check(model, DistributedConfig(cp_size=2), world_size=2)
    indexed = transformers.AutoConfig.for_model("deepseek_v32", **{**TINY, **FAMILIES["deepseek_v2"]})
    model = TransformersCausalLM.from_config(indexed, device="meta")
    with pytest.raises(ValueError, match=r"\(deepseek_v32\) cannot run with cp_size=2: model.layers.0.self_attn.indexer "
                                         r"\(DeepseekV32Indexer and 1 more\) mixes tokens outside attention.*drop cp_size"):
        parallelize.check(model, DistributedConfig(cp_size=2), world_size=2)
    for model_type in FAMILIES:
        model = TransformersCausalLM.from_config(config(model_type), device="meta")
        assert not model.sequence_mixers and not model.cp_whole_sequence, model_type


# ------------------------------------------------------------------ against one process


def _compare(paths: dict[str, str], types, **layout) -> None:
    """Per type: the loss, every gradient (gathered over TP) and this rank's logits equal one process's, on the
    packed batch and on plain rows."""
    from tests.helpers.compare import full_grads
    from tptrain import AutoModelForCausalLM, DistributedConfig
    from tptrain.parallel.context_parallel import local_index

    for model_type in types:
        tol = TP_TOL if layout.get("tp_size", 1) > 1 else ISLAND_TOL.get(model_type, TOL)
        ref = one_process(paths[model_type])
        model = AutoModelForCausalLM.from_pretrained(paths[model_type], dtype=F64, distributed_config=DistributedConfig(
            backend="transformers", **layout)).train()
        eager_experts(model)
        for packed in (True, False):
            what = f"{model_type} {layout} {'packed' if packed else 'plain'}"
            batch = packed_batch(packed=packed)
            ref.zero_grad(), model.zero_grad()
            ref_loss, loss = ref(**batch).loss, model(**batch).loss
            torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"{what} loss: {m}")
            ref_loss.backward(), loss.backward()
            grads = full_grads(model)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, **tol, msg=lambda m: f"{what} grad {name}: {m}")
            with torch.no_grad():
                index = local_index(SEQ, layout["cp_size"], model.parallel.cp.rank)
                logits, want = model.eval()(batch["input_ids"]).logits, ref.eval()(batch["input_ids"]).logits
                model.train(), ref.train()
            torch.testing.assert_close(logits, want[:, index], **tol, msg=lambda m: f"{what} logits: {m}")


def _adamw_steps(path: str, steps: int = 3, tol: dict = TOL, **layout) -> None:
    from tests.helpers.compare import full_params
    from tptrain import AutoModelForCausalLM, DistributedConfig

    batch = packed_batch(seed=1)
    ref = one_process(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
        backend="transformers", **layout)).train()
    eager_experts(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (ref, model)]
    for step in range(steps):
        ref_loss, loss = ref(**batch).loss, model(**batch).loss
        torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"{path} {layout} loss, step {step}: {m}")
        ref_loss.backward(), loss.backward()
        for opt in opts:
            opt.step(), opt.zero_grad()
    params = full_params(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), **tol, msg=lambda m: f"{name}: {m}")


def _trainer_and_resume(path: str, out: str) -> None:
    """The Trainer at cp 2 (FSDP2 over dp_shard x cp) equals one process; its checkpoint resumes at cp 1 (dp 2)."""
    from tests.helpers.references import reference_losses
    from tests.helpers.trainer import tiny_dataset, training_args
    from tptrain import AutoModelForCausalLM, DistributedConfig
    from tptrain.training.trainer import Trainer

    def trainer(cp: int, where: str, steps: int) -> Trainer:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
            cp_size=cp, tp_size=1, backend="transformers"))
        args = training_args(f"{out}/{where}", max_steps=steps, per_device_train_batch_size=4 // (2 // cp),
                             save_steps=2, lr_scheduler_type="constant", warmup_steps=0)
        return Trainer(model, args=args, train_dataset=tiny_dataset())

    first = trainer(2, "cp2", 2).train().losses
    resumed = trainer(1, "cp1", 4).train(resume_from_checkpoint=f"{out}/cp2/checkpoint-2").losses
    args = training_args(out, max_steps=4, lr_scheduler_type="constant", warmup_steps=0)
    expected = reference_losses(one_process(path), tiny_dataset(), args, global_batch=4)
    torch.testing.assert_close(torch.tensor(first + resumed), torch.tensor(expected), rtol=1e-10, atol=1e-10)


def _cp2_worker(paths: dict[str, str], out: str) -> None:
    _compare(paths, TYPES, cp_size=2)
    for model_type in ("granitemoe", "llama4_text", "qwen3_next"):
        _adamw_steps(paths[model_type], tol=ISLAND_TOL.get(model_type, TOL), cp_size=2)
    _trainer_and_resume(paths["gpt_neox"], out)


@pytest.mark.distributed
def test_cp2_equals_one_process(checkpoints, tmp_path):
    run_distributed(_cp2_worker, 2, checkpoints, str(tmp_path), timeout=900)


def _tp2_cp2(paths: dict[str, str]) -> None:
    _compare(paths, TP_CP, cp_size=2, tp_size=2)


@pytest.mark.distributed
def test_tp2_cp2_equals_one_process(checkpoints):
    run_distributed(_tp2_cp2, 4, checkpoints, timeout=900)
