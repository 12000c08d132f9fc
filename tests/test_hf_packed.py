"""Packed documents on the transformers backend (tptrain/hf/documents.py): a packed row of 2-3 documents (position ids
restarting) equals each document run alone, the logits of every token, the loss and every gradient, on every hybrid
family the backend runs (gated DeltaNet, KDA, Mamba, Mamba2, lightning attention, RG-LRU, short convolutions;
attention beside them), tiny checkpoints written by transformers, fp64; with activation checkpointing (each layer's
recompute gets its forward's documents back); afmoe, whose transformers code builds its masks without the position
ids; at cp 2 against the documents alone on one process: qwen3_next (gated DeltaNet) and jamba (Mamba) with
activation checkpointing, every other family (slow) but those context parallelism refuses (bamba, zamba,
inkling_text). The same rows without their position ids differ by O(1), so each comparison can fail. A model whose token mixing tptrain
cannot find (rwkv) refuses packed documents: its forward, the Trainer and `tptrain train` before any worker.
Generation with a KV cache infers no documents on a cache's steps (greedy tokens as transformers' generate).

    .venv/bin/python -m pytest tests/test_hf_packed.py -q
"""
from __future__ import annotations

import json
import re
from functools import partial

import pytest
import torch

from tests.helpers.batches import PACKED_SEQ as SEQ, packed_batch
from tests.helpers.ranks import run_distributed
from tests.helpers.checkpoints import random_checkpoint
from tests.helpers.backend import AXES_TINY as TINY, HYBRID, eager_experts, one_process
from tests.helpers.configs import F64

transformers = pytest.importorskip("transformers")

LIN = dict(layer_types=["linear_attention", "full_attention"])
GDN = dict(LIN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
MLA = dict(num_key_value_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, kv_lora_rank=16,
           q_lora_rank=16)
SSM = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=8)  # chunks shorter than the rows
CONV = dict(layer_types=["conv", "full_attention"])
# Every hybrid family the backend runs (its token mixers outside attention: cp_whole_sequence), and afmoe
HYBRIDS = {
    **HYBRID, "qwen3_5_text": GDN, "qwen3_5_moe_text": dict(GDN, shared_expert_intermediate_size=16),
    "qwen4_exp_text": dict(GDN, layer_types=["linear_attention"] * 2, hc_lowrank=8, ple_embed_dim=16),
    "olmo_hybrid": GDN, "kimi_linear": dict(MLA, **LIN, linear_head_dim=8, linear_num_heads=4),  # KDA; its MLA
    "bailing_hybrid": dict(MLA, n_group=1, topk_group=1, **LIN),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=8),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=1, chunk_size=8,
                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=16),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], **SSM),  # its masks drop the position ids too
    "bamba": dict(attn_layer_indices=[1], **SSM), "mamba": {}, "falcon_mamba": {},
    "mamba2": dict(num_heads=8, head_dim=8, n_groups=1, state_size=16, chunk_size=8),
    "zamba": dict(num_hidden_layers=3, layer_types=["linear_attention", "hybrid", "hybrid"], attention_head_dim=8,
                  mamba_dt_rank=8),
    "minimax": dict(block_size=8), "recurrent_gemma": dict(lru_width=32),  # lightning attention; RG-LRU
    "lfm2": CONV, "lfm2_moe": dict(CONV, num_dense_layers=1), "lfm3": {},  # short convolutions
    "inkling_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4,
                         rel_extent=16),  # short convolutions inside and beside its attention
    "afmoe": {},  # attention only: transformers builds its masks without the position ids
}
# Without its checkpoint: transformers writes no `mup_vector` buffer and cannot compute it, so the backend loads no
# falcon_h1 checkpoint; it trains one from scratch (from_config)
SCRATCH = {"falcon_h1"}
# Relative to each tensor's largest entry: transformers computes in fp32 inside most of these families whatever the
# model's dtype (the gated delta rule's torch path, a convolution or a norm cast .to(torch.float32), Mamba's logits),
# where rows of another length round otherwise: up to 2e-6 (bamba's gradients; the logits of most families agree to
# 1e-15); a document boundary crossed moves them by O(1) (the rows without their position ids, below)
REL = 1e-5


