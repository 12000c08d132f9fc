"""What several test files share, in one module, so that no test file imports another.

Sections: `tptrain train` as a subprocess; a TP model against its single-device copy; the Trainer's tiny model, data
and hand-written reference loop; private-memory sampling; the fault tests' process helpers; SFT chat records; the
model families' tiny configs, and what the OLMo and MoE files share.

Beside it: dist_utils.py (run a function on N ranks), family_utils.py (the family tests' batch and transformers
reference), sft_utils.py (the SFT tests' tokenizer and chat templates), deepseek_utils.py (DeepSeek-V3's tiny
checkpoint). The Trainer's modules are imported inside the functions that use them: the ranks spawned for a test
import its module, and so this one.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tests.dist_utils import require_distributed_marker
from tests.family_utils import VOCAB, check_against_hf
from tests.family_utils import batch as _batch
from tptrain import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.parallel.tensor_parallel import gather_full

if TYPE_CHECKING:
    from tptrain.training.args import TrainingArguments
    from tptrain.training.data import PackedDataset

ROOT = Path(__file__).resolve().parent.parent
F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)  # fp64: a layout bug is an O(1) error


# ------------------------------------------------------------------ `tptrain train` (from test_train_cli.py)


def tptrain_train(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return finish_tptrain_train(start_tptrain_train(*flags), timeout)


def start_tptrain_train(*flags: str) -> subprocess.Popen:
    """`tptrain train --smoke-test FLAGS` started, not waited for (finish_tptrain_train collects it)."""
    require_distributed_marker("tptrain train")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "tptrain", "train", "--smoke-test", *flags], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_tptrain_train(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(proc.args, *finish(proc, timeout))


# ------------------------------------------------------------------ TP against one device (from test_tensor_parallel.py)

TP_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
CONFIGS = {
    "qwen3": dict(model_type="qwen3", **TP_TINY),
    "qwen2": dict(model_type="qwen2", **{**TP_TINY, "head_dim": 16}),
    "llama_tied_llama3_rope": dict(model_type="llama", tie_word_embeddings=True,
                                   **{**TP_TINY, "num_key_value_heads": 4},
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen3_one_kv_head": dict(model_type="qwen3", **{**TP_TINY, "num_key_value_heads": 1}),
}


def make_config(name: str):
    kw = dict(CONFIGS[name])
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def batch(vocab: int, *, seed: int = 1, b: int = 2, s: int = 16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient, gathered (frozen ones, DeepSeek's e_score_correction_bias, have none)."""
    layout = model.parallel.tp
    return {n: gather_full(p.grad, layout.specs[n], layout.ctx) for n, p in model.named_parameters()
            if p.requires_grad}


def full_params(model) -> dict[str, torch.Tensor]:
    layout = model.parallel.tp
    return {n: gather_full(p.detach(), layout.specs[n], layout.ctx) for n, p in model.named_parameters()}


def assert_grads_match(model, ref, *, tol: dict = TOL, what: str = "grad") -> None:
    """Every gathered TP gradient equals the single-device one."""
    grads = full_grads(model)
    for n, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[n], p.grad, **tol, msg=lambda m: f"{what} of {n}: {m}")


def assert_params_match(model, ref, after: str) -> None:
    params = full_params(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(params[n], p.detach(), **TOL, msg=lambda m: f"{n} after {after}: {m}")


def assert_trains_like(model, ref, ids, labels, *, steps: int = 3, tol: dict = TOL, what: str = "tp") -> float:
    """The TP `model` equals its single-device copy `ref` on one batch: the logits, the loss of each of `steps`
    AdamW steps (lr 1e-2), every gathered gradient of the first and every parameter after the last. Returns
    max |logits - single-device logits|."""
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(logits, ref_logits, **tol, msg=lambda m: f"{what} logits: {m}")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        ref_loss, loss = ref(ids, labels=labels).loss, model(ids, labels=labels).loss
        torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"{what} loss, step {step}: {m}")
        ref_loss.backward()
        loss.backward()
        if step == 0:
            assert_grads_match(model, ref, tol=tol, what=f"{what} grad")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    assert_params_match(model, ref, f"{what}: {steps} AdamW steps")
    return (logits - ref_logits).abs().max().item()


# ------------------------------------------------------------------ the Trainer (from test_trainer.py)

