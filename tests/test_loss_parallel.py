"""The vocab-parallel cross-entropy against F.cross_entropy on one device (fp64), and proof that no
rank ever holds or communicates the full (batch, seq, vocab) logits."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers.batches import labelled_batch as batch
from tests.helpers.compare import TOL, full_grads
from tests.helpers.configs import make_config
from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig
from tptrain.distributed import init_distributed
from tptrain.models import AutoModelForCausalLM
from tptrain.distributed.comm import CommTracker
from tptrain.parallel.loss import vocab_parallel_cross_entropy

pytestmark = pytest.mark.distributed


def _check_function(tp: int) -> None:
    """Per-token losses and logit gradients of the bare function, -100 targets included."""
    init_distributed()
    group, rank = dist.group.WORLD, dist.get_rank()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 40, generator=g, dtype=torch.float64) * 4
    target = torch.randint(0, 40, (24,), generator=g)
    target[::5] = -100
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, target, ignore_index=-100, reduction="none")
    (ref * torch.arange(24)).sum().backward()  # a non-uniform upstream gradient
    local = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    with CommTracker() as t:
        loss = vocab_parallel_cross_entropy(local, target, group)
        (loss * torch.arange(24)).sum().backward()
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    torch.testing.assert_close(local.grad, full.grad.chunk(tp, dim=-1)[rank], **TOL)
    # Issue 24: the max, then [target logit, sum-exp] in one all-reduce (Megatron's batching), not 3 of (24,)
    assert [(r.op, r.shape) for r in t.records] == [("all_reduce", (24,)), ("all_reduce", (48,))]


def _loss_worker(tp: int) -> None:
    _check_function(tp)
    for name in ("qwen3", "llama_tied_llama3_rope"):
        torch.manual_seed(0)
        config = make_config(name)
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
        model = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=tp))
        if config.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight
        ids, labels = batch(config.vocab_size)
        labels[1, 5:9] = -100
        # token mean, and sum / num_items_in_batch (gradient accumulation); whole logits, and the fused head + loss
        for items, whole in ((None, True), (37, True), (None, False), (37, False)):
            ref_out = ref(ids, labels=labels, num_items_in_batch=items, return_logits=True)
            with CommTracker() as t:
                out = model(ids, labels=labels, num_items_in_batch=items, return_logits=whole)
                out.loss.backward()
            ref_out.loss.backward()
            torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
            if whole:  # the head's output stays this rank's vocab shard
                assert out.logits.shape == (*ids.shape, config.vocab_size // tp)
                local = ref_out.logits.chunk(tp, dim=-1)[model.parallel.tp.ctx.rank]
                torch.testing.assert_close(out.logits, local, **TOL)
            # Nothing of vocab width is communicated.
            assert "all_gather" not in t.counts()
            assert all(r.shape[-1] == config.hidden_size for r in t.records if len(r.shape) > 1)
            grads = full_grads(model)
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, **TOL, msg=lambda m: f"grad of {n}: {m}")
            model.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
        # Without labels the caller gets the full logits, gathered once.
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, **TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_loss_matches_cross_entropy(tp):
    run_distributed(_loss_worker, tp, tp)
