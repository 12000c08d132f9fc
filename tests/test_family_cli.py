"""`tptrain train --model DIR` on every model type: a tiny checkpoint written by transformers, trained for the
smoke run's 4 steps at tp 2 (two worker processes), its final checkpoint reloaded by tptrain and transformers.

Each test starts the next selected model type's run before it waits for its own: two runs at a time keep both
cores busy through the other's start-up and teardown (18 runs: ~220 s one at a time, ~160 s so).

    .venv/bin/python -m pytest tests/test_family_cli.py -q
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.deepseek_utils import DEEPSEEK_TINY
from tests.family_utils import randomize, save_byte_tokenizer
from tests.helpers import (GEMMA_FAMILIES, MOE_FAMILIES, MOE_TINY, OLMO2_TINY, OLMO3_ROPE, OLMO3_TINY, PHI3_TINY,
                           SIMPLE_FAMILIES, SIMPLE_TINY, finish_tptrain_train, start_tptrain_train)
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


def _start(model_type: str, directory: Path):
    """Write `model_type`'s checkpoint (transformers) in `directory` and start its run; (process, the model)."""
    hf = _hf_model(model_type)
    hf.save_pretrained(directory / "model")
    save_byte_tokenizer(directory / "model")
    return start_tptrain_train("--model", str(directory / "model"), "--output-dir", str(directory / "run")), hf


def _next_selected(request) -> str | None:
    """The model type of the next test of this function that pytest will run (None: this is the last)."""
    items = request.session.items
    here = items.index(request.node)
    for item in items[here + 1:]:
        if item.module is request.node.module and item.originalname == request.node.originalname:
            return item.callspec.params["model_type"]
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{model_type: (directory, process, the transformers model)} of the runs started and not yet collected."""
    started: dict = {}

    def start(model_type: str) -> None:
        if model_type not in started:
            directory = tmp_path_factory.mktemp(f"cli-{model_type}")
            started[model_type] = (directory, *_start(model_type, directory))

    yield started, start
    for _, proc, _ in started.values():  # a run whose test never came (an interrupted session)
        proc.kill()
        proc.communicate()


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_train_cli_smoke(model_type, runs, request):
    import transformers
    started, start = runs
    start(model_type)
    following = _next_selected(request)
    if following is not None:
        start(following)  # runs while this test waits for its own
    directory, proc, hf = started.pop(model_type)
    run = finish_tptrain_train(proc)
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [r["loss"] for r in read_metrics(directory / "run" / "metrics.jsonl")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))), losses
    final = directory / "run" / "final"
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