SEQ = 16
# Qwen3: q/k norms are partial-gradient parameters; at tp 4 the 2 KV heads are shared by 2 ranks each.
TRAINER_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def tiny_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", **{**TRAINER_TINY, **overrides})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def save_perturbed(model_type: str, kw: dict, path: str) -> str:
    """A tiny fp64 native checkpoint of `model_type` at `path`, every parameter perturbed (norms away from 1: every
    parameter matters)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return path


def tiny_dataset(num_blocks: int = 64, seed: int = 1) -> PackedDataset:
    from tptrain.training.data import PackedDataset

    g = torch.Generator().manual_seed(seed)
    return PackedDataset(torch.randint(0, TRAINER_TINY["vocab_size"], (num_blocks * SEQ,), generator=g), SEQ)


def training_args(output_dir, **kw) -> TrainingArguments:
    from tptrain.training.args import TrainingArguments

    defaults = dict(per_device_train_batch_size=4, max_steps=20, seq_len=SEQ, learning_rate=3e-3, weight_decay=0.1,
                    warmup_steps=3, lr_scheduler_type="cosine", max_grad_norm=0.5, seed=7, logging_steps=5)
    return TrainingArguments(output_dir=str(output_dir), **{**defaults, **kw})


def _reference_optimizer(model, args: TrainingArguments):
    """AdamW and its learning-rate schedule as the Trainer builds them from `args`."""
    from tptrain.training.optim import lr_multiplier, param_groups

    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.learning_rate,
                            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(
        args.lr_scheduler_type, warmup_steps=args.warmup_steps, total_steps=args.max_steps))
    return opt, sched


def reference_losses(model, dataset, args: TrainingArguments, global_batch: int, *, collate_rows=None) -> list[float]:
    """Plain single-device training on the same global batches (max_grad_norm 0: no clipping, as the Trainer's).
    collate_rows: a batch's rows -> the model's keyword inputs, as the Trainer's collator makes them (default: the
    rows stacked, their own labels)."""
    from tptrain.training.data import DataOrder

    opt, sched = _reference_optimizer(model, args)
    order = DataOrder(len(dataset), seed=args.seed, dp_rank=0, dp_size=1, global_batch=global_batch)
    losses = []
    for _ in range(args.max_steps):
        rows = [dataset[i] for i in order.next_batch()]
        if collate_rows is None:
            ids = torch.stack(rows)
            loss = model(ids, labels=ids).loss
        else:
            loss = model(**collate_rows(rows)).loss
        loss.backward()
        if args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses


def microbatch_reference(model, args: TrainingArguments, *, global_batch: int, microbatches: int = 1, held=None,
                         eval_at: tuple[int, ...] = ()) -> tuple[list[float], dict[int, float]]:
    """Plain single-device training on tiny_dataset()'s global batches, each split into `microbatches` forwards of
    their own (the router aux loss per pipeline microbatch, as gradient accumulation makes it; the token loss over the
    step's token count), the gradient norm clipped to max_grad_norm: (each step's loss, {step: the loss over every
    row of `held`} at the steps `eval_at` names)."""
    from tptrain.losses import IGNORE_INDEX, shift_labels
    from tptrain.training.data import DataOrder

    data = tiny_dataset()
    opt, sched = _reference_optimizer(model, args)
    order = DataOrder(len(data), seed=args.seed, dp_rank=0, dp_size=1, global_batch=global_batch)
    losses, evals = [], {}
    for step in range(1, args.max_steps + 1):
        ids = torch.stack([data[i] for i in order.next_batch()])
        count, total = int((shift_labels(ids) != IGNORE_INDEX).sum()), 0.0
        for part in ids.chunk(microbatches):
            loss = model(part, labels=part, num_items_in_batch=count).loss
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(total)
        if step in eval_at:
            rows = torch.stack([held[i] for i in range(len(held))])
            with torch.no_grad():
                evals[step] = model.eval()(rows, labels=rows).loss.item()
            model.train()
    return losses, evals


# ------------------------------------------------------------------ private memory (from test_load_memory.py)

MB = 2**20
CONSTANT = 16 * MB  # allocator slack, Python objects made while loading
# A ~150 MB fp32 Qwen3 (test_checkpoint_memory.py, test_save_pretrained_stream.py).
BIG = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
           num_key_value_heads=4, head_dim=64, max_position_embeddings=64)


def pin_mmap_threshold(threshold: int = 64 * 1024) -> None:
    """Make glibc map every allocation over `threshold` on its own and unmap it when freed, so a freed tensor
    leaves RssAnon at once and cannot hide (or inflate) a later one. Called in the rank itself: a rank forked
    from the test fork server inherits that server's malloc settings, not the test's MALLOC_MMAP_THRESHOLD_;
    glibc's dynamic threshold then keeps freed tensors in the heap and the measured rise depends on which tests
    ran before."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (setting it also stops glibc's dynamic adjustment)
    libc.malloc_trim(0)  # what the heap already holds free goes back to the OS now


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Highest RssAnon seen while the block runs (sampled every 0.5 ms; torch copies release the GIL)."""

    def __enter__(self) -> "PeakSampler":
        self.peak, self._stop = _rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


# ------------------------------------------------------------------ launcher processes (from test_faults.py)

TIMING_FIELDS = ("step_time", "tokens_per_second",  # measured, so never the same twice
                 "peak_memory", "planned_peak_memory", "peak_memory_kind")


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running after {timeout} s: {proc.communicate()}") from None
    return proc.returncode, out, err


def metrics(out: Path) -> list[dict]:
    from tptrain.training.reporting import read_metrics

    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in read_metrics(out / "metrics.jsonl")]


# ------------------------------------------------------------------ SFT records (from test_sft_trainer.py)

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()


def chat_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)

    def say(k):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, k)))

    out = []
    for i in range(n):
        chat = [{"role": "user", "content": say(6)}, {"role": "assistant", "content": say(10)}]
        if i % 3 == 0:
            chat += [{"role": "user", "content": say(4)}, {"role": "assistant", "content": say(6)}]
        out.append({"messages": chat} if i % 4 else {"prompt": say(5), "completion": " " + say(8)})
    return out


# ------------------------------------------------------------------ the families' tiny configs (test_family_cli.py
# trains each one with `tptrain train`)

# test_families_simple.py
SIMPLE_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   max_position_embeddings=256, num_attention_heads=4,
                   num_key_value_heads=2)  # 2 KV heads: replicated twice at tp 4
SIMPLE_FAMILIES = {
    # a window of 5 < SEQ keys, head_dim 24 != hidden / heads
    "mistral": dict(SIMPLE_TINY, head_dim=24, sliding_window=5),
    # one sliding layer, one full layer
    "ministral": dict(SIMPLE_TINY, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    # YaRN (both mscales, so cos and sin are scaled too) and queries scaled past position 6 (Llama 4 temperature);
    # sliding_window applies to every layer, as in Mistral
    "ministral3": dict(SIMPLE_TINY, head_dim=16, sliding_window=5, max_position_embeddings=24, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=6, beta_fast=8.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=0.5, llama_4_scaling_beta=0.3)),
    # every multiplier away from 1, attention bias, tied embeddings
    "granite": dict(SIMPLE_TINY, embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.1,
                    logits_scaling=4.0, attention_bias=True, tie_word_embeddings=True),
    # layer 1 without RoPE
    "smollm3": dict(SIMPLE_TINY, no_rope_layers=[1, 0], pad_token_id=None, bos_token_id=1, eos_token_id=2),
}

# test_family_gemma.py
GEMMA_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, max_position_embeddings=64, sliding_window=4,
                  query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention"] * 2)
GEMMA_FAMILIES = {
    "gemma2": dict(GEMMA_TINY, attn_logit_softcapping=5.0, final_logit_softcapping=5.0),
    "gemma3_text": dict(GEMMA_TINY, final_logit_softcapping=5.0, rope_theta=1e5, rope_local_base_freq=100.0,
                        rope_scaling={"rope_type": "linear", "factor": 2.0}),
}

# test_family_phi3.py
PHI3_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                 partial_rotary_factor=0.5)

# test_family_olmo2.py
OLMO2_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2)

# test_family_olmo3.py
OLMO3_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
OLMO3_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2, sliding_window=4,
                  layer_types=OLMO3_LAYER_TYPES)
OLMO3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}

# test_moe.py
MOE_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=True, eos_token_id=2,
                pad_token_id=0)
MOE_FAMILIES = {  # model_type: (transformers class names, family keys)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, head_dim=16, mlp_only_layers=[1], norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4)),
}

# test_moe_training.py: top-1 of 4 experts: at 2 ranks expert parallelism dispatches by all-to-all; the aux loss is on.
MOE_TRAIN_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, num_experts=4, num_experts_per_tok=1, output_router_logits=True,
                      router_aux_loss_coef=0.05)


# ------------------------------------------------------------------ mixture of experts (test_moe.py, test_moe_ep.py)

# transformers normalises (RMSNorm) and routes (softmax) in fp32 even in an fp64 model; tptrain routes in fp32 too.
MOE_HF_TOL = dict(rtol=1e-5, atol=1e-5)


def _hf(path):
    import transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    hf.set_experts_implementation("eager")
    return hf


def _hf_grad(hf_grads: dict, name: str, inner: int) -> torch.Tensor:
    """transformers' gradient for tptrain parameter `name` (its experts are fused gate_up_proj, down_proj)."""
    if name.endswith("experts.gate_proj") or name.endswith("experts.up_proj"):
        fused = hf_grads[name.rpartition(".")[0] + ".gate_up_proj"]
        return fused[:, :inner] if name.endswith("gate_proj") else fused[:, inner:]
    return hf_grads[name]


