"""A DPO step: TRL 1.16's DPOTrainer against tptrain's DPOTrainer, on the same checkpoint and batches.

TRL's DPOTrainer has no tensor parallelism of its own on CPU (transformers' TP needs accelerate's ParallelismConfig
and CUDA-style device meshes), so TRL runs on one process and tptrain on one process and at tp 2 (two ranks of
--threads // 2 threads each). Each run: a Qwen3 of --hidden width and --layers layers written by transformers (fp32),
--pairs preference pairs of --length tokens a row, --batch pairs per step, AdamW, a frozen copy as the reference
(TRL's own, loaded from the same checkpoint); the median of the step times after --warmup steps, and the largest
resident set of each rank (ru_maxrss). Then tptrain with precompute_ref_log_probs: the one pass over the pairs
before training (one forward per pair) and its step time without the reference's forward.

    python benchmarks/bench_dpo.py                       # ~0.1B-parameter model, 3 runs (minutes on 2 cores)
    python benchmarks/bench_dpo.py --hidden 256 --layers 2 --steps 4   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = "to be or not that is the question whether tis nobler in the mind suffer slings arrows".split()


def _records(pairs: int, length: int) -> list[dict]:
    rng = random.Random(0)

    def say(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))

    words = max(4, length // 3)  # ~1.5 tokens a word: rows of about `length` tokens
    return [{"prompt": say(words // 3) + ":", "chosen": " " + say(words), "rejected": " " + say(words)}
            for _ in range(pairs)]


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


def _trl(args, out: Path) -> dict:
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    config = DPOConfig(output_dir=str(out), per_device_train_batch_size=args.batch, max_steps=args.steps, bf16=False,
                       use_cpu=True, report_to=[], save_strategy="no", learning_rate=1e-6, max_length=args.length,
                       gradient_checkpointing=False, logging_steps=1000, seed=3)
    trainer = DPOTrainer(model=model, args=config, processing_class=tokenizer, callbacks=[Timer()],
                         train_dataset=datasets.Dataset.from_list(_records(args.pairs, args.length)))
    trainer.train()
    return {"steps": times}


def _tptrain(args, out: Path) -> dict:
    import torch

    from tptrain import DistributedConfig
    from tptrain.models import AutoModelForCausalLM
    from tptrain.training.preference import DPOConfig, DPOTrainer

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_size=tp) if tp > 1 else None)
    config = DPOConfig(output_dir=str(out), overwrite_output_dir=True, per_device_train_batch_size=args.batch,
                       max_steps=args.steps, learning_rate=1e-6, max_length=args.length, seed=3, logging_steps=1,
                       data_cache_dir=str(out.parent / "cache"), precompute_ref_log_probs=args.precompute)
    start = time.perf_counter()
    trainer = DPOTrainer(model, args=config, train_dataset=_records(args.pairs, args.length))
    setup = time.perf_counter() - start
    trainer.train()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [line["step_time"] for line in lines], "setup": setup}


def _worker(args) -> None:
    import torch

    torch.set_num_threads(args.worker_threads)
    out = Path(args.out)
    result = (_trl if args.worker == "trl" else _tptrain)(args, out)
    rank = os.environ.get("RANK", "0")
    result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out.parent / f"{out.name}-rank{rank}.json").write_text(json.dumps(result))


def _run(args, tmp: Path, name: str, kind: str, ranks: int, *extra: str) -> list[dict]:
    threads = max(1, args.threads // ranks)
    common = [str(Path(__file__).resolve()), "--worker", kind, "--out", str(tmp / name), "--model", str(tmp / "ckpt"),
              "--pairs", str(args.pairs), "--length", str(args.length), "--batch", str(args.batch), "--steps",
              str(args.steps), "--worker-threads", str(threads), *extra]
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc-per-node", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    subprocess.run(launch + common, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
    return [json.loads((tmp / f"{name}-rank{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--worker", choices=["trl", "tptrain"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--worker-threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--precompute", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _checkpoint(tmp / "ckpt", args.hidden, args.layers)
        runs = {"TRL DPOTrainer, 1 process": _run(args, tmp, "trl", "trl", 1),
                "tptrain DPOTrainer, 1 process": _run(args, tmp, "one", "tptrain", 1),
                "tptrain DPOTrainer, tp 2": _run(args, tmp, "tp2", "tptrain", 2),
                "tptrain, tp 2, precompute_ref_log_probs": _run(args, tmp, "pre", "tptrain", 2, "--precompute")}
    print(f"DPO step: Qwen3 hidden {args.hidden} x {args.layers} layers (fp32), {args.batch} pairs/step of <= "
          f"{args.length} tokens a row, {args.threads} threads in all (per rank: threads // ranks)")
    print(f"{'run':42s} {'ranks':>5s} {'thr/rank':>8s} {'step s (median)':>16s} {'max RSS MB/rank':>16s}")
    base = None
    for name, ranks in runs.items():
        step = statistics.median(ranks[0]["steps"][args.warmup:])
        base = base or step
        rss = "/".join(f"{r['max_rss_mb']:.0f}" for r in ranks)
        print(f"{name:42s} {len(ranks):5d} {max(1, args.threads // len(ranks)):8d} {step:16.3f} {rss:>16s}"
              f"   ({step / base:.2f}x TRL)")
    pre = runs["tptrain, tp 2, precompute_ref_log_probs"][0]
    print(f"precompute_ref_log_probs at tp 2: set-up {pre['setup']:.1f} s for {args.pairs} pairs (one forward per "
          f"pair, once; the frozen copy's set-up is {runs['tptrain DPOTrainer, tp 2'][0]['setup']:.1f} s)")


if __name__ == "__main__":
    main()
