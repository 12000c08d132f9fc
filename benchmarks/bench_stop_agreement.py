"""What preemption costs per optimizer step: the stop agreement (one all-reduce of one int over the world).

    .venv/bin/python benchmarks/bench_stop_agreement.py            # 2 and 4 CPU/gloo ranks, a table
    .venv/bin/python benchmarks/bench_stop_agreement.py --calls 2000

Each rank calls `StopOnSignal(60).agreed()` (what the Trainer calls once per step with
TrainingArguments.preemption_grace set) `--calls` times after a warm-up; the table gives the median and
p90 per call over the ranks' timings. Compare it with a step's time (metrics.jsonl `step_time`): the
bundled tiny model's smoke step takes about 150 ms on 2 CPU ranks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank(rank: int, world: int, port: int, calls: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    from tptrain.distributed import init_distributed
    from tptrain.training.preemption import StopOnSignal

    torch.set_num_threads(1)
    init_distributed()
    times = []
    with StopOnSignal(60) as stop:
        for i in range(calls + 50):
            start = time.perf_counter()
            assert not stop.agreed()
            if i >= 50:
                times.append(time.perf_counter() - start)
    queue.put(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    from tests.helpers.ranks import reserved_port

    print(f"{'ranks':>5} | {'median us':>9} | {'p90 us':>7}")
    for world in (2, 4):
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        with reserved_port() as port:  # rank 0 serves the rendezvous on it
            procs = mp.start_processes(_rank, args=(world, port, args.calls, queue), nprocs=world,
                                       start_method="spawn", join=False)
            times = sorted(t for _ in range(world) for t in queue.get())  # read before joining: a full pipe blocks
            procs.join()
        print(f"{world:>5} | {statistics.median(times) * 1e6:>9.0f} | {times[int(0.9 * len(times))] * 1e6:>7.0f}")


if __name__ == "__main__":
    main()