def _route_to_first_rank(model, experts_on_rank0: int) -> None:
    """Every token's experts -> experts held by rank 0 (ids modulo its count): the other ranks' experts get none."""
    for block in model.modules():
        if hasattr(block, "route"):
            route = block.route

            def first_only(x, route=route):
                logits, weights, ids = route(x)
                return logits, weights, ids % experts_on_rank0

            block.route = first_only


# ------------------------------------------------------------------ OLMo 2 and OLMo 3 (test_family_olmo2.py, ...olmo3.py)

# transformers' Olmo2RMSNorm normalises in fp32 even in an fp64 model (tptrain: in fp64), ~1e-6 apart.
OLMO2_HF_TOL = dict(rtol=1e-6, atol=1e-6)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TOL = dict(rtol=1e-5, atol=1e-5)  # the bases differ by transformers' fp32 RoPE (~1e-6)


def _check_against_hf(model, expected, what: str) -> float:
    return check_against_hf(model, expected, what, OLMO2_HF_TOL)


def _equivalence(model, ref, *, steps: int = 3) -> float:
    """Logits, gradients of every parameter and 3 AdamW steps of the TP `model` equal the single-device `ref`;
    returns max |logits - single-device logits|."""
    return assert_trains_like(model, ref, *_batch(seed=2), steps=steps, tol=TOL)


