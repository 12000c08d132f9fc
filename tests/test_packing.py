"""Document-masked packing: a packed batch gives each sample exactly its own logits, losses and gradients, as if
run one by one (fp64), on one device and at tp 2 with SP off and on, for every kind of attention (plain,
sliding window, soft-capped scores, OLMo 2's distributed q/k norms, Phi-3's fused projections), with activation
checkpointing."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.compare import TOL, assert_grads_match, assert_params_match
from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig
from tptrain.losses import IGNORE_INDEX
from tptrain.models import AutoConfig, AutoModelForCausalLM

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
FAMILIES = {
    "qwen3": dict(model_type="qwen3", **TINY),
    "mistral_window": dict(model_type="mistral", **TINY, sliding_window=4),
    "gemma2_softcap_window": dict(model_type="gemma2", **TINY, sliding_window=4, query_pre_attn_scalar=16,
                                  attn_logit_softcapping=5.0, final_logit_softcapping=5.0,
                                  layer_types=["sliding_attention", "full_attention"]),
    "olmo2_distributed_norm": dict(model_type="olmo2", **TINY),  # q/k norms over all heads: tp all-reduces
    "phi3_fused_partial_rotary": dict(model_type="phi3", **{k: v for k, v in TINY.items() if k != "head_dim"},
                                      partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=2, bos_token_id=1),
}
ROWS = ((7, 5, 9), (11, 6))  # sample lengths per packed row
SEQ = 24


def _samples(vocab: int):
    g = torch.Generator().manual_seed(3)
    out = []
    for lengths in ROWS:
        row = []
        for n in lengths:
            ids = torch.randint(0, vocab, (n,), generator=g)
            labels = ids.clone()
            labels[0] = IGNORE_INDEX  # as sft_data: a sample's first token is never a target
            labels[1:3] = IGNORE_INDEX  # a "prompt"
            row.append((ids, labels))
        out.append(row)
    return out


def _packed(rows):
    ids, labels, positions = [], [], []
    for row in rows:
        i = torch.cat([s[0] for s in row])
        pad = SEQ - i.numel()
        ids.append(torch.cat([i, torch.zeros(pad, dtype=torch.long)]))
        labels.append(torch.cat([torch.cat([s[1] for s in row]), torch.full((pad,), IGNORE_INDEX)]))
        positions.append(torch.cat([torch.arange(s[0].numel()) for s in row] + [torch.arange(pad)]))
    return torch.stack(ids), torch.stack(labels), torch.stack(positions)


def _check(name: str, tp: int, sp: bool, checkpointing: bool) -> None:
    kw = dict(FAMILIES[name])
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    model = copy.deepcopy(ref)
    if tp > 1:
        model = model.parallelize(DistributedConfig(tp_size=tp, enable_sequence_parallel=sp))
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train(), ref.train()
    rows = _samples(config.vocab_size)
    ids, labels, positions = _packed(rows)
    n_items = int((labels != IGNORE_INDEX).sum())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        with torch.no_grad():
            logits = model(ids, position_ids=positions).logits  # (rows, SEQ, vocab): gathered
            start = 0
            for r, row in enumerate(rows):
                start = 0
                for sample_ids, _ in row:
                    alone = ref(sample_ids[None]).logits[0]
                    torch.testing.assert_close(logits[r, start:start + sample_ids.numel()], alone, **TOL,
                                               msg=lambda m: f"{name} tp {tp} sp {sp} sample logits: {m}")
                    start += sample_ids.numel()
        ref_loss = sum(ref(s_ids[None], labels=s_lab[None], num_items_in_batch=n_items).loss
                       for row in rows for s_ids, s_lab in row)
        ref_loss.backward()
        loss = model(ids, labels=labels, position_ids=positions, num_items_in_batch=n_items).loss
        torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.backward()
        if tp > 1:
            assert_grads_match(model, ref, what=f"{name} tp {tp} sp {sp} packed grad")
        else:
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name} packed grad of {n}: {m}")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    if tp > 1:
        assert_params_match(model, ref, f"{name} tp {tp} sp {sp}: 2 AdamW steps on packed rows")
    # Without the restarting position ids the samples see each other: the loss changes (the mask is real).
    with torch.no_grad():
        mixed = model(ids, labels=labels, num_items_in_batch=n_items).loss
        alone = model(ids, labels=labels, position_ids=positions, num_items_in_batch=n_items).loss
    assert (mixed - alone).abs() > 1e-7, (name, mixed, alone)  # far above the 1e-10 tolerance


def _worker(sp: bool) -> None:
    for name in FAMILIES:
        _check(name, 2, sp, checkpointing=(name == "qwen3"))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_equals_one_by_one_single_device(name):
    _check(name, 1, False, checkpointing=(name == "gemma2_softcap_window"))


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_packed_equals_one_by_one_tp2(sp):
    run_distributed(_worker, 2, sp)
