"""What the preference-tuning tests share: a tiny fp64 checkpoint written by transformers (the ChatML tokenizer, no bos
token, so TRL's CPO / ORPO tokenization adds none), preference records in TRL's formats, TRL 1.16's trainers run on
them, and tptrain's DPOTrainer run the same way."""
from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import torch

from tests.helpers.chat import CHATML_GENERATION, WORDS, chat_checkpoint

F64 = torch.float64
TINY = dict(vocab_size=4160, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
# The optimizer both sides run: AdamW at a constant rate, no decay, no clipping (TRL's defaults otherwise)
OPTIM = dict(learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
             seed=3)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=True,
           router_aux_loss_coef=0.05, norm_topk_prob=True)


def checkpoint(directory: Path, *, moe: bool = False, **config) -> Path:
    """A tiny Qwen3 (`moe`: Qwen3-MoE, its router aux loss on) written by transformers (fp64, every weight random)
    with the ChatML tokenizer and template."""
    import transformers

    chat_checkpoint(directory, CHATML_GENERATION)
    tok_config = json.loads((directory / "tokenizer_config.json").read_text())
    tok_config["bos_token"] = None  # no bos: TRL's CPO / ORPO tokenization would prepend one, DPO's does not
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    torch.manual_seed(0)
    kind = "Qwen3Moe" if moe else "Qwen3"
    hf_config = getattr(transformers, f"{kind}Config")(**{**TINY, **(MOE if moe else {}), **config}, eos_token_id=4097,
                                                       pad_token_id=4097, bos_token_id=None)
    model = getattr(transformers, f"{kind}ForCausalLM")(hf_config).to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return directory


def say(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, most)))


def plain_records(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": say(rng, 6) + ":", "chosen": " " + say(rng, 8), "rejected": " " + say(rng, 8)} for _ in range(n)]


def chat_records(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": say(rng, 6)}],
             "chosen": [{"role": "assistant", "content": say(rng, 8)}],
             "rejected": [{"role": "assistant", "content": say(rng, 8)}]} for _ in range(n)]


def trl_run(model_dir: Path, out: Path, records: list[dict], *, trainer: str = "dpo", steps: int = 3, batch: int = 4,
            **options) -> dict:
    """TRL 1.16's DPOTrainer (or trl.experimental's CPOTrainer / ORPOTrainer: trainer="cpo" / "orpo") on one
    process: each step's loss and metrics, and the parameters after `steps` steps (fp64)."""
    import datasets
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=F64)
    config_class, trainer_class = _trl_classes(trainer)
    args = config_class(output_dir=str(out), per_device_train_batch_size=batch, max_steps=steps, bf16=False,
                        use_cpu=True, logging_steps=1, report_to=[], save_strategy="no", **OPTIM, **options)
    run = trainer_class(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                        processing_class=tokenizer)
    run.train()
    logs = [entry for entry in run.state.log_history if "loss" in entry and "train_runtime" not in entry]
    return {"logs": logs, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _trl_classes(trainer: str):
    if trainer == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        return CPOConfig, CPOTrainer
    if trainer == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        return ORPOConfig, ORPOTrainer
    from trl import DPOConfig, DPOTrainer
    return DPOConfig, DPOTrainer


def full_tensors(model, which: str) -> dict[str, torch.Tensor]:
    """{name: the parameter's full tensor ("params") or its gradient's ("grads")} of every trained parameter this
    rank's stage holds, gathered over FSDP2's shards and then TP's (collective over both)."""
    from torch.distributed.tensor import DTensor

    from tptrain.distributed.state import state_of
    from tptrain.parallel.tensor_parallel import gather_full

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layout = state_of(inner).tp
    out = {}
    for name, p in inner.named_parameters():
        if not p.requires_grad:
            continue
        t = (p if which == "params" else p.grad).detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[name] = (t if layout is None else gather_full(t, layout.specs[name], layout.ctx)).cpu().clone()
    return out


def record_gradients(trainer) -> list[dict[str, torch.Tensor]]:
    """Each step's full gradients, gathered just before the optimizer steps (after every sum over the axes)."""
    steps: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step

    def recorded(*args, **kwargs):
        steps.append(full_tensors(trainer.model, "grads"))
        return step(*args, **kwargs)

    trainer.optimizer.step = recorded
    return steps


def load_at_layout(tmp: str, name: str, layout: dict, lora: dict | None):
    """The fp64 checkpoint under `tmp` (`moe` for a run named moe*, else `ckpt`) loaded at `layout` (DistributedConfig
    keywords; {}: one process), with LoRA adapters of `lora` (seeded 0) where given."""
    from tptrain import DistributedConfig
    from tptrain.models import AutoModelForCausalLM
    from tptrain.peft import LoraConfig, get_peft_model

    path = f"{tmp}/moe" if name.startswith("moe") else f"{tmp}/ckpt"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                 distributed_config=DistributedConfig(**layout) if layout else None)
    if lora is not None:
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(**lora))
    return model


def train_and_save(trainer, tmp: str, name: str) -> None:
    """Train; each rank saves its gradients before every step and its parameters after the last to
    `tmp/name-RANK.pt`, rank 0 the losses to `tmp/name.json`."""
    import torch.distributed as dist

    grads = record_gradients(trainer)
    out = trainer.train()
    params = full_tensors(trainer.model, "params")
    rank = dist.get_rank()
    torch.save({"grads": grads, "params": params}, f"{tmp}/{name}-{rank}.pt")
    if rank == 0:
        json.dump(out.losses, open(f"{tmp}/{name}.json", "w"))
