"""Vision-language models (tptrain.AutoModelForImageTextToText, the transformers backend): the text decoder split by
its config's plan, the vision tower and projector by theirs or by the plan tptrain derives, against transformers on
one process (fp64): the loss, every gradient (the tower's too) and 3 AdamW steps at tp 2 and tp 4 (4 query heads,
2 KV heads: tp 4 replicates them), and the checkpoint saved at tp reloaded by transformers, bit for bit.

    .venv-vision/bin/python -m pytest tests/test_vlm.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers import full_params
from tests.vlm_utils import F64, FAMILIES, batch, write_checkpoint
from tptrain.parallel.shards import gather_full

pytestmark = pytest.mark.vision
# transformers' norms and its loss compute in fp32 inside an fp64 model: a sum taken in another order moves results by
# fp32 rounding (~1e-7); a layout bug is an O(1) error.
TOL = dict(rtol=1e-6, atol=1e-6)
STEP_TOL = dict(rtol=1e-5, atol=1e-5)  # AdamW divides by sqrt(v): a near-zero gradient's rounding, magnified
TYPES = tuple(FAMILIES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{model_type: (directory written by transformers, a labelled batch)}, and a processor file beside each."""
    out = {}
    for model_type in TYPES:
        path, hf = write_checkpoint(tmp_path_factory, model_type)
        (path / "preprocessor_config.json").write_text('{"test": "copied beside the weights"}\n')
        out[model_type] = (path, batch(model_type, hf))
    return out


def _transformers(path):
    """transformers' model in fp64, train mode, its experts (if any) through the eager loop (no fp64 kernel)."""
    import transformers
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=F64).train()
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")
    return hf


def _equivalence(model, ref, inputs: dict, steps: int = 3) -> None:
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)  # as the survey's: a near-zero gradient's
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)      # rounding is not a whole step
    for step in range(steps):
        ref_loss, loss = ref(**inputs).loss, model(**inputs).loss
        torch.testing.assert_close(loss, ref_loss.to(F64), **TOL, msg=lambda m: f"loss at step {step}: {m}")
        ref_loss.backward(), loss.backward()
        if step == 0:
            grads = _gathered_grads(model)
            for name, p in ref.named_parameters():
                if p.grad is None:  # a part this input does not reach (SigLIP's pooling head): in neither model
                    assert grads[name] is None, name
                    continue
                torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"grad of {name}: {m}")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    params = full_params(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), **STEP_TOL, msg=lambda m: f"{name} after {steps}: {m}")


def _gathered_grads(model) -> dict:
    """Every parameter's gradient at full shape (None where the input does not reach it: on every rank alike)."""
    layout = model.tp_layout
    return {n: None if p.grad is None else gather_full(p.grad, layout.specs[n], layout.ctx)
            for n, p in model.named_parameters()}


def _tp_worker(tp: int, checkpoints: dict, save_root) -> None:
    from tptrain import AutoModelForImageTextToText, DistributedConfig
    for model_type, (path, inputs) in checkpoints.items():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=F64,
                                                            distributed_config=DistributedConfig(tp_size=tp)).train()
        assert model.backend == "transformers" and model.tp_size == tp
        split = [n for n, spec in model.tp_layout.specs.items() if spec.dim is not None]
        text = [n for n in split if n.startswith(model._text_decoder + ".")]
        assert text and any(n not in text and "lm_head" not in n for n in split), (model_type, "a tower split")
        model.save_pretrained(save_root / model_type)
        _equivalence(model, _transformers(path), inputs)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_transformers_and_saves_for_transformers(checkpoints, tmp_path, tp):
    run_distributed(_tp_worker, tp, tp, checkpoints, tmp_path, timeout=600)
    for model_type, (path, _) in checkpoints.items():
        saved, original = _transformers(tmp_path / model_type), _transformers(path)
        assert type(saved) is type(original)
        for (name, p), (_, q) in zip(saved.named_parameters(), original.named_parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"{model_type} {name}: {m}")
        assert (tmp_path / model_type / "preprocessor_config.json").read_text() == \
            (path / "preprocessor_config.json").read_text()
