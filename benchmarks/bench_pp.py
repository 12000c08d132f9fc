"""Pipeline parallelism on CPU/gloo: step time and speed-up over pp 1, the measured bubble per rank against the
schedule's theory, what limits the speed-up (each rank's compute replayed through the schedule from CPU time), and
peak memory per rank. One table, then issue 36's figure beside its target.

    .venv/bin/python benchmarks/bench_pp.py                    # pp 1, 2, 4 x m 4, 8 with 1F1B (minutes, idle machine)
    .venv/bin/python benchmarks/bench_pp.py --schedules 1F1B Interleaved1F1B ZBVZeroBubble   # each where it runs
    .venv/bin/python benchmarks/bench_pp.py --smoke            # seconds: a tiny model, one step

A Llama-shaped model (8 layers) saved once; every row is fresh ranks (one thread each, fp32) training one global
batch of 8 rows per step (forward + backward through torch's schedule, no optimizer; pp 1: the model's forward with
whole logits, as the last stage computes them). Columns:
  step ms      wall time of a step, the slowest rank; speed-up: pp 1's step over it.
  bound        the speed-up this schedule and stage split allow with no communication and no contention: each
               rank's chunks (forward, backward, and the zero-bubble ones' weight gradients; the last stage's loss
               with its forward), timed in thread CPU time, replayed in the order the rank ran them, each waiting
               for the chunks it depends on (the stage before's forward, the stage after's backward); the sum of
               every rank's chunk CPU time (one process's work) over that. Below 1F1B's bubble bound
               p m / (m + p - 1) when the ranks' work is unequal (the head outweighs a layer, the embedding does
               not); the measured speed-up below it is communication (gloo's p2p copies and waits), Python
               overheads and CPU contention. CPU time does not count waiting, so the bound holds on a loaded
               machine where the wall times do not.
  work         every rank's chunk CPU time over pp 1's step: the compute the pipeline adds (a zero-bubble
               schedule's backward in two pieces, the stages' per-microbatch calls); above 1, the bound above
               overstates the speed-up by that much.
  idle         1 - (wall time inside the rank's chunks) / step time, against 1F1B's (p-1)/(m+p-1).
  chunk / other CPU ms   per rank: thread CPU time in its chunks; the process's CPU time outside them (p2p posting,
               gloo's threads, the schedule's bookkeeping).
  peak MB      the largest RSS a rank reached (ru_maxrss) minus its RSS after the imports; pp 1 holds the whole
               model and its activations.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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
LAYOUTS = [(2, 4), (2, 8), (4, 4), (4, 8)]  # (pp, microbatches); issue 36's figure is pp 2, m 8
TARGET = (2, 8)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Recorder:
    """Wraps PipelineStage's compute entry points (and the schedule's loss, counted with its forward): each chunk's
    (stage, kind, microbatch, thread CPU seconds) in the order run, and the wall time inside them."""

    KINDS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}

    def __init__(self) -> None:
        from torch.distributed.pipelining import schedules, stage

        self.events: list[list] = []
        self.busy = 0.0
        for name, kind in self.KINDS.items():
            setattr(stage._PipelineStageBase, name, self._wrap(getattr(stage._PipelineStageBase, name), kind))
        original_loss = schedules._PipelineSchedule._maybe_compute_loss

        def loss(schedule, stage_, *args, **kwargs):
            cpu = time.thread_time()
            try:
                return original_loss(schedule, stage_, *args, **kwargs)
            finally:
                self.events[-1][3] += time.thread_time() - cpu  # the forward it follows
        schedules._PipelineSchedule._maybe_compute_loss = loss

    def _wrap(self, original, kind: str):
        def wrapped(stage_, chunk, *args, **kwargs):
            full = kwargs.get("full_backward", args[1] if kind == "B" and len(args) > 1 else True)
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return original(stage_, chunk, *args, **kwargs)
            finally:
                self.busy += time.perf_counter() - wall
                self.events.append([stage_.stage_index, kind if full else "I", chunk, time.thread_time() - cpu])
        return wrapped


def worker(rank: int, world: int, port: int, ckpt: str, m: int, steps: int, seq: int, schedule: str,
           out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from tptrain import DistributedConfig
    from tptrain.models import AutoModelForCausalLM
    from tptrain.parallel.pipeline_parallel import Pipeline

    base = _rss_mb()
    recorder = _Recorder()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (ROWS, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    if world == 1:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train()

        def step():
            model(ids, labels=ids, return_logits=True).loss.backward()
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, distributed_config=DistributedConfig(
            pp_size=world, tp_size=1, pp_schedule=schedule)).train()
        pipe = Pipeline(model, model.device_mesh, n_microbatches=m, device=torch.device("cpu"))

        def step():
            pipe.step(batch, int(ROWS * (seq - 1)))
    step()  # warm-up (and the stages' shape exchange)
    times, cpus, events, busy, threads = [], [], [], 0.0, []
    for _ in range(steps):
        recorder.events, recorder.busy = [], 0.0
        start, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
        step()
        times.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        threads.append(time.thread_time() - thread)
        events.append(recorder.events)
        busy += recorder.busy
        model.zero_grad(set_to_none=True)
    total = sum(times)
    chunk_cpu = statistics.median(sum(e[3] for e in step_events) for step_events in events)
    result = {"step_s": total / steps, "idle": (1 - busy / total) if world > 1 else 0.0,
              "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base,
              "step_cpu": statistics.median(threads if world == 1 else cpus), "chunk_cpu": chunk_cpu,
              "events": events}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def replay(ranks: list[list[list]]) -> float:
    """The step's makespan from each rank's chunks (stage, kind, microbatch, seconds) in the order it ran them, a
    chunk starting once its rank is free and the chunks it needs are done: a forward the stage before's forward of
    its microbatch, a backward (or input-gradient) its own forward and the stage after's backward, a weight-gradient
    its input-gradient. No communication time."""
    last = max(e[0] for events in ranks for e in events)
    done: dict[tuple, float] = {}
    clock, pos = [0.0] * len(ranks), [0] * len(ranks)

    def needs(stage: int, kind: str, mb: int) -> list[tuple]:
        if kind == "F":
            return [("F", stage - 1, mb)] if stage > 0 else []
        if kind == "W":
            return [("B", stage, mb)]
        return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < last else [])

    while any(p < len(events) for p, events in zip(pos, ranks)):
        moved = False
        for r, events in enumerate(ranks):
            while pos[r] < len(events):
                stage, kind, mb, seconds = events[pos[r]]
                deps = needs(stage, kind, mb)
                if any(d not in done for d in deps):
                    break
                clock[r] = max([clock[r]] + [done[d] for d in deps]) + seconds
                done[("B" if kind in "BI" else kind, stage, mb)] = clock[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"replay deadlocked at {pos}: a chunk kind or dependency this replay does not know")
    return max(clock)


def _bound(ranks: list[list[list]]) -> float:
    """The speed-up one step's chunks allow: their CPU time on one rank (one process's work) over their replay."""
    return sum(e[3] for events in ranks for e in events) / replay(ranks)


def run(ckpt: str, pp: int, m: int, steps: int, seq: int, schedule: str, port: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(pp, port, ckpt, m, steps, seq, schedule, out), nprocs=pp)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(pp)]


def _runs(schedule: str, pp: int, m: int) -> bool:
    from tptrain.parallel.pipeline_parallel import check_microbatches

    try:
        check_microbatches(schedule, pp, m, ROWS)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one step, seq 16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--schedules", nargs="+", default=["1F1B"], help="each run at every (pp, m) it allows")
    args = parser.parse_args()
    steps, seq = (1, 16) if args.smoke else (args.steps, args.seq)
    from tptrain.models import AutoConfig, AutoModelForCausalLM
    from tptrain.parallel.pipeline_parallel import schedule_name

    schedules = [schedule_name(s) for s in args.schedules]
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **(SMOKE if args.smoke else FULL))
                                         ).save_pretrained(ckpt)
        rows = [(1, "-", "-", run(ckpt, 1, 1, steps, seq, "1F1B", 29650))]
        port = 29651
        for pp, m in LAYOUTS:
            for schedule in (s for s in schedules if _runs(s, pp, m)):
                rows.append((pp, m, schedule, run(ckpt, pp, m, steps, seq, schedule, port)))
                port += 1
    print(_table(rows, steps, seq))


def _table(rows: list[tuple], steps: int, seq: int) -> str:
    one = rows[0][3][0]
    lines = [f"{ROWS} rows x {seq} tokens per step, {steps} step(s), fp32, 1 thread per rank, gloo\n",
             f"{'pp':>3} {'m':>3} {'schedule':<22} {'step ms':>8} {'speed-up':>8} {'bound':>6} "
             f"{'work':>5} {'idle per rank':>20} {'1F1B idle':>9} {'chunk CPU ms':>20} {'other CPU ms':>14} "
             f"{'peak MB (pp 1 = ' + format(one['peak_mb'], '.0f') + ')':>22}"]
    figures = []
    for pp, m, schedule, results in rows:
        step = max(r["step_s"] for r in results)
        speed = one["step_s"] / step
        bound = work = "-"
        if pp > 1:
            work = f"{sum(r['chunk_cpu'] for r in results) / one['step_cpu']:.2f}"
            bound = f"{statistics.median(_bound([r['events'][i] for r in results]) for i in range(steps)):.2f}x"
        theory = "-" if m == "-" else f"{(pp - 1) / (m + pp - 1):.2f}"

        def per_rank(fmt, results=results):
            return " ".join(fmt(r) for r in results)
        lines.append(f"{pp:>3} {m:>3} {schedule:<22} {1000 * step:>8.1f} {speed:>7.2f}x {bound:>6} {work:>5} "
                     f"{per_rank(lambda r: format(r['idle'], '.2f')):>20} {theory:>9} "
                     f"{per_rank(lambda r: format(1000 * r['chunk_cpu'], '.0f')):>20} "
                     f"{per_rank(lambda r: format(1000 * (r['step_cpu'] - r['chunk_cpu']), '.0f')):>14} "
                     f"{per_rank(lambda r: format(r['peak_mb'], '.0f')):>22}")
        if (pp, m) == TARGET:
            figures.append((schedule, speed, bound))
    pp, m = TARGET
    labels = [f"pp {pp}, {m} microbatches, {schedule}: speed-up over pp 1 on {pp} ranks" for schedule, *_ in figures]
    width = max(map(len, labels), default=0)
    lines += ["", f"{'figure':<{width}} {'measured':>9} {'bound':>6} {'target':>7}"]
    for label, (schedule, speed, bound) in zip(labels, figures):
        lines.append(f"{label:<{width}} {speed:>8.2f}x {bound:>6} {pp * m / (m + pp - 1):>6.2f}x  (1F1B's bubble: "
                     f"p m / (m + p - 1))")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
