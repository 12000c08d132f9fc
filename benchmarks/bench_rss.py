"""`tptrain plan --train` against what the process really uses: real `tptrain train` runs, each rank's max RSS (CPU)
or caching-allocator reserved peak (CUDA), beside the planner's peak for the same model, layout and run.

    .venv/bin/python benchmarks/bench_rss.py                      # the six layouts below (~15 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_rss.py --layouts "tp2,tp2 ac" --json rss.json --markdown rss.md
    .venv/bin/python benchmarks/bench_rss.py --smoke              # two small models, one layout: a minute
    TPTRAIN_RELEASE_FREED_MEMORY=0 .venv/bin/python benchmarks/bench_rss.py   # glibc's own malloc: the figures before

Two Qwen3 models of one architecture, initialised at random from a config.json: a 66M-parameter one (hidden 768,
10 layers, vocab 4096: the bundled tokenizer's) and a tiny one (hidden 64, 2 layers). Each layout trains each model
with `tptrain train` (batch 4 x 512 per data-parallel rank, 3 steps, the bundled corpus, its final save and greedy
sample included), one thread per rank. Measured per rank: the process's peak resident set as the OS charges it
(/proc/self/status VmHWM, read at the worker's exit by a `sitecustomize` this script puts first on PYTHONPATH: the
workers are the elastic agent's children, which wait4 on the launcher never sees), or on CUDA
`torch.cuda.max_memory_reserved`. The tiny model's figure is subtracted rank by rank, so the runtime's own memory
(interpreter, torch's libraries, gloo, the data) cancels and what is left is what the model's size adds; the
planner's figures are subtracted alike. "run own" is what the run itself measured and wrote to metrics.jsonl
(`peak_memory`, the largest rank's, big minus tiny; it reads VmHWM at the end of training, before the sample), "run
meas/plan" the big run's own check (measured over planned, the runtime's memory included, its worst rank). Target: every layout within 10%. RSS is less sensitive to a
loaded machine than time (page reclaim is the exception; this machine has no swap), so a shared machine is fine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUNDLED = ROOT / "tptrain" / "data" / "tiny-qwen3"
BIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=12,
           num_key_value_heads=4, head_dim=64)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
SMALL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
# name: (tptrain train's flags, the planner's layout, the planner's run settings)
LAYOUTS = {
    "tp2": (["--tp-size", "2"], {"tp": 2}, {}),
    "pp2": (["--tp-size", "1", "--pp-size", "2"], {"pp": 2}, {}),
    "cp2": (["--tp-size", "1", "--cp-size", "2"], {"cp": 2}, {}),
    "dp_shard2": (["--tp-size", "1", "--nproc-per-node", "2"], {"dp_shard": 2}, {}),
    "tp2 cp2": (["--tp-size", "2", "--cp-size", "2"], {"tp": 2, "cp": 2}, {}),
    "tp2 ac": (["--tp-size", "2", "--gradient-checkpointing"], {"tp": 2}, {"gradient_checkpointing": True}),
}
BATCH, SEQ, STEPS = 4, 512, 3

HOOK = '''import atexit, json, os


def _tptrain_bench_rss():
    rank = os.environ.get("RANK")
    if rank is None:
        return
    out = {"rank": int(rank)}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["reserved"] = torch.cuda.max_memory_reserved()
    with open(os.path.join(os.environ["TPTRAIN_BENCH_RSS_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if os.environ.get("TPTRAIN_BENCH_RSS_DIR"):
    atexit.register(_tptrain_bench_rss)
'''


def _model_dir(where: Path, name: str, spec: dict) -> Path:
    """A config.json (the bundled Qwen3's, resized) and the bundled tokenizer: `tptrain train` initialises it."""
    out = where / name
    out.mkdir()
    config = json.loads((BUNDLED / "config.json").read_text())
    config.update(spec, max_window_layers=spec["num_hidden_layers"])
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
        (out / tokenizer_file).write_bytes((BUNDLED / tokenizer_file).read_bytes())
    return out


def run(model: Path, flags: list[str], where: Path) -> dict:
    """One `tptrain train` run: {"ranks": [each rank's exit record], "metrics": metrics.jsonl's records}."""
    hook, ranks, out = where / "hook", where / "ranks", where / "out"
    for d in (hook, ranks):
        d.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TPTRAIN_BENCH_RSS_DIR=str(ranks), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "tptrain", "train", "--model", str(model), "--batch-size", str(BATCH),
               "--seq-len", str(SEQ), "--max-steps", str(STEPS), "--save-steps", "0", "--output-dir", str(out),
               "--overwrite-output-dir", *flags]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    records = [json.loads(p.read_text()) for p in sorted(ranks.glob("rank*.json"))]
    metrics = out / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    return {"ranks": sorted(records, key=lambda r: r["rank"]), "metrics": lines, "stdout": done.stdout}


def _measured(record: dict) -> int:
    return record.get("reserved", record["VmHWM"])


def _own(result: dict) -> int | None:
    """The run's own measurement in metrics.jsonl: the largest rank's peak (None where the run wrote none)."""
    peaks = [max(r["peak_memory"]) for r in result["metrics"] if "peak_memory" in r]
    return max(peaks) if peaks else None


