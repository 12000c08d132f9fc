"""Generation tokens/s: tptrain's model.generate against transformers' generate under its own tensor parallelism, on
the same checkpoint, prompts and lengths, a KV cache on both. One table.

    .venv/bin/python benchmarks/bench_generate.py                       # tp 1 and 2 of both, greedy and sampled
    .venv/bin/python benchmarks/bench_generate.py --tp 2 --new 32 --repeats 2      # a quick look

Every run is fresh processes: tp 1 one process, tp 2 two ranks under `python -m torch.distributed.run --standalone`,
ONE thread per rank (OMP_NUM_THREADS=1), gloo, fp32. The checkpoint (bench_tp.py's "medium" Qwen3: hidden 1024, 4
layers, vocab 8192) is written once by transformers under --cache. Both libraries get the same left-padded prompts
(batch --batch, lengths --min-prompt..--max-prompt), generate --new tokens with no end-of-sequence token (so both run
every step) with transformers' DynamicCache on its side and tptrain's KVCache on its own; the peer is
`transformers.AutoModelForCausalLM.from_pretrained(..., distributed_config=transformers.DistributedConfig(tp_size=2))`
(transformers' tp_plan="auto" on DTensors). "greedy" compares the sequences too (the same tokens); "sampled" is
do_sample=True, top_k=50, temperature 0.8 (each library its own draws). Time: one untimed generate, then the median
of --repeats timed ones; tokens/s = batch x new tokens / seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tp import WORKLOADS, _checkpoint  # noqa: E402 - the sibling benchmark's checkpoint and its shape

MODES = {"greedy": dict(do_sample=False), "sampled": dict(do_sample=True, top_k=50, temperature=0.8)}


def _prompts(vocab: int, batch: int, shortest: int, longest: int):
    import torch
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=g)
    ids = torch.randint(1, vocab, (batch, longest), generator=g)
    mask = (torch.arange(longest)[None] >= longest - lengths[:, None]).long()  # left-padded
    return ids * mask, mask


def _load(impl: str, ckpt: str, tp: int):
    import torch
    if impl == "tptrain":
        from tptrain import AutoModelForCausalLM, DistributedConfig
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                    distributed_config=DistributedConfig(tp_size=tp) if tp > 1 else None)
    import transformers
    dc = transformers.DistributedConfig(tp_size=tp) if tp > 1 else None
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, distributed_config=dc).eval()


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    model = _load(spec["impl"], spec["ckpt"], spec["tp"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    ids, mask = _prompts(spec["vocab"], spec["batch"], spec["min_prompt"], spec["max_prompt"])
    kw = dict(attention_mask=mask, max_new_tokens=spec["new"], eos_token_id=[], pad_token_id=0, **MODES[spec["mode"]])
    if spec["impl"] == "peer":
        kw["eos_token_id"] = None  # transformers: no eos criterion
    generate = model.generate
    if spec["mode"] == "sampled":
        if spec["impl"] == "tptrain":
            kw["generator"] = 0
        else:
            torch.manual_seed(0)
    times, out = [], None
    for i in range(spec["repeats"] + 1):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            out = generate(ids, **kw)
        if i:
            times.append(time.perf_counter() - start)
    result = {"times": times, "new": out.shape[1] - ids.shape[1], "sequences": out.tolist()}
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def _launch(spec: dict, timeout: float) -> dict | str:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as out:
        spec = dict(spec, out=out)
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
        if spec["tp"] > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['tp']}",
                   *cmd[1:]]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f}s"
        if proc.returncode != 0:
            return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
        return json.loads(Path(out, "rank0.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2])
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per run (median reported)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/tptrain-bench"), help="checkpoint cache dir")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    config, _, _ = WORKLOADS["medium"]
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    ckpt = str(_checkpoint(Path(args.cache), "medium", config))
    rows = []
    for mode in args.modes.split(","):
        for tp in args.tp:
            got = {}
            for impl in ("tptrain", "peer"):
                got[impl] = _launch(dict(impl=impl, ckpt=ckpt, tp=tp, mode=mode, vocab=config["vocab_size"],
                                         batch=args.batch, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                                         new=args.new, repeats=args.repeats), args.timeout)
            rows.append((mode, tp, got))
    print(_table(rows, args))


def _table(rows, args) -> str:
    lines = [f"generation: Qwen3 'medium' (hidden 1024, 4 layers, vocab 8192), fp32, batch {args.batch}, prompts "
             f"{args.min_prompt}-{args.max_prompt} tokens (left-padded), {args.new} new tokens, KV cache on both, "
             f"1 thread per rank, median of {args.repeats}", "",
             "| mode | tp | tptrain tokens/s | transformers tokens/s | speed-up | same tokens |", "|---|---|---|---|---|---|"]
    for mode, tp, got in rows:
        rate = {}
        for impl, r in got.items():
            rate[impl] = args.batch * r["new"] / statistics.median(r["times"]) if isinstance(r, dict) else r
        fmt = {k: f"{v:.1f}" if isinstance(v, float) else v for k, v in rate.items()}
        both = all(isinstance(v, float) for v in rate.values())
        same = "—" if mode != "greedy" or not both else (
            "yes" if got["tptrain"]["sequences"] == got["peer"]["sequences"] else "no")
        speedup = f"{rate['tptrain'] / rate['peer']:.2f}x" if both else "—"
        lines.append(f"| {mode} | {tp} | {fmt['tptrain']} | {fmt['peer']} | {speedup} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