def config(model_type: str):
    return transformers.AutoConfig.for_model(model_type, **{**TINY, **HYBRIDS[model_type]})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {t: str(random_checkpoint(tmp_path_factory.mktemp(t), partial(transformers.AutoModelForCausalLM.from_config,
                                                                 config(t)))[0]) for t in HYBRIDS if t not in SCRATCH}


def one_process_of(checkpoints: dict, model_type: str):
    """The backend on one process in fp64 (from its checkpoint; from scratch, every parameter random, without one)."""
    if model_type in checkpoints:
        return one_process(checkpoints[model_type])
    from tests.helpers.checkpoints import randomize
    from tptrain.hf.model import TransformersCausalLM

    torch.manual_seed(0)
    model = TransformersCausalLM.from_config(config(model_type), dtype=F64)
    randomize(model)
    return model.train()


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    error = (got - want).abs().max().item()
    assert error <= REL * want.abs().max().item(), f"{what}: max |difference| {error:.2e} of max {want.abs().max():.2e}"


def documents(batch: dict) -> list[tuple[int, int, int]]:
    """(row, start, length) of every document of a packed batch, from its position ids."""
    out = []
    for row, positions in enumerate(batch["position_ids"]):
        starts = [*(positions == 0).nonzero().flatten().tolist(), positions.numel()]
        out += [(row, s, e - s) for s, e in zip(starts, starts[1:])]
    return out


