"""Context parallelism (cp_size) on a small Qwen3: tokens/s and memory per rank at cp 1 / 2 / 4, and the longest
sequence that fits a fixed per-rank memory budget. Prints one table.

    .venv/bin/python benchmarks/bench_cp.py                                   # 8k-32k tokens, cp 1/2/4
    .venv/bin/python benchmarks/bench_cp.py --seqs 256 512 --cps 1 2 --hidden 64 --steps 1   # smoke run

Every (cp, sequence) runs in fresh processes: cp 1 as one process, cp N as N ranks under
`python -m torch.distributed.run --standalone`; gloo on CPU (one thread per rank), nccl on CUDA. One row of
`--seqs` tokens per step (a whole batch of one sequence, as long-context fine-tuning trains), fwd + bwd + AdamW,
fp32 (bf16 on CUDA). Columns per rank:
  act MiB    the bytes autograd keeps for backward (SavedTensorMeter): what cp divides. Target: within 1.2x of
             cp 1's / cp (the last lines: the worst over --seqs at each cp, beside the target).
  peak MiB   CUDA: torch.cuda.max_memory_allocated over the step; CPU: the anonymous RSS peak over the step (sampled
             every 2 ms) above the value before it.
  tok/s      tokens of the sequence per second of a step (median of --steps after --warmup).
A sequence whose peak exceeds --budget-mib is not tried longer at that cp; "longest" is the longest sequence of
--seqs that fit (target: it grows at least 1.8x per doubling of cp). Runtime: minutes on a GPU; on a 2-core CPU a
small model (--hidden 128, --seqs up to 8192) takes a few minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """Peak memory over a block: CUDA's allocator statistics, or the anonymous RSS sampled on CPU."""

    def __init__(self, device) -> None:
        self.device, self.peak, self._stop = device, 0, threading.Event()

    def __enter__(self):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = _rss_anon()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_anon() - self.base)

    def __exit__(self, *exc) -> None:
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()


def worker(spec: dict) -> None:
    """One (cp, seq) measurement on this rank; rank 0 prints a JSON line."""
    import torch
    import torch.distributed as dist

    from tptrain import DistributedConfig
    from tptrain.diagnostics.accounting import SavedTensorMeter
    from tptrain.distributed import local_device
    from tptrain.models import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    device = local_device()
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=8192, hidden_size=spec["hidden"], intermediate_size=3 * spec["hidden"],
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=spec["hidden"] // 4, max_position_embeddings=spec["seq"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    if spec["cp"] > 1:
        model.parallelize(DistributedConfig(cp_size=spec["cp"], tp_size=1))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, spec["seq"]), generator=torch.Generator().manual_seed(1)).to(device)
    times, act, peak = [], 0, 0
    for step in range(spec["warmup"] + spec["steps"]):
        start = time.perf_counter()
        with _Peak(device) as measured:
            with SavedTensorMeter(model.parameters()) as meter:
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= spec["warmup"]:
            times.append(time.perf_counter() - start)
        act, peak = meter.bytes, max(peak, measured.peak)
    if dist.is_initialized():  # the largest rank's figures: the one that sets the budget
        stats = torch.tensor([act, peak], dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        act, peak = (int(v) for v in stats.tolist())
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("RESULT " + json.dumps({**spec, "act": act, "peak": peak, "step": statistics.median(times)}), flush=True)


def _run(spec: dict) -> dict | None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    code = [str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    cmd = [sys.executable, *code] if spec["cp"] == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['cp']}", *code]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        print(f"cp {spec['cp']} seq {spec['seq']}: failed (exit {out.returncode})\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget-mib", type=float, default=4096, help="per-rank peak memory budget")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one measurement (JSON spec), in a launched process
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    rows, longest = [], {}
    for cp in args.cps:
        for seq in sorted(args.seqs):
            result = _run(dict(cp=cp, seq=seq, hidden=args.hidden, steps=args.steps, warmup=args.warmup))
            if result is None:
                break
            rows.append(result)
            if result["peak"] > args.budget_mib * 2**20:
                break
            longest[cp] = seq
    base = {r["seq"]: r["act"] for r in rows if r["cp"] == 1}
    print(f"{'cp':>3} {'seq':>7} {'act MiB':>9} {'x cp1/cp':>9} {'peak MiB':>9} {'tok/s':>9}")
    for r in rows:
        ratio = r["act"] / (base[r["seq"]] / r["cp"]) if r["seq"] in base else float("nan")
        print(f"{r['cp']:>3} {r['seq']:>7} {r['act'] / 2**20:>9.1f} {ratio:>9.2f} {r['peak'] / 2**20:>9.1f} "
              f"{r['seq'] / r['step']:>9.0f}")
    print(f"longest sequence within {args.budget_mib:.0f} MiB per rank: "
          + ", ".join(f"cp {cp}: {seq}" for cp, seq in longest.items()) + " (of --seqs)")
    print(_figures(rows, base))


def _figures(rows: list[dict], base: dict[int, int]) -> str:
    """Issue 36's figure beside its target: the activations per rank against cp 1's / cp, the worst over --seqs."""
    lines = ["\nfigure                                          measured   target"]
    for cp in sorted({r["cp"] for r in rows} - {1}):
        ratios = [r["act"] / (base[r["seq"]] / cp) for r in rows if r["cp"] == cp and r["seq"] in base]
        measured = f"{max(ratios):.2f}x" if ratios else "-"
        lines.append(f"{f'CP activations per rank / (cp 1 / {cp}), cp {cp}':<47} {measured:>9}   <= 1.20x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
