"""What the family tests share: one labelled batch, transformers' reference on it, a transformers model with
every parameter random, and the comparison against that reference (vocab 128, batch 2 x 12 in every file)."""
from __future__ import annotations

import torch

F64 = torch.float64
VOCAB, B, S = 128, 2, 12


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) with some -100 labels, so ignored positions are tested too."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, -4:-1] = -100
    return ids, labels


def hf_reference(hf) -> dict[str, torch.Tensor]:
    """transformers' logits and loss on `batch()` (its loss is computed in fp32 whatever the model's dtype)."""
    ids, labels = batch()
    with torch.no_grad():
        return {"logits": hf(ids).logits, "loss": hf(ids, labels=labels).loss.to(F64)}


def randomize(hf, seed: int = 0, *, norm_weight: float = 1.0) -> None:
    """Every parameter random (scale 0.2); norm weights around `norm_weight` (0 for (1 + w) norms)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (norm_weight if name.endswith("norm.weight") else 0.0))


def random_checkpoint(tmp_path_factory, name: str, build, *, norm_weight: float = 1.0):
    """(directory, model): transformers' model from `build()` (seed 0), every parameter random, its experts (if any)
    through the eager loop (its grouped_mm kernels take no fp64), saved by its own save_pretrained."""
    torch.manual_seed(0)
    hf = build().eval()
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")
    randomize(hf, norm_weight=norm_weight)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return path, hf


def transformers_fp64(path):
    """transformers' model from `path` in fp64, eval mode, its experts (if any) through the eager loop."""
    import warnings

    import transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")  # its grouped_mm kernels take no fp64
    return hf


def step_both(ref, model, batches, dp=None, summed=lambda name: True):
    """One training step's forward and backward of the one-process `ref` and the distributed `model` on
    `dp_batches`' `batches`: (the loss summed over `dp`, ref's loss); over `dp` the gradients of the parameters
    named by `summed` are summed as data parallelism sums them."""
    import torch.distributed as dist
    ids, labels, all_ids, all_labels, count = batches
    ref_loss = ref(all_ids, labels=all_labels, num_items_in_batch=count).loss
    loss = model(ids, labels=labels, num_items_in_batch=count).loss
    ref_loss.backward(), loss.backward()
    if dp is not None:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=dp.get_group())
        for n, p in model.named_parameters():
            if p.grad is not None and summed(n):
                dist.all_reduce(p.grad, group=dp.get_group())
    return loss, ref_loss


def dp_batches(dp=None, seed: int = 2):
    """(ids, labels) this rank feeds and (all ids, all labels, token count) one process feeds: `batch(seed)` without
    data parallelism; over `dp` (a process-group mesh) each rank its own batch (seed 10 + rank), one process their
    concatenation (every loss then normalised by the global token count)."""
    if dp is None:
        ids, labels = all_ids, all_labels = batch(seed=seed)
    else:
        parts = [batch(seed=10 + r) for r in range(dp.size())]
        ids, labels = parts[dp.get_local_rank()]
        all_ids, all_labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return ids, labels, all_ids, all_labels, int((all_labels[:, 1:] != -100).sum())


def check_against_hf(model, expected: dict[str, torch.Tensor], what: str, tol: dict) -> float:
    """Asserts logits and loss equal transformers'; returns max |logits - transformers|."""
    ids, labels = batch()
    with torch.no_grad():
        logits, loss = model(ids).logits, model(ids, labels=labels).loss
    torch.testing.assert_close(logits, expected["logits"], **tol, msg=lambda m: f"{what} logits: {m}")
    torch.testing.assert_close(loss, expected["loss"], **tol, msg=lambda m: f"{what} loss: {m}")
    return (logits - expected["logits"]).abs().max().item()


def save_byte_tokenizer(directory) -> None:
    """A tokenizer.json of UTF-8 bytes (ids 0..255, eos 256) in `directory`, for checkpoints that tests write
    without one: a checkpoint with weights is trained only on a tokenizer of its own (no byte-level fallback)."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