def alone(ref, batch: dict, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Each document of `batch` run alone on `ref`: (every token's logits in the batch's layout, the loss over the
    batch's real tokens, every gradient)."""
    count = int((batch["labels"][:, 1:] != -100).sum())
    logits = torch.zeros(*batch["input_ids"].shape, ref.config.vocab_size, dtype=F64)
    ref.zero_grad()
    loss = 0.0
    for row, start, n in documents(batch):
        ids, labels = (batch[k][row:row + 1, start:start + n] for k in ("input_ids", "labels"))
        out = ref(ids, labels=labels, num_items_in_batch=count)
        logits[row, start:start + n] = out.logits[0].detach()
        loss = loss + out.loss
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def compare(model, batch: dict, want: tuple, what: str, grads=None) -> None:
    """The packed batch on `model`: logits (this rank's under cp), loss and gradients as the documents alone."""
    logits, loss, ref_grads = want
    count = int((batch["labels"][:, 1:] != -100).sum())
    model.zero_grad()
    out = model(**batch, num_items_in_batch=count)
    out.loss.backward()
    close(out.logits.detach(), logits[:, _local_index(model)], f"{what} logits")
    close(out.loss.detach(), loss, f"{what} loss")
    got = grads(model) if grads else {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(ref_grads), (what, set(got) ^ set(ref_grads))
    for name, g in ref_grads.items():
        close(got[name], g, f"{what} grad {name}")


def _local_index(model) -> slice | torch.Tensor:
    from tptrain.parallel.context_parallel import local_index

    cp = model.parallel.cp
    return slice(None) if cp is None else local_index(SEQ, cp.size, cp.rank)


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_packed_row_equals_each_document_alone(checkpoints, model_type):
    model = one_process_of(checkpoints, model_type).eval()  # (no dropout; gradients all the same)
    batch = packed_batch()
    want = alone(model, batch)
    compare(model, batch, want, model_type)
    with torch.no_grad():  # the rows as one document each: the documents mix (what packing did before)
        plain = model(batch["input_ids"]).logits
    assert (plain - want[0]).abs().max() > 1e-2, model_type


@pytest.mark.parametrize("model_type", ["qwen3_next", "jamba", "lfm2"])
def test_activation_checkpointing_recomputes_each_document(checkpoints, model_type):
    """Each layer's recompute in backward, after its forward is over, runs its mixers on that forward's documents."""
    model = one_process_of(checkpoints, model_type)
    want = alone(model, packed_batch())
    model.gradient_checkpointing_enable()
    compare(model.train(), packed_batch(), want, f"{model_type} + activation checkpointing")


def test_documents_are_grouped_by_length_and_come_back_in_place():
    """One long document beside short ones pads none of them to its length (groups whose longest is at most twice
    their shortest); split then join gives every token back in its place, the padding zeros."""
    from tptrain.hf.documents import Documents

    lengths = ([2, 3, 27], [4, 28])  # two rows of 32
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    documents = Documents.of(positions, 2)
    assert documents.shapes == ((1, 2), (2, 4), (2, 28)), documents.shapes
    x = torch.arange(2 * 32 * 3, dtype=F64).view(2, 32, 3)
    parts = documents.split(x)
    assert [tuple(p.shape) for p in parts] == [(1, 2, 3), (2, 4, 3), (2, 28, 3)]
    assert parts[1][0, 3].abs().sum() == 0 and parts[2][0, 27].abs().sum() == 0  # 3 and 27 long: padded
    assert torch.equal(parts[2][1, :], x[1, 4:])  # the second row's 28
    assert torch.equal(documents.join(parts), x)
    assert Documents.of(torch.arange(32).expand(2, 32), 2) is None  # no row restarts: nothing to regroup


@pytest.mark.parametrize("model_type", ["afmoe", "granitemoehybrid", "qwen3_next", "jamba"])
def test_generation_with_a_cache_infers_no_documents(checkpoints, model_type):
    """Generation fills a cache with the prompts, then steps one token per row on it: no packed documents there (a
    step's position ids continue each row), tptrain's masks (afmoe, granitemoehybrid) give transformers' on a cache's
    step. Greedy tokens equal transformers' generate, left-padded prompts and plain ones; a prompt of packed
    documents filling a cache is refused."""
    import warnings

    from tests.helpers.references import transformers_fp64

    model, hf = one_process_of(checkpoints, model_type).eval(), transformers_fp64(checkpoints[model_type])
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    for mask in (None, torch.tensor([[1] * 7, [0, 0] + [1] * 5])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
        assert torch.equal(got, want), (model_type, mask, got, want)
    batch = packed_batch()
    if model.packing_refusal is None and model._packed.mixers:
        with pytest.raises(ValueError, match=r"packed documents .* run without a cache; .*use_cache=False"):
            model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)


# ------------------------------------------------------------------ refused


def _rwkv_config(**kw):
    return transformers.RwkvConfig(vocab_size=kw.pop("vocab_size", 128), hidden_size=32, num_hidden_layers=2,
                                   attention_hidden_size=32, intermediate_size=48, context_length=64, **kw)


def test_a_model_whose_token_mixing_tptrain_cannot_find_refuses_packed_documents(tmp_path):
    """rwkv: no attention module, no mixer tptrain knows. Its forward refuses a packed batch (plain rows run), and the
    rule table's packed_documents refuses it in a run on packed rows (the Trainer's stage 2), not on plain ones."""
    import numpy as np

    from tests.helpers.trainer import training_args
    from tptrain.hf.model import TransformersCausalLM
    from tptrain.training.setup import check_packed_documents
    from tptrain.training.sft_data import SampleTable, SFTDataset
    from tptrain.training.trainer import Trainer

    model = TransformersCausalLM.from_config(_rwkv_config(), dtype=F64)
    assert "neither an attention module nor a token mixer" in model.packing_refusal
    batch = packed_batch()
    with pytest.raises(ValueError, match=r"RwkvForCausalLM \(rwkv\) cannot keep packed documents .* apart: .*"
                                         r"packing=False, --no-packing"):
        model(batch["input_ids"], position_ids=batch["position_ids"])
    model(batch["input_ids"])
    check_packed_documents(model, False)
    table = SampleTable(np.arange(40) % 100, np.ones(40, dtype=bool), np.array([0, 7, 19, 30, 40]))
    rows = SFTDataset(table, seq_len=SEQ, packing=True, truncation="truncate", pad_id=0, name="samples")
    with pytest.raises(ValueError, match=r"^TransformersCausalLM \(rwkv\) cannot train on packed documents: tptrain "
                                         r".*; train without packing \(packing=False, --no-packing\): one sample"):
        Trainer(model, args=training_args(tmp_path, seq_len=SEQ), train_dataset=rows)


def test_tptrain_train_refuses_packed_documents_before_any_worker(tmp_path, capsys):
    from tests.helpers.chat import chat_checkpoint
    from tptrain.cli import main

    config = _rwkv_config(vocab_size=4160)
    directory = chat_checkpoint(tmp_path / "rwkv", None, config=config.to_dict())
    transformers.RwkvForCausalLM(config).save_pretrained(directory)
    data = tmp_path / "samples.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"a {i}", "completion": " b"}) + "\n" for i in range(8)))
    capsys.readouterr()
    code = main(["train", "--smoke-test", "--model", str(directory), "--data", str(data), "--tp-size", "1",
                 "--nproc-per-node", "1", "--output-dir", str(tmp_path / "run")])
    stderr = capsys.readouterr().err
    assert code == 2 and stderr.count("\n") == 1, (code, stderr)
    assert re.search(r"\(rwkv\) cannot train on packed documents: tptrain finds neither .*--no-packing", stderr), stderr


# ------------------------------------------------------------------ context parallelism


def _cp2(paths: dict[str, str]) -> None:
    """cp 2: the packed rows (the mixers on the whole sequence gathered over cp, each document a row of its own)
    against the documents alone on one process; with activation checkpointing too."""
    from tests.helpers.compare import full_grads
    from tptrain import AutoModelForCausalLM, DistributedConfig

    for model_type, path in paths.items():
        want = alone(one_process(path).eval(), packed_batch())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
            cp_size=2, backend="transformers")).eval()
        eager_experts(model)
        compare(model, packed_batch(), want, f"{model_type} cp 2", grads=full_grads)
        model.gradient_checkpointing_enable()
        compare(model.train(), packed_batch(), want, f"{model_type} cp 2 + activation checkpointing", grads=full_grads)


@pytest.mark.distributed
def test_cp2_packed_row_equals_each_document_alone(checkpoints):
    run_distributed(_cp2, 2, {t: checkpoints[t] for t in ("qwen3_next", "jamba")}, timeout=600)


# Context parallelism refuses these whatever the rows (a mixer holding an attention; a position bias its attention
# does not implement): nothing packed to compare at cp 2
CP_REFUSED = {"bamba": "cannot run with cp_size", "zamba": "cannot run with cp_size", "inkling_text": "drop cp_size"}


def _cp2_each(paths: dict[str, str]) -> None:
    """cp 2 on each of `paths`: the packed rows against the documents alone on one process; those context parallelism
    refuses (CP_REFUSED) refused as said."""
    from tests.helpers.compare import full_grads
    from tptrain import AutoModelForCausalLM, DistributedConfig

    for model_type, path in paths.items():
        want = alone(one_process(path).eval(), packed_batch())
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
                cp_size=2, backend="transformers")).eval()
            eager_experts(model)
            compare(model, packed_batch(), want, f"{model_type} cp 2", grads=full_grads)
        except ValueError as exc:
            if model_type not in CP_REFUSED or CP_REFUSED[model_type] not in str(exc):
                raise
        else:
            assert model_type not in CP_REFUSED, f"{model_type} runs at cp 2 now: compare it (drop it from CP_REFUSED)"


@pytest.mark.slow
@pytest.mark.distributed
def test_cp2_packed_row_equals_each_document_alone_on_every_hybrid(checkpoints):
    """The other hybrid families at cp 2 (qwen3_next and jamba above, with activation checkpointing too)."""
    run_distributed(_cp2_each, 2, {t: p for t, p in checkpoints.items() if t not in ("qwen3_next", "jamba")},
                    timeout=900)