def _own_ratio(result: dict) -> float | None:
    """The run's own check: its largest rank's measured peak over its plan (runtime included), as it printed."""
    for r in result["metrics"]:
        if "peak_memory" in r and all(r["planned_peak_memory"]):
            return max(m / p for m, p in zip(r["peak_memory"], r["planned_peak_memory"]))
    return None


def predict(model: Path, sizes: dict, run_settings: dict, device: str) -> list[int]:
    """The planner's peak of each pp rank for this model, layout and run (as `tptrain plan --train` says)."""
    import torch

    from tptrain.diagnostics.device_profiles import device_profile
    from tptrain.diagnostics.model_shapes import ModelShapes
    from tptrain.diagnostics.train_plan import estimate
    from tptrain.diagnostics.train_settings import TrainSettings
    from tptrain.layout import ParallelDims
    from tptrain.models import AutoConfig

    shapes = ModelShapes.of(AutoConfig.from_pretrained(model), dtype=torch.float32)
    settings = TrainSettings(batch_size=BATCH, seq_len=SEQ, **run_settings)
    plan = estimate(shapes, ParallelDims(**sizes), settings, device_profile(device))
    return [r.peak for r in plan.ranks]


def measure_layout(name: str, big: dict, tiny: dict, device: str) -> dict:
    flags, sizes, run_settings = LAYOUTS[name]
    with tempfile.TemporaryDirectory(prefix="bench-rss-") as tmp:
        tmp = Path(tmp)
        models = {which: _model_dir(tmp, which, spec) for which, spec in (("big", big), ("tiny", tiny))}
        results = {which: run(model, flags, tmp / f"run-{which}") for which, model in models.items()}
        planned = [b - t for b, t in zip(predict(models["big"], sizes, run_settings, device),
                                         predict(models["tiny"], sizes, run_settings, device))]
    per_rank = [_measured(b) - _measured(t) for b, t in zip(results["big"]["ranks"], results["tiny"]["ranks"])]
    own_big, own_tiny = _own(results["big"]), _own(results["tiny"])
    row = dict(name=name, per_rank=per_rank, measured=max(per_rank), predicted=max(planned),
               big=[_measured(r) for r in results["big"]["ranks"]], tiny=[_measured(r) for r in results["tiny"]["ranks"]],
               own=None if own_big is None or own_tiny is None else own_big - own_tiny,
               own_ratio=_own_ratio(results["big"]))
    row["ratio"] = row["predicted"] / row["measured"]
    return row


MiB = 2**20
HEADER = (f"{'layout':<10} {'predicted MiB':>13} {'measured MiB':>12} {'pred/meas':>9} {'run own MiB':>11} "
          f"{'run meas/plan':>13} {'per rank (big - tiny) MiB':<26} {'big MiB':<16}")


def _row(r: dict) -> str:
    own = _own_text(r)
    return (f"{r['name']:<10} {r['predicted'] / MiB:>13.0f} {r['measured'] / MiB:>12.0f} {r['ratio']:>9.2f} "
            f"{own:>11} {_ratio_text(r):>13} {' '.join(f'{x / MiB:.0f}' for x in r['per_rank']):<26} "
            f"{' '.join(f'{x / MiB:.0f}' for x in r['big']):<16}")


def _ratio_text(r: dict) -> str:
    return "-" if r.get("own_ratio") is None else f"{r['own_ratio']:.2f}"


def _own_text(r: dict) -> str:
    return "-" if r["own"] is None else f"{r['own'] / MiB:.0f}"


def _markdown(rows: list[dict], what: str) -> str:
    lines = [f"| layout | predicted MiB | measured {what} MiB | predicted / measured | run's own MiB | run's measured / planned | "
             "per rank MiB |", "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['name']} | {r['predicted'] / MiB:.0f} | {r['measured'] / MiB:.0f} | {r['ratio']:.2f} | "
              f"{_own_text(r)} | {_ratio_text(r)} | "
              f"{', '.join(f'{x / MiB:.0f}' for x in r['per_rank'])} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", help=f"comma-separated names of: {', '.join(LAYOUTS)}")
    parser.add_argument("--smoke", action="store_true", help="a 4M-parameter model against the tiny one, tp2 only")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the table as markdown")
    args = parser.parse_args()
    names = ["tp2"] if args.smoke else (
        [n.strip() for n in args.layouts.split(",")] if args.layouts else list(LAYOUTS))
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; the names are {', '.join(LAYOUTS)}")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    what = "reserved (torch.cuda.max_memory_reserved)" if device == "cuda" else "max RSS (VmHWM)"
    print(f"tptrain train, batch {BATCH} x {SEQ}, {STEPS} steps; measured: {what}, big - tiny model, largest rank")
    print(HEADER)
    rows = []
    for name in names:
        rows.append(measure_layout(name, SMALL if args.smoke else BIG, TINY, device))
        print(_row(rows[-1]), flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"worst |predicted / measured - 1|: {100 * worst:.1f}% (target 10%: {'met' if worst <= 0.10 else 'missed'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(_markdown(rows, what))


if __name__ == "__main__":
    main()
