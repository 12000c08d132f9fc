"""One batch of GRPO completions: this data-parallel rank's prompts, num_generations completions each generated
on the training shards (model.generate), scored by the reward functions, their advantages, and the micro-batches the
step trains on.

    rollout = make_rollout(trainer, indices)      # rollout.micro: collated rows with "advantages" (and old / ref
                                                 # log-probabilities); rollout.metrics: TRL's reward and length logs

Each row is its prompt then its completion (through the first eos, as TRL's completion mask), right-padded as the
Trainer's collator pads SFT rows, the completion's tokens its labels (none when mask_truncated_completions drops a
completion that never ended): per-token log-probabilities sit on the (rows, seq) grid of the shifted labels.
Rewards are gathered over the data-parallel ranks for TRL's batch-wide numbers (scale_rewards="batch", reward,
reward_std); each group's mean and std are its own rank's.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from tptrain.distributed import comm
from tptrain.distributed.topology import dp_mesh
from tptrain.generation import generate
from tptrain.losses import IGNORE_INDEX
from tptrain.training.rl.rewards import advantages, func_name, nanstd, score, weighted


@dataclass
class Completions:
    """Each completion's ids (through its eos), whether it was cut at max_completion_length, and its text (or
    assistant message) for the reward functions."""

    ids: list[list[int]]
    truncated: list[bool]
    texts: list[Any]


@dataclass
class Rollout:
    micro: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]
    iterations_left: int
    seconds: dict[str, float]  # time/generation, time/scoring (rewards, old and reference log-probabilities)


def generation_seeds(seed: int, generation: int, first: int, rows: int) -> list[int]:
    """Each completion's own seed in the `generation`-th batch: a function of the run's seed and the completion's
    place in the global batch (`first`: this rank's first), so completions are the same at every data-parallel size,
    and a run resumed from a checkpoint draws what the uninterrupted run would have."""
    return [zlib.crc32(f"{seed}/{generation}/{first + k}".encode()) for k in range(rows)]


def generate_completions(trainer: Any, rows: list[dict], seeds: list[int]) -> Completions:
    """num_generations sampled completions of each prompt of `rows` (each group consecutive), every rank of a TP
    group the same."""
    args, tok = trainer.args, trainer.tokenizer
    eos, pad = trainer.eos_token_ids, trainer.pad_token_id
    longest = max(len(r["prompt_ids"]) for r in rows)
    ids = torch.tensor([[pad] * (longest - len(r["prompt_ids"])) + r["prompt_ids"] for r in rows])
    mask = torch.tensor([[0] * (longest - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"]) for r in rows])
    with trainer.step.autocast():
        out = generate(trainer.inner, ids, mask, max_new_tokens=args.max_completion_length, do_sample=True,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                       eos_token_id=list(eos), pad_token_id=pad, stop_strings=args.stop_strings, tokenizer=tok,
                       generator=seeds, num_return_sequences=args.num_generations)
    kept, truncated = [], []
    for row in out[:, longest:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), None)
        if end is None and pad not in eos:  # stopped by a stop string: padding follows
            end = next((i for i, t in enumerate(row) if t == pad), None)
        kept.append(row[:end] if end is not None else row)
        truncated.append(not kept[-1] or kept[-1][-1] not in (*eos, pad))
    texts = [tok.decode([t for t in c if t not in eos]) for c in kept]
    if trainer.dataset.conversational:
        texts = [[{"role": "assistant", "content": t}] for t in texts]
    return Completions(kept, truncated, texts)


def make_rollout(trainer: Any, indices: list[int]) -> Rollout:
    """The rollout of this dp rank's prompts `indices` (collective over the run's ranks)."""
    args = trainer.args
    rows = [trainer.dataset[i] for i in indices]
    group = args.num_generations
    first = dp_mesh(trainer.mesh).get_local_rank() * len(rows) * group
    start = time.perf_counter()
    done = generate_completions(trainer, rows, generation_seeds(args.seed, trainer.generations, first, len(rows) * group))
    generated = time.perf_counter()
    prompts = [r["prompt"] for r in rows for _ in range(group)]
    columns = {k: [r["columns"][k] for r in rows for _ in range(group)] for k in rows[0]["columns"]}
    rewards, error = None, None
    try:
        rewards = score(trainer.reward_funcs, prompts, done.texts, done.ids, columns)
    except ValueError as exc:
        error = exc
    comm.raise_on_any_rank(error)  # a reward function's error on one dp rank reaches every rank
    everyone = comm.all_gather(rewards.to(trainer.device), dp_mesh(trainer.mesh).get_group(), dim=0).cpu()  # (all, funcs)
    total = weighted(rewards, args.reward_weights)
    batch_std = nanstd(weighted(everyone, args.reward_weights))
    adv = advantages(total, group=group, scale=args.scale_rewards, batch_std=batch_std)
    micro = _micro_batches(trainer, rows, done, adv)
    prompt_tokens = sum(len(r["prompt_ids"]) for r in rows) * group
    metrics = {**_reward_metrics(trainer, everyone, total), **_length_metrics(trainer, done, prompt_tokens)}
    seconds = {"time/generation": generated - start, "time/scoring": time.perf_counter() - generated}
    return Rollout(micro, metrics, iterations_left=args.num_iterations, seconds=seconds)


def _micro_batches(trainer: Any, rows: list[dict], done: Completions, adv: torch.Tensor) -> list[dict]:
    args = trainer.args
    samples = []
    for k, (completion, cut) in enumerate(zip(done.ids, done.truncated)):
        prompt = rows[k // args.num_generations]["prompt_ids"]
        counted = not (cut and args.mask_truncated_completions)
        labels = [IGNORE_INDEX] * len(prompt) + (completion if counted else [IGNORE_INDEX] * len(completion))
        samples.append({"input_ids": torch.tensor(prompt + completion), "labels": torch.tensor(labels)})
    b, micro = args.per_device_train_batch_size, []
    for start in range(0, len(samples), b):
        batch = trainer._batch(samples[start:start + b])
        batch["advantages"] = adv[start:start + b].to(trainer.device)
        micro.append(batch)
    with torch.no_grad():
        for batch in micro:
            if args.num_iterations > 1:  # the log-probabilities of the policy that generated them
                batch["old_logps"] = trainer.step.token_log_probs(batch).detach()
            if args.beta != 0.0:
                batch["ref_logps"] = trainer.reference.token_log_probs(batch, temperature=args.temperature)
    return micro


def _reward_metrics(trainer: Any, everyone: torch.Tensor, local: torch.Tensor) -> dict[str, float]:
    """TRL's names over the global batch: reward, reward_std, rewards/<func>/mean and /std, frac_reward_zero_std."""
    args = trainer.args
    out = {}
    for j, func in enumerate(trainer.reward_funcs):
        out[f"rewards/{func_name(func)}/mean"] = torch.nanmean(everyone[:, j]).item()
        out[f"rewards/{func_name(func)}/std"] = nanstd(everyone[:, j]).item()
    total = weighted(everyone, args.reward_weights)
    out["reward"], out["reward_std"] = torch.nanmean(total).item(), nanstd(total).item()
    stds = nanstd(total.view(-1, args.num_generations), dim=1)
    out["frac_reward_zero_std"] = torch.isclose(stds, torch.zeros_like(stds)).double().mean().item()
    return out


def _length_metrics(trainer: Any, done: Completions, prompt_tokens: int) -> dict[str, float]:
    """TRL's completions/* over the global batch (the lengths and cut flags gathered over dp), and num_tokens: the
    step's prompt and completion tokens."""
    local = torch.tensor([[len(c), float(t), prompt_tokens if k == 0 else 0] for k, (c, t) in
                          enumerate(zip(done.ids, done.truncated))], dtype=torch.float64, device=trainer.device)
    lengths, cut, prompts = comm.all_gather(local, dp_mesh(trainer.mesh).get_group(), dim=0).cpu().unbind(-1)
    ended = lengths[cut == 0]
    ended = ended if ended.numel() else torch.zeros(1, dtype=lengths.dtype)
    return {"num_tokens": int(prompts.sum() + lengths.sum()), "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": cut.mean().item(),
            "completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item()}
