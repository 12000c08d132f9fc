"""tptrain's GRPO loss on one process equals TRL 1.16's GRPOTrainer._compute_loss for every loss_type: the same tiny
fp64 checkpoint (written by transformers), the same completions, masks, advantages, old and reference log-probabilities
fed to both; the loss, every parameter's gradient and TRL's kl / clip_ratio metrics compared.

TRL's fused head computes its log-softmax in fp32 even for an fp64 model, so values agree to ~1e-6 relative; a wrong
term, mask or normaliser is O(1)."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.preference import checkpoint

pytestmark = pytest.mark.distributed

ROWS, PROMPT, COMPLETION, TEMPERATURE = 4, 5, 6, 0.7
CLOSE = dict(rtol=2e-5, atol=2e-6)
# name: GRPOConfig options both sides take (TRL's names); every case reads old and reference log-probabilities
CASES = {
    "dapo": dict(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28),
    "grpo": dict(loss_type="grpo", beta=0.04, epsilon=0.2),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.0, epsilon=0.2),
    "bnpo": dict(loss_type="bnpo", beta=0.1, epsilon=0.1, use_bias_correction_kl=False),
    "cispo": dict(loss_type="cispo", beta=0.0, epsilon=0.2, epsilon_high=1.1),
}


def _inputs(vocab: int) -> dict[str, torch.Tensor]:
    """A fixed batch in TRL's layout: prompts (no padding), right-padded completions (one cut to nothing: a masked
    truncated completion), advantages of both signs."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([6, 3, 0, 5])
    mask = (torch.arange(COMPLETION) < lengths[:, None]).long()
    return {"prompt_ids": torch.randint(10, vocab, (ROWS, PROMPT), generator=g),
            "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
            "completion_ids": torch.randint(10, vocab, (ROWS, COMPLETION), generator=g) * mask,
            "completion_mask": mask, "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64),
            "num_items_in_batch": mask.sum()}


def _log_probs(path, inputs) -> torch.Tensor:
    """(rows, completion) log_softmax(logits / T) of the completion tokens, fp64, by transformers' model."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, PROMPT - 1:-1] / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, inputs["completion_ids"][..., None])[..., 0]


def _with_old_and_ref(path, inputs) -> dict[str, torch.Tensor]:
    """Old and reference log-probabilities a little off the model's own, so ratios clip both ways and the KL is not 0."""
    now = _log_probs(path, inputs)
    g = torch.Generator().manual_seed(6)
    return {**inputs, "old_per_token_logps": now + 0.3 * torch.randn(now.shape, generator=g, dtype=now.dtype),
            "ref_per_token_logps": now + 0.2 * torch.randn(now.shape, generator=g, dtype=now.dtype)}


def _trl(path, inputs, options) -> dict:
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        args = GRPOConfig(output_dir=str(path / "trl"), per_device_train_batch_size=ROWS, num_generations=ROWS,
                          max_completion_length=COMPLETION, temperature=TEMPERATURE, use_cpu=True, bf16=False,
                          report_to=[], **options)
        trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=args, train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * ROWS),
                              processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "metrics": metrics}


def _tptrain(path: str, inputs: dict, options: dict, out: str) -> None:
    """The same batch through GRPOTrainer's step on one process: rows of prompt + completion, the old and reference
    log-probabilities placed on the shifted-label grid."""
    from tptrain import GRPOConfig, GRPOTrainer
    from tptrain.losses import IGNORE_INDEX
    from tptrain.models import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    args = GRPOConfig(output_dir=f"{out}_run", per_device_train_batch_size=ROWS, num_generations=ROWS,
                      max_completion_length=COMPLETION, temperature=TEMPERATURE, max_steps=1, **options)
    trainer = GRPOTrainer(model, lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=[{"prompt": "a b"}])
    samples = []
    for p, c, m in zip(inputs["prompt_ids"], inputs["completion_ids"], inputs["completion_mask"]):
        samples.append({"input_ids": torch.cat([p, c]), "labels": torch.cat([torch.full_like(p, IGNORE_INDEX),
                                                                               c.masked_fill(m == 0, IGNORE_INDEX)])})
    batch = trainer._batch(samples)
    batch["advantages"] = inputs["advantages"]
    for key, name in (("old_per_token_logps", "old_logps"), ("ref_per_token_logps", "ref_logps")):
        grid = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
        grid[:, PROMPT - 1:PROMPT - 1 + COMPLETION] = inputs[key]
        batch[name] = grid
    trainer.model.train()
    loss = trainer.step.forward_backward([batch])
    grads = {n: p.grad.clone() for n, p in trainer.inner.named_parameters()}
    torch.save({"loss": loss.item(), "grads": grads, "metrics": trainer.step.metrics}, out)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_equal_trl(tmp_path, name):
    path = checkpoint(tmp_path / "ckpt")
    inputs = _with_old_and_ref(path, _inputs(4096))
    options = CASES[name]
    want = _trl(path, inputs, options)
    run_distributed(_tptrain, 1, str(path), inputs, options, str(tmp_path / "got.pt"))
    got = torch.load(tmp_path / "got.pt")
    torch.testing.assert_close(got["loss"], want["loss"], **CLOSE)
    assert abs(want["loss"]) > 1e-3, "the case must have a loss to compare"
    for key, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][key], grad, **CLOSE, msg=lambda m: f"{name} grad {key}: {m}")
    shown = [k for k in got["metrics"] if k == "kl" or "clip_ratio" in k]
    assert shown and all(k in want["metrics"] for k in shown), (shown, sorted(want["metrics"]))
    for key in shown:
        torch.testing.assert_close(got["metrics"][key], want["metrics"][key], **CLOSE, msg=lambda m: f"{name} {key}")


def test_per_token_log_probs_of_both_backends_and_both_heads(tmp_path):
    """Each position's loss of logits / temperature: the chunked head (training mode) equals the whole logits'
    (return_logits) and log_softmax of transformers' own logits, on tptrain's model and on transformers' under
    tptrain's engine, values and gradients."""
    import transformers

    from tptrain import DistributedConfig
    from tptrain.losses import IGNORE_INDEX
    from tptrain.models import AutoModelForCausalLM

    path = checkpoint(tmp_path / "ckpt")
    ids = torch.randint(0, 4000, (3, 10), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(torch.arange(10) < 3, IGNORE_INDEX)
    weights = torch.randn(3, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    logps = (hf(ids).logits[:, :-1] / TEMPERATURE).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    want = torch.nn.functional.pad(-logps * (labels[:, 1:] != IGNORE_INDEX), (0, 1))
    results = []
    for backend, whole in (("native", False), ("native", True), ("transformers", False)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                     distributed_config=DistributedConfig(backend=backend)).train()
        out = model(ids, labels=labels, per_token=True, temperature=TEMPERATURE,
                    **({"return_logits": True} if whole else {})).loss
        (out * weights).sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], want.detach(), rtol=1e-5, atol=1e-6)  # transformers' fp32 rotary
    for (out, grads), tol in zip(results[1:], (dict(rtol=1e-10, atol=1e-12), dict(rtol=1e-5, atol=1e-6))):
        torch.testing.assert_close(out, results[0][0], **tol)
        for name, grad in results[0][1].items():
            torch.testing.assert_close(grads[name], grad, **tol)
