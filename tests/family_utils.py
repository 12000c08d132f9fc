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
