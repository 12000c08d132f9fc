"""Pipeline parallelism on CPU/gloo: step time, the measured bubble per rank against the schedule's theory, and
peak memory per rank against pp 1. One table.

    .venv/bin/python benchmarks/bench_pp.py                    # pp 1, 2, 4 x m 4, 8 with 1F1B (minutes, idle machine)
    .venv/bin/python benchmarks/bench_pp.py --smoke            # seconds: a tiny model, one step

A Llama-shaped model (8 layers) saved once; every row is fresh ranks (one thread each, fp32) training one global
batch of 8 rows per step (forward + backward through torch's schedule, no optimizer). Busy time is the time a rank
spends inside its stages' forward and backward chunks (PipelineStage.forward_one_chunk, backward_one_chunk,
backward_weight_one_chunk); idle = 1 - busy / step time, against 1F1B's (p-1)/(m+p-1). On CPU the p2p copies and
the gloo waits are idle time too, so the measured bubble sits above the theory. Peak memory: the largest RSS a rank
reached (ru_maxrss) minus its RSS after the imports, so pp 1 holds the whole model and its activations.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FULL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=512)
SMOKE = dict(FULL, vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
ROWS = 8


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _timed(busy: list[float]):
    """Wrap PipelineStage's compute entry points to add their wall time to busy[0]."""
    from torch.distributed.pipelining import stage

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        original = getattr(stage._PipelineStageBase, name)

        def wrapped(self, *args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start
        setattr(stage._PipelineStageBase, name, wrapped)


def worker(rank: int, world: int, port: int, ckpt: str, m: int, steps: int, seq: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from tptrain import DistributedConfig
    from tptrain.models import AutoModelForCausalLM
    from tptrain.parallel.pipeline_parallel import Pipeline

    base = _rss_mb()
    busy = [0.0]
    _timed(busy)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (ROWS, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    if world == 1:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train()

        def step():
            model(ids, labels=ids, return_logits=True).loss.backward()
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, distributed_config=DistributedConfig(
            pp_size=world, tp_size=1)).train()
        pipe = Pipeline(model, model.device_mesh, n_microbatches=m, device=torch.device("cpu"))

        def step():
            pipe.step(batch, int(ROWS * (seq - 1)))
    step()  # warm-up (and the stages' shape exchange)
    busy[0], times = 0.0, []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    total = sum(times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    result = {"step_s": total / steps, "idle": (1 - busy[0] / total) if world > 1 else 0.0, "peak_mb": peak}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run(ckpt: str, pp: int, m: int, steps: int, seq: int, port: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(pp, port, ckpt, m, steps, seq, out), nprocs=pp)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(pp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one step, seq 16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    steps, seq = (1, 16) if args.smoke else (args.steps, args.seq)
    from tptrain.models import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **(SMOKE if args.smoke else FULL))
                                         ).save_pretrained(ckpt)
        rows = [("1", "-", run(ckpt, 1, 1, steps, seq, 29650))]
        for i, (pp, m) in enumerate([(2, 4), (2, 8), (4, 4), (4, 8)]):
            rows.append((str(pp), str(m), run(ckpt, pp, m, steps, seq, 29651 + i)))
    one = rows[0][2][0]
    print(f"1F1B, {ROWS} rows x {seq} tokens per step, {steps} step(s), fp32, 1 thread per rank, gloo\n")
    print(f"{'pp':>3} {'m':>3} {'step ms':>9} {'idle per rank (measured)':>30} {'1F1B theory':>12} "
          f"{'peak MB per rank (pp 1 = ' + format(one['peak_mb'], '.0f') + ')':>40}")
    for pp, m, results in rows:
        theory = "-" if m == "-" else f"{(int(pp) - 1) / (int(m) + int(pp) - 1):.2f}"
        idle = " ".join(f"{r['idle']:.2f}" for r in results)
        peaks = " ".join(f"{r['peak_mb']:.0f}" for r in results)
        print(f"{pp:>3} {m:>3} {1000 * max(r['step_s'] for r in results):>9.1f} {idle:>30} {theory:>12} {peaks:>40}")


if __name__ == "__main__":
    main()
