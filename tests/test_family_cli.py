"""`tptrain train --model DIR` on every model type: a tiny checkpoint written by transformers, trained for the
smoke run's 4 steps at tp 2 (two ranks), its final checkpoint reloaded by tptrain and transformers.

The command runs as it does under torchrun (`torchrun -m tptrain train ...`: each rank runs `tptrain train` with
RANK set), in the suite's rank pool (tests/helpers/ranks.py), whose ranks have torch and tptrain imported already: 18
types x two fresh interpreters and a launcher were a minute and a half of the suite. The launcher itself (`tptrain
train` starting its own workers) is tested in test_train_cli.py, test_launch_faults.py and test_faults.py.

    .venv/bin/python -m pytest tests/test_family_cli.py -q
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.checkpoints import randomize, save_byte_tokenizer
from tests.helpers.configs import (DEEPSEEK_TINY, GEMMA_FAMILIES, MOE_FAMILIES, MOE_TINY, OLMO2_TINY, OLMO3_ROPE,
                                   OLMO3_TINY, PHI3_TINY, SIMPLE_FAMILIES, SIMPLE_TINY)
from tests.helpers.ranks import run_distributed
from tptrain import AutoModelForCausalLM
from tptrain.models import MODEL_REGISTRY
from tptrain.training.reporting import read_metrics

# A tokenizer.json of bytes beside the weights (save_byte_tokenizer): 257 ids, so a vocabulary of 320.
CLI_VOCAB = 320
FAMILIES = {
    "llama": dict(SIMPLE_TINY),
    "qwen2": dict(SIMPLE_TINY),
    "qwen3": dict(SIMPLE_TINY, head_dim=16),
    **SIMPLE_FAMILIES,
    "olmo2": OLMO2_TINY,
    "olmo3": dict(OLMO3_TINY, rope_parameters=OLMO3_ROPE),
    **GEMMA_FAMILIES,
    "phi3": PHI3_TINY,
    # mixture of experts, at tp 2 with the experts tensor-parallel (the default)
    **{name: {**MOE_TINY, **keys} for name, (_, _, keys) in MOE_FAMILIES.items()},
    "deepseek_v3": DEEPSEEK_TINY,
}


def test_every_model_type_has_a_smoke_run():
    assert set(FAMILIES) == set(MODEL_REGISTRY)


def _hf_model(model_type: str):
    import transformers
    # The smoke run's 32-token sequences need max_position_embeddings >= 32.
    kwargs = {**FAMILIES[model_type], "vocab_size": CLI_VOCAB, "pad_token_id": None, "max_position_embeddings": 64}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **kwargs))
    randomize(hf, norm_weight=0.0 if model_type.startswith("gemma") else 1.0)
    return hf


def _cli(argv: list[str]) -> None:
    """One rank of `tptrain train ARGV` (RANK set, as torchrun sets it: the command is this rank)."""
    from tptrain.cli import main
    code = main(["train", *argv])
    assert code == 0, f"tptrain train exited with {code}"


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_train_cli_smoke(model_type, tmp_path):
    import transformers
    hf = _hf_model(model_type)
    hf.save_pretrained(tmp_path / "model")
    save_byte_tokenizer(tmp_path / "model")
    run_distributed(_cli, 2, ["--smoke-test", "--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "run")])
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))), losses
    final = tmp_path / "run" / "final"
    ours = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert ours.config.model_type == model_type
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    ids = torch.randint(0, 257, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-4, atol=1e-4)
        trained = hf.eval()(ids).logits
    assert (ours(ids).logits - trained).abs().max() > 1e-4, "training changed nothing"
