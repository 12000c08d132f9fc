"""A GRPO step of tptrain's GRPOTrainer, its time split into generation, scoring and training, and each rank's
memory with a frozen reference copy (beta > 0) and without one (beta = 0).

Each run: a Qwen3 of --hidden width and --layers layers written by transformers (fp32), --prompts prompts of about
--prompt-length tokens, --generations completions of up to --completion-length tokens each, --batch completions per
rank per step, AdamW, one reward function (a keyword's share of the text), at --tp-size (the ranks past it
data-parallel: --ranks). The step's time comes from metrics.jsonl: time/generation (model.generate on the training
shards), time/scoring (the rewards, the advantages, old and reference log-probabilities) and the rest of step_time
(training: the forward and backward of the loss, the optimizer step); the medians over the steps after --warmup. Max
RSS is each rank's ru_maxrss at the end.

    python benchmarks/bench_grpo.py                                  # ~0.1B parameters, tp 2 (minutes on 2 cores)
    python benchmarks/bench_grpo.py --hidden 128 --layers 2 --steps 3 --warmup 1 --completion-length 8   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = "to be or not that is the question whether tis nobler in the mind suffer slings arrows".split()


def keyword(prompts, completions, **columns):
    """The share of a completion's words that are "the"."""
    return [c.split().count("the") / max(len(c.split()), 1) for c in completions]


def _prompts(n: int, length: int) -> list[dict]:
    words = max(2, length * 2 // 3)  # ~1.5 tokens a word
    return [{"prompt": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)) + ":"} for i in range(n)]


def _checkpoint(directory: Path, hidden: int, layers: int) -> None:
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from tests.helpers.chat import CHATML_GENERATION, chat_checkpoint

    chat_checkpoint(directory, CHATML_GENERATION)
    config = transformers.Qwen3Config(vocab_size=4160, hidden_size=hidden, intermediate_size=3 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                      head_dim=hidden // 8, max_position_embeddings=4096, tie_word_embeddings=False,
                                      eos_token_id=4097, pad_token_id=4097)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(directory)


def _worker(args) -> None:
    import torch

    from tptrain import DistributedConfig, GRPOConfig, GRPOTrainer
    from tptrain.models import AutoModelForCausalLM
    from tptrain.training.args import ParallelismConfig

    torch.set_num_threads(args.worker_threads)
    out = Path(args.out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = DistributedConfig(tp_size=args.tp_size) if args.tp_size > 1 else None
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, distributed_config=config)
    grpo = GRPOConfig(output_dir=str(out), overwrite_output_dir=True, per_device_train_batch_size=args.batch,
                      num_generations=args.generations, max_completion_length=args.completion_length,
                      max_steps=args.steps, beta=args.beta, learning_rate=1e-6, logging_steps=1, seed=3,
                      parallelism_config=ParallelismConfig(dp_shard_size=world // args.tp_size))
    GRPOTrainer(model, keyword, args=grpo, train_dataset=_prompts(args.prompts, args.prompt_length)).train()
    rank = os.environ.get("RANK", "0")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out.parent / f"{out.name}-rank{rank}.json").write_text(json.dumps({"max_rss_mb": rss}))


def _run(args, tmp: Path, name: str, beta: float) -> dict:
    threads = max(1, args.threads // args.ranks)
    command = [str(Path(__file__).resolve()), "--worker", "--out", str(tmp / name), "--model", str(tmp / "ckpt"),
               "--beta", str(beta), "--worker-threads", str(threads)]
    for flag in ("tp_size", "batch", "generations", "completion_length", "steps", "prompts", "prompt_length"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    launch = [sys.executable] if args.ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc-per-node", str(args.ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    subprocess.run(launch + command, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
    lines = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    median = {key: statistics.median(line[key] for line in lines)
              for key in ("step_time", "time/generation", "time/scoring", "completions/mean_length")}
    median["training"] = statistics.median(line["step_time"] - line["time/generation"] - line["time/scoring"]
                                           for line in lines)
    median["rss"] = [json.loads((tmp / f"{name}-rank{r}.json").read_text())["max_rss_mb"] for r in range(args.ranks)]
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="processes (the ones past --tp-size data-parallel)")
    parser.add_argument("--batch", type=int, default=8, help="completions per rank per step")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--beta", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _checkpoint(tmp / "ckpt", args.hidden, args.layers)
        runs = {"beta 0 (no reference)": _run(args, tmp, "beta0", 0.0),
                "beta 0.04 (a frozen reference copy)": _run(args, tmp, "beta", 0.04)}
    print(f"GRPO step: Qwen3 hidden {args.hidden} x {args.layers} layers (fp32), tp {args.tp_size} on {args.ranks} "
          f"ranks, {args.batch} completions/rank/step ({args.generations} per prompt) of <= {args.completion_length} "
          f"tokens, {args.threads} threads in all; medians of steps {args.warmup + 1} to {args.steps}")
    print(f"{'run':38s} {'generation s':>12s} {'scoring s':>10s} {'training s':>10s} {'step s':>8s} "
          f"{'mean length':>11s} {'max RSS MB/rank':>16s}")
    for name, r in runs.items():
        rss = "/".join(f"{v:.0f}" for v in r["rss"])
        print(f"{name:38s} {r['time/generation']:12.3f} {r['time/scoring']:10.3f} {r['training']:10.3f} "
              f"{r['step_time']:8.3f} {r['completions/mean_length']:11.1f} {rss:>16s}")


if __name__ == "__main__":
    main()