def _peft_adapter(path, out_dir):
    """A random peft adapter on transformers' OLMo 2, saved to `out_dir`; returns its logits."""
    import peft
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                    task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
        model.save_pretrained(out_dir)
        return model(_batch()[0]).logits


def _lora_crossing(path, peft_dir, adapter_dir) -> dict[str, torch.Tensor]:
    """peft's adapter on a tp 2 base, and a tptrain-trained adapter (2 AdamW steps) saved for peft."""
    from tptrain.peft import LoraConfig, PeftModel, get_peft_model
    config = DistributedConfig(tp_size=2)
    ids = _batch()[0]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=F64,
                                                                            distributed_config=config), peft_dir)
    with torch.no_grad():
        peft_logits = loaded(ids).logits
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=config),
                           LoraConfig(r=4, lora_alpha=16, target_modules=LORA_TARGETS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_ids, labels = _batch(seed=4)
    for _ in range(2):
        model(train_ids, labels=labels).loss.backward()
        opt.step(), opt.zero_grad()
    model.save_pretrained(adapter_dir)
    model.eval()
    with torch.no_grad():
        return {"peft_adapter": peft_logits, "tptrain_adapter": model(ids).logits}


def _assert_lora_crossed(path, result, peft_logits, adapter_dir) -> None:
    """LoRA on every linear layer crossed both ways: peft's adapter on the tp 2 model gave peft's logits, and the
    tptrain-trained adapter in `adapter_dir` gives in peft + transformers what it gave at tp 2; both change the model."""
    import peft
    import transformers
    torch.testing.assert_close(result["peft_adapter"], peft_logits, **LORA_TOL)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    with torch.no_grad():
        plain = base(_batch()[0]).logits
        reloaded = peft.PeftModel.from_pretrained(base, adapter_dir)(_batch()[0]).logits
    torch.testing.assert_close(reloaded, result["tptrain_adapter"], **LORA_TOL)
    assert (result["tptrain_adapter"] - plain).abs().max() > 1e-2 and (peft_logits - plain).abs().max() > 1e-2


def tiny_moe(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The training tests' tiny Qwen3-MoE with top-2 routing and no router aux loss."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **{**MOE_TRAIN_TINY, "num_experts_per_tok": 2, "output_router_logits": False})
    return AutoModelForCausalLM.from_config(config, dtype=dtype)



def random_lora(model, seed: int) -> None:
    """Every LoRA tensor random (peft starts lora_B at zero, which would hide a layout bug)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def adapter_keys_and_shapes(path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of the adapter_model.safetensors in `path`."""
    from safetensors import safe_open

    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
