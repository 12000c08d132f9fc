"""Resumable-checkpoint save and load at TP 2 x FSDP 2 (4 CPU/gloo ranks): time and peak memory per rank.

A ~1 GB fp32 Qwen3-style model (246M parameters) takes one AdamW step, then each rank saves a DCP
checkpoint (`Trainer.save_checkpoint`) and loads it back (`Trainer._load`, the resume path). Memory is
the rise of each rank's private resident memory (RssAnon, sampled every 0.5 ms) over its training state.
Run it from a tree whose tptrain you want measured, and label the run; the table covers every labelled
run in the results file, so "before" (e.g. a checkout of the old code) and "after" print side by side:

    PYTHONPATH=/path/to/old/tree python benchmarks/bench_checkpoint.py --label before --results /tmp/ck.json
    PYTHONPATH=$PWD python benchmarks/bench_checkpoint.py --label after --results /tmp/ck.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MB = 2**20
CONFIG = dict(vocab_size=16000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
              num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=64)


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
    """Highest RssAnon while the block runs, and its wall time."""

    def __enter__(self) -> "Peak":
        self.start, self.peak, self._stop = rss_anon(), rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        self.rise = max(self.peak, rss_anon()) - self.start


def worker(rank: int, world: int, port: int, out_dir: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from tptrain import AutoConfig, AutoModelForCausalLM, DistributedConfig
    from tptrain.training.args import ParallelismConfig, TrainingArguments
    from tptrain.training.data import PackedDataset
    from tptrain.training.trainer import Trainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **CONFIG), dtype=torch.float32)
    model.parallelize(DistributedConfig(tp_size=2))
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=1, max_steps=10, seq_len=16,
                             parallelism_config=ParallelismConfig(2, dp_shard_size=2))
    data = PackedDataset(torch.randint(0, CONFIG["vocab_size"], (64 * 16,)), 16)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.training_step(trainer.data_order.next_batch())
    trainer.global_step = 1
    state = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * 4 for p in trainer.inner.parameters()
                for t in (p, trainer.optimizer.state[p]["exp_avg"], trainer.optimizer.state[p]["exp_avg_sq"]))
    with Peak() as save:
        path = trainer.save_checkpoint()
    with Peak() as load:
        trainer._load(path)
    queue.put((rank, {"state_mib": state / MB, "save_s": save.seconds, "save_rise_mib": save.rise / MB,
                      "load_s": load.seconds, "load_rise_mib": load.rise / MB}))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="after")
    parser.add_argument("--results", default=None, help="JSON file to add this run to (and print all runs of)")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # freed tensors go back to the OS
    world = 4
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    # The port stays bound here (SO_REUSEADDR, not listening) until the ranks are done: no other process gets it
    # from the OS in the meantime, while rank 0's TCPStore (SO_REUSEADDR too) serves the rendezvous on it.
    with socket.socket() as s, tempfile.TemporaryDirectory() as tmp:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        mp.start_processes(worker, args=(world, s.getsockname()[1], tmp, queue), nprocs=world, start_method="spawn")
        rows = dict(queue.get() for _ in range(world))
    runs = {}
    if args.results and Path(args.results).exists():
        runs = json.loads(Path(args.results).read_text())
    runs[args.label] = {str(rank): rows[rank] for rank in sorted(rows)}
    if args.results:
        Path(args.results).write_text(json.dumps(runs, indent=2))
    print(f"TP 2 x FSDP 2 on 4 CPU/gloo ranks, qwen3 {CONFIG}, fp32 + AdamW")
    print(f"{'run':<8} {'rank':>4} {'state MiB':>10} {'save s':>8} {'save +MiB':>10} {'load s':>8} {'load +MiB':>10}")
    for label, ranks in runs.items():
        for rank, r in ranks.items():
            print(f"{label:<8} {rank:>4} {r['state_mib']:>10.0f} {r['save_s']:>8.2f} {r['save_rise_mib']:>10.1f} "
                  f"{r['load_s']:>8.2f} {r['load_rise_mib']:>10.1f}")


if __name__ == "__main__":
    main()
