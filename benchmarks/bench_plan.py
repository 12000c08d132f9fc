"""`tptrain plan --train` against measurement: for each layout, the planner's peak tensor memory per rank and step
time beside the measured ones, on this machine (CPU, gloo). One table; --json / --markdown write it too.

    .venv/bin/python benchmarks/bench_plan.py                       # every layout below (~10 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_plan.py --quick               # 8 layouts: tp, cp, pp, dp, ep, composed, AC
    .venv/bin/python benchmarks/bench_plan.py --layouts "dense tp2,moe ep2" --steps 3 --json plan.json
    .venv/bin/python benchmarks/bench_plan.py --smoke               # a tiny model, two layouts: seconds

Two models large enough that tensors dominate the processes: a Llama-shaped dense model (29M parameters, vocab
16384) and a Qwen3-MoE one (8 experts, top-2). Every layout runs in fresh ranks (one thread each, fp32 unless the
layout says bf16) through the Trainer's own `training_step` on random tokens, batch 2 x 256 tokens per data-parallel
rank: one step first (AdamW's states appear), then --steps measured steps. Measured peak: the most tensor bytes
alive at once on a rank over those steps (`LiveTensorBytes`: every op's outputs seen through a TorchDispatchMode,
each storage counted once while it lives, FSDP2's storage resizes followed; the parameters, gradients and optimizer
states there before counted from the start), the largest rank's. Predicted: the planner's peak_bytes_per_rank for
the same model, layout and run (`rank_memory`, device kind "cpu"), and its step time on the `cpu` profile (measured
here at start-up). Targets: every layout within 10%; the step times ranked alike (Spearman >= 0.8, meaningful on an
otherwise idle machine only).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DENSE = dict(model_type="llama", vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
             tie_word_embeddings=False)
MOE = dict(model_type="qwen3_moe", vocab_size=16384, hidden_size=256, intermediate_size=768, moe_intermediate_size=512,
           num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False)
TINY = dict(DENSE, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
# name: (model, layout sizes, run settings)
LAYOUTS = {
    "dense single": (DENSE, {}, {}),
    "dense single ac": (DENSE, {}, {"gradient_checkpointing": True}),
    "dense single bf16": (DENSE, {}, {"bf16": True}),
    "dense tp2": (DENSE, {"tp": 2}, {}),
    "dense tp2 ac": (DENSE, {"tp": 2}, {"gradient_checkpointing": True}),
    "dense dp2": (DENSE, {"dp_shard": 2}, {}),
    "dense dp2 bf16": (DENSE, {"dp_shard": 2}, {"bf16": True}),
    "dense dp_replicate2": (DENSE, {"dp_replicate": 2}, {}),
    "dense cp2": (DENSE, {"cp": 2}, {}),
    "dense pp2": (DENSE, {"pp": 2}, {}),
    "dense tp2 dp2": (DENSE, {"tp": 2, "dp_shard": 2}, {}),
    "dense tp2 cp2": (DENSE, {"tp": 2, "cp": 2}, {}),
    "dense pp2 dp2": (DENSE, {"pp": 2, "dp_shard": 2}, {}),
    "dense pp2 tp2": (DENSE, {"pp": 2, "tp": 2}, {}),
    "moe single": (MOE, {}, {}),
    "moe tp2": (MOE, {"tp": 2}, {}),
    "moe ep2": (MOE, {"dp_shard": 2, "ep": 2}, {}),
    "moe ep2 tp2": (MOE, {"dp_shard": 2, "ep": 2, "tp": 2}, {}),
}
QUICK = ("dense single ac", "dense tp2", "dense dp2", "dense cp2", "dense pp2", "dense tp2 cp2", "moe ep2",
         "moe ep2 tp2")
SMOKE = {"tiny single": (TINY, {}, {}), "tiny tp2 ac": (TINY, {"tp": 2}, {"gradient_checkpointing": True})}
BATCH, SEQ = 2, 256


def _config(spec: dict):
    from tptrain.models import AutoConfig

    spec = dict(spec)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def _trainer(model_spec: dict, sizes: dict, run: dict, world: int, out: str):
    from tptrain import DistributedConfig
    from tptrain.models import AutoModelForCausalLM
    from tptrain.training import Trainer, TrainingArguments
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.data import PackedDataset

    torch.manual_seed(0)
    config = _config(model_spec)
    model = AutoModelForCausalLM.from_config(config)
    parallel = dict(tp_size=sizes.get("tp", 1), cp_size=sizes.get("cp", 1), pp_size=sizes.get("pp", 1),
                    ep_size=sizes.get("ep"), dp_replicate_size=sizes.get("dp_replicate", 1))
    if world > 1:
        model = model.parallelize(DistributedConfig(**parallel))
    tokens = torch.randint(0, config.vocab_size, (BATCH * SEQ * world * 16,))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, seq_len=SEQ, max_steps=100,
                             bf16=run.get("bf16", False), gradient_checkpointing=run.get("gradient_checkpointing", False),
                             parallelism_config=ParallelismConfig(**parallel) if world > 1 else None)
    return Trainer(model, args=args, train_dataset=PackedDataset(tokens, SEQ))


def worker(rank: int, world: int, port: int, name: str, table: dict, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import gc

    from tptrain.diagnostics.tensor_meter import LiveTensorBytes
    from tptrain.distributed import comm

    trainer = _trainer(*table[name], world, out)
    trainer.training_step(trainer.data_order.next_batch())  # AdamW's states appear
    gc.collect()
    model, optimizer = trainer.model, trainer.optimizer
    existing = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None),
                *(t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))]
    times = []
    with LiveTensorBytes(existing) as meter:
        for _ in range(steps):
            if world > 1:
                comm.barrier()
            start = time.perf_counter()
            trainer.training_step(trainer.data_order.next_batch())
            times.append(time.perf_counter() - start)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": meter.peak, "times": times}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout(sizes: dict):
    from tptrain.layout import ParallelDims

    return ParallelDims(**sizes)


def predict(table: dict, name: str, profile) -> tuple[int, float]:
    """(the planner's peak_bytes_per_rank, its step time on `profile`) for layout `name`."""
    from tptrain.diagnostics.train_settings import TrainSettings
    from tptrain.diagnostics.model_shapes import ModelShapes
    from tptrain.diagnostics.train_plan import estimate, layout_problem

    model_spec, sizes, run = table[name]
    shapes = ModelShapes.of(_config(model_spec), dtype=torch.float32)
    settings = TrainSettings(batch_size=BATCH, seq_len=SEQ, final_save=False, **run)  # it measures a step
    layout = _layout(sizes)
    problem = layout_problem(shapes, layout, settings)
    assert problem is None, f"{name}: the rules refuse {layout.spell()}: {problem}"
    plan = estimate(shapes, layout, settings, profile)
    return plan.peak, plan.time.seconds


def measure(table: dict, name: str, steps: int) -> tuple[int, float]:
    """(the largest rank's peak tensor bytes, the median step time of the slowest rank) of layout `name`."""
    world = _layout(table[name][1]).world_size
    with tempfile.TemporaryDirectory() as out:
        args = (world, _free_port(), name, table, steps, out)
        if world == 1:
            worker(0, *args)
        else:
            mp.spawn(worker, args=args, nprocs=world, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    times = sorted(max(r["times"][i] for r in ranks) for i in range(steps))
    return max(r["peak"] for r in ranks), times[len(times) // 2]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties share their average rank)."""
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb))
    var = (sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", help=f"comma-separated names of: {', '.join(LAYOUTS)}")
    parser.add_argument("--quick", action="store_true", help=f"the 8 layouts {', '.join(QUICK)}")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, two layouts, one step")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per layout (after one warm-up step)")
    parser.add_argument("--json", metavar="FILE", help="write the rows and the summary as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the table as markdown")
    args = parser.parse_args()
    table = SMOKE if args.smoke else LAYOUTS
    names = list(table) if not (args.layouts or args.quick) else (
        list(QUICK) if args.quick else [n.strip() for n in args.layouts.split(",")])
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; the names are {', '.join(table)}")
    from tptrain.diagnostics.device_profiles import cpu_profile

    profile = cpu_profile()
    rows = []
    for name in names:
        predicted, predicted_s = predict(table, name, profile)
        measured, measured_s = measure(table, name, 1 if args.smoke else args.steps)
        rows.append(dict(name=name, layout=_layout(table[name][1]).spell(), predicted_bytes=predicted,
                         measured_bytes=measured, error=predicted / measured - 1, predicted_s=predicted_s,
                         measured_s=measured_s))
        print(_row(rows[-1]), flush=True)
    summary = dict(max_abs_error=max(abs(r["error"]) for r in rows),
                   within_10_percent=all(abs(r["error"]) <= 0.10 for r in rows),
                   spearman_step_time=spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]))
    print(f"max |error| {100 * summary['max_abs_error']:.1f}% (target 10%: "
          f"{'met' if summary['within_10_percent'] else 'missed'}); step-time ranking Spearman "
          f"{summary['spearman_step_time']:.2f} (target 0.8; meaningful on an idle machine only)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(_markdown(rows, summary))


HEADER = f"{'layout':<22} {'sizes':<24} {'pred MiB':>9} {'meas MiB':>9} {'error':>7} {'pred s':>8} {'meas s':>8}"


def _row(r: dict) -> str:
    if not hasattr(_row, "printed"):
        print(HEADER)
        _row.printed = True
    return (f"{r['name']:<22} {r['layout']:<24} {r['predicted_bytes'] / 2**20:>9.1f} {r['measured_bytes'] / 2**20:>9.1f} "
            f"{100 * r['error']:>+6.1f}% {r['predicted_s']:>8.3f} {r['measured_s']:>8.3f}")


def _markdown(rows: list[dict], summary: dict) -> str:
    lines = ["| layout | sizes | predicted MiB | measured MiB | error | predicted s | measured s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['layout']} | {r['predicted_bytes'] / 2**20:.1f} | {r['measured_bytes'] / 2**20:.1f} "
              f"| {100 * r['error']:+.1f}% | {r['predicted_s']:.3f} | {r['measured_s']:.3f} |" for r in rows]
    lines.append(f"\nmax |error| {100 * summary['max_abs_error']:.1f}%; step-time Spearman "
                 f"{summary['spearman_step_time']:.2f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
