"""tptrain tensor parallelism against the peer (transformers' DistributedConfig TP) on CPU: one table.

    .venv/bin/python benchmarks/bench_tp.py                                    # everything
    .venv/bin/python benchmarks/bench_tp.py --workloads medium --steps 2 --warmup 1 --no-load   # quick look
    .venv/bin/python benchmarks/bench_tp.py --backend transformers --workloads medium --no-load
        # + tptrain's engine on transformers' Qwen3ForCausalLM (impl "tptrain-hf"), next to native and the peer
    .venv/bin/python benchmarks/bench_tp.py --compile --workloads medium --no-load
        # + tptrain with each decoder layer torch.compile'd (inductor; impl "tptrain+compile"), tp 1 and 2
    .venv/bin/python benchmarks/bench_tp.py --workloads medium --no-load --no-overlap
        # + tptrain's tp 2 rows (plain and SP) with TPTRAIN_OVERLAP=0: the backward's grad-input collectives
        #   not overlapped with the weight gradients (variant "no-overlap")
    .venv/bin/python benchmarks/bench_tp.py --backend transformers --workloads moe --no-load
        # the MoE workload (bench_moe.py's Qwen3-MoE shape): tptrain's native qwen3_moe, tptrain-hf (the engine on
        #   transformers' Qwen3MoeForCausalLM) and the peer (transformers' TP with its expert plan), all at tp 2

Every measurement runs in fresh processes: tp 1 as one process, tp 2 as two ranks launched with
`python -m torch.distributed.run --standalone --nproc-per-node 2`; each rank uses ONE thread
(OMP_NUM_THREADS=1 and torch.set_num_threads(1)), gloo, fp32, the optimizer step included: each library's own
AdamW as its Trainer builds it at its defaults (tptrain's `build_optimizer`, transformers' Trainer's: both torch's
fused kernel; "optimizer s/step" is its share, `step()` + `zero_grad()`). Checkpoints are
created once with transformers' Qwen3 random init (tptrain's when transformers is absent), saved as HF
safetensors under --cache and reused; both implementations load the same files and train on the same
batches. Runtime of the full run: about 7 minutes on an idle 2-core machine, up to twice that on a busy
one; the first run also creates the checkpoints (~3.4 GB under --cache, about a minute).

Memory, two columns per rank: "peak anon" is anonymous RSS (/proc/self/status RssAnon, sampled every 5 ms)
minus the value right after the imports (safetensors pages mapped from the page cache not counted); "max RSS" is
the process's lifetime peak resident set as the OS charges it (getrusage ru_maxrss: imports, mapped checkpoint
pages and all), the figure a job scheduler or the OOM killer sees.

Rows: tp 1 and tp 2 of both implementations, tptrain tp 2 with sequence parallelism, tptrain tp 2 with the
LM head + loss unfused (`return_logits=True`: whole vocab-sharded logits, today's default off), and tp 4 of both
when the machine has at least 4 cores (else reported as skipped: 4 ranks on fewer cores time the scheduler).
The MoE workload (`--workloads moe`, not in the default run) has tp 1 and tp 2 rows: tptrain's native model (at tp 2
experts split inside, `expert_tensor_parallel`), the peer (at tp 2 with `DistributedConfig(tp_plan="auto",
enable_expert_parallel=True)`, as bench_moe.py runs it), and with `--backend transformers` tptrain-hf at tp 2.
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
import threading
import time
from pathlib import Path

QWEN3 = dict(model_type="qwen3", num_attention_heads=16, num_key_value_heads=8, hidden_size=1024,
             intermediate_size=3072, max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
             hidden_act="silu", attention_bias=False, initializer_range=0.02)
# The MoE shape bench_moe.py runs too (it imports it from here): 8 experts, top-2, 4 layers, hidden 512
QWEN3_MOE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512,
                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
MOE_BATCH, MOE_SEQ = 4, 256
WORKLOADS = {  # name: (config, batch, seq)
    "medium": (dict(QWEN3, num_hidden_layers=4, head_dim=64, vocab_size=8192, tie_word_embeddings=False), 4, 256),
    "large-vocab": (dict(QWEN3, num_hidden_layers=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True), 2, 256),
    "moe": (dict(QWEN3_MOE, model_type="qwen3_moe"), MOE_BATCH, MOE_SEQ),  # --workloads moe: MOE_RUNS, tp 2 only
}
DENSE = ("medium", "large-vocab")  # the default run's workloads
LOAD_CONFIG = dict(QWEN3, num_hidden_layers=28, head_dim=128, vocab_size=151936, tie_word_embeddings=True)  # Qwen3-0.6B
# (impl, tp, sequence parallel, variant): a variant switches one tptrain feature against its default.
RUNS = [("tptrain", 1, False, ""), ("peer", 1, False, ""), ("tptrain", 2, False, ""), ("tptrain", 2, True, ""),
        ("tptrain", 2, False, "unfused-loss"), ("peer", 2, False, ""), ("tptrain", 4, False, ""), ("peer", 4, False, "")]
HF_RUNS = [("tptrain-hf", 1, False, ""), ("tptrain-hf", 2, False, "")]  # --backend transformers
COMPILE_RUNS = [("tptrain+compile", 1, False, ""), ("tptrain+compile", 2, False, "")]  # --compile; compiled in warmup
OPTIM_IN_BWD_RUNS = [("tptrain", 1, False, "optim-in-bwd"), ("tptrain", 2, False, "optim-in-bwd")]  # --optim-in-backward
NO_OVERLAP_RUNS = [("tptrain", 2, False, "no-overlap"), ("tptrain", 2, True, "no-overlap")]  # --no-overlap
# the moe workload (no SP: the router needs every token); tp 1 for the one-process ratio and the TP overhead
MOE_RUNS = [("tptrain", 1, False, ""), ("peer", 1, False, ""), ("tptrain", 2, False, ""), ("peer", 2, False, "")]
MOE_HF_RUNS = [("tptrain-hf", 2, False, "")]  # --backend transformers
VARIANTS = {"": "", "unfused-loss": "head + loss unfused (return_logits=True)",
            "no-overlap": "backward overlap off (TPTRAIN_OVERLAP=0)",
            "optim-in-bwd": "optimizer in backward (each parameter stepped, its gradient freed, in backward)"}
MB = 1e6


# ----------------------------------------------------------------------------- inside one rank

def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no RssAnon: the memory columns need Linux")


class PeakSampler:
    """Highest anonymous RSS seen since the last reset, sampled by a daemon thread."""

    def __init__(self) -> None:
        self.peak = _rss_anon()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.005)

    def reset(self) -> int:
        peak, self.peak = max(self.peak, _rss_anon()), _rss_anon()
        return peak


class PeerCollectives:
    """Counts the collectives the peer issues (DTensor's functional collectives and plain c10d calls)
    by wrapping them for one step; tptrain's own go through comm.CommTracker instead."""

    # (module, function, collective, index of the input tensor argument)
    FUNCTIONS = [("funcol", n, "all_reduce", 0) for n in ("all_reduce",)] + \
        [("funcol", n, "all_gather", 0) for n in ("all_gather_single", "all_gather_tensor",
                                                  "all_gather_single_autograd", "all_gather_tensor_autograd")] + \
        [("funcol", n, "reduce_scatter", 0) for n in ("reduce_scatter_single", "reduce_scatter_tensor",
                                                      "reduce_scatter_single_autograd", "reduce_scatter_tensor_autograd")] + \
        [("funcol", "all_gather_inplace", "all_gather", 1), ("dist", "all_reduce", "all_reduce", 0),
         ("dist", "all_gather", "all_gather", 1), ("dist", "all_gather_into_tensor", "all_gather", 1),
         ("dist", "all_gather_single", "all_gather", 1), ("dist", "reduce_scatter_tensor", "reduce_scatter", 1),
         ("dist", "reduce_scatter_single", "reduce_scatter", 1), ("dist", "all_to_all_single", "all_to_all", 1),
         ("funcol", "all_to_all_single", "all_to_all", 0), ("funcol", "all_to_all_single_autograd", "all_to_all", 0)]

    def __init__(self) -> None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        modules = {"funcol": funcol, "dist": dist}
        self.records: list[tuple[str, str, int]] = []
        self._depth = 0  # functional collectives call each other: count the outermost call only
        self._patched = [(modules[m], name, getattr(modules[m], name)) for m, name, _, _ in self.FUNCTIONS
                         if hasattr(modules[m], name)]
        ops = {(modules[m], name): (op, i) for m, name, op, i in self.FUNCTIONS}
        for module, name, fn in self._patched:
            setattr(module, name, self._wrap(fn, *ops[(module, name)]))

    def _wrap(self, fn, op: str, index: int):
        import torch

        def wrapped(*args, **kwargs):
            if self._depth == 0:
                t = args[index]
                phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
                self.records.append((phase, op, t.numel() * t.element_size()))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapped

    def close(self) -> None:
        for module, name, fn in self._patched:
            setattr(module, name, fn)


def _batches(vocab: int, b: int, s: int, n: int):
    import torch
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1000 + i))
        out.append((ids, ids.clone()))
    return out


def _load(impl: str, ckpt: str, tp: int, sp: bool, *, experts: bool = False):
    """`experts`: the peer splits the experts with its expert plan (the MoE workload)."""
    import torch
    if impl == "tptrain+compile":
        from tptrain.parallel.data_parallel import apply_compile
        model = _load("tptrain", ckpt, tp, sp)
        apply_compile(model, backend="inductor")
        return model
    if impl.startswith("tptrain"):
        from tptrain import DistributedConfig
        from tptrain.models import AutoModelForCausalLM
        backend = "transformers" if impl == "tptrain-hf" else "native"
        dc = DistributedConfig(tp_size=tp, enable_sequence_parallel=sp, backend=backend) if tp > 1 else None
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, distributed_config=dc, backend=backend)
    import transformers
    plan = dict(tp_plan="auto", enable_expert_parallel=True) if experts else {}
    dc = transformers.DistributedConfig(tp_size=tp, **plan) if tp > 1 else None
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, distributed_config=dc)


def _measure_step(impl: str, model, ids, labels, **extra) -> dict:
    """One extra forward + backward: collectives and saved-activation bytes (not timed)."""
    from tptrain.diagnostics.accounting import SavedTensorMeter, comm_report
    if impl.startswith("tptrain"):
        report = comm_report(model, ids, labels, **extra)
        out = {"saved": report.saved_activation_bytes, "full_logit": report.full_logit_collectives,
               "coll": [sum(r.count for r in report.rows), sum(r.bytes for r in report.rows)],
               "min": [sum(r.min_count for r in report.rows), sum(r.min_bytes for r in report.rows)]}
    else:
        class DTensorMeter(SavedTensorMeter):  # the peer saves DTensors: count their local shards
            def add(self, t):
                super().add(getattr(t, "_local_tensor", t))

        params = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        counter = PeerCollectives()
        try:
            with DTensorMeter(params) as meter:
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        finally:
            counter.close()
        out = {"saved": meter.bytes, "coll": [len(counter.records), sum(r[2] for r in counter.records)]}
    model.zero_grad(set_to_none=True)
    return out


def _optimizer(impl: str, model, variant: str):
    """Each library's own optimizer at its defaults (lr 1e-4, no weight decay, as both Trainers' defaults):
    tptrain's `build_optimizer` (the Trainer's and `tptrain train`'s: torch's fused AdamW where the device has it),
    or (variant optim-in-bwd) its optimizer in backward (each parameter stepped by its gradient hook, TP partial
    gradients held back until the grad sync has summed them, then `opt.step()`); the peer's as transformers'
    Trainer builds it (`_peer_optimizer`)."""
    if not impl.startswith("tptrain"):
        return _peer_optimizer(model)
    from tptrain.training.args import TrainingArguments
    from tptrain.training.optim import build_optimizer
    from tptrain.training.optim_in_backward import OptimizerInBackward
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), learning_rate=1e-4, max_grad_norm=0,
                             optim_in_backward=variant == "optim-in-bwd")
    if variant != "optim-in-bwd":
        return build_optimizer(model, args)
    layout = model.parallel.tp
    held = set(layout.partial_grad_specs()) if layout is not None else set()
    return OptimizerInBackward(model, args, held_back=held)


def _peer_optimizer(model):
    """transformers' Trainer's optimizer at its defaults: its default `optim` (adamw_torch_fused with torch >= 2.8:
    torch's AdamW, fused=True), the parameters grouped by device mesh as its create_optimizer groups them (one
    fused call cannot mix the TP plan's DTensors with plain tensors)."""
    import torch
    import transformers
    default = transformers.TrainingArguments.__dataclass_fields__["optim"].default
    groups: dict = {}
    for p in model.parameters():
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return torch.optim.AdamW([{"params": g} for g in groups.values()], lr=1e-4,
                             fused=getattr(default, "value", default) == "adamw_torch_fused" or None)


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist
    import tptrain.distributed
    import tptrain.models.auto  # noqa: F401 - imports count in the baseline for both implementations
    if spec["impl"] in ("peer", "tptrain-hf"):  # the transformers backend imports it too
        import transformers  # noqa: F401
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    sampler = PeakSampler()
    baseline = sampler.reset()
    start = time.perf_counter()
    experts = spec["mode"] == "train" and "num_experts" in WORKLOADS[spec["workload"]][0]
    model = _load(spec["impl"], spec["ckpt"], spec["tp"], spec["sp"], experts=experts)
    result = {"load_s": time.perf_counter() - start, "load_peak": sampler.peak - baseline}
    if spec["mode"] == "train":
        model.train()
        config, b, s = WORKLOADS[spec["workload"]]
        batches = _batches(config["vocab_size"], b, s, spec["warmup"] + spec["steps"])
        opt = _optimizer(spec["impl"], model, spec["variant"])
        extra = {"return_logits": True} if spec["variant"] == "unfused-loss" else {}
        times, cpu, opt_times, losses = [], [], [], []
        for ids, labels in batches:
            if dist.is_initialized():
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = model(input_ids=ids, labels=labels, **extra).loss
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            opt_times.append(time.perf_counter() - t1)
            cpu.append(time.process_time() - c0)
            losses.append(loss.item())
        w = spec["warmup"]
        result.update(times=times[w:], cpu=cpu[w:], opt=opt_times[w:], loss0=losses[0], peak=sampler.peak - baseline)
        result.update(_measure_step(spec["impl"], model, *batches[0], **extra))
    result["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- orchestration

def _checkpoint(cache: Path, name: str, config: dict) -> Path:
    path = cache / name
    if (path / "config.json").exists():
        return path
    import torch
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{name}-"))
    torch.manual_seed(0)
    try:
        import transformers
        kw = {k: v for k, v in config.items() if k != "model_type"}
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(config["model_type"],
                                                                                                **kw))
        model.save_pretrained(tmp)
    except ImportError:  # no peer installed: tptrain's identical random init
        from tptrain.models import AutoConfig, AutoModelForCausalLM
        kw = dict(config)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw), dtype=torch.float32)
        model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def _launch(spec: dict, tp: int, timeout: float) -> list[dict] | str:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if spec.get("variant") == "no-overlap":
        env["TPTRAIN_OVERLAP"] = "0"
    with tempfile.TemporaryDirectory() as out:
        spec = dict(spec, out=out)
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
        if tp > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", *cmd[1:]]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f}s"
        if proc.returncode != 0:
            return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(tp)]


def _checkpoint_bytes(path: Path) -> tuple[int, int]:
    """(total bytes of every tensor, bytes of the largest one) from the safetensors headers."""
    total = largest = 0
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for k, v in header.items():
            if k != "__metadata__":
                n = v["data_offsets"][1] - v["data_offsets"][0]
                total, largest = total + n, max(largest, n)
    return total, largest


def _fmt_coll(c) -> str:
    return f"{c[0]} / {c[1] / MB:.1f} MB" if c else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(DENSE), help=f"comma-separated: {','.join(WORKLOADS)} (moe: "
                        "tp 2 rows of tptrain native, tptrain-hf with --backend transformers, and the peer)")
    parser.add_argument("--impls", default="tptrain,peer", help="comma-separated: tptrain,peer (tptrain-hf comes "
                                                                "with tptrain under --backend transformers)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--backend", choices=("native", "transformers"), default="native",
                        help="transformers: also run tptrain's engine on transformers' modeling code (tptrain-hf)")
    parser.add_argument("--compile", action="store_true",
                        help="also run tptrain with each decoder layer torch.compile'd (impl tptrain+compile)")
    parser.add_argument("--no-load", action="store_true", help="skip the ~2.4 GB checkpoint load measurement")
    parser.add_argument("--no-overlap", action="store_true", help="also run tptrain's tp 2 rows (plain and SP) with "
                        "TPTRAIN_OVERLAP=0, to compare with the default overlapped backward")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/tptrain-bench"), help="checkpoint cache dir")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--tp", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4],
                        help="comma-separated TP degrees to run (default 1,2,4; 4 is skipped below 4 cores)")
    parser.add_argument("--optim-in-backward", action="store_true", help="also run tptrain at tp 1 and 2 with the "
                        "optimizer stepped in backward (variant optim-in-bwd)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    try:
        import transformers  # noqa: F401
        impls = args.impls.split(",")
    except ImportError:
        impls = [i for i in args.impls.split(",") if i != "peer"]
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    results: dict[tuple, dict | str] = {}
    for name in filter(None, args.workloads.split(",")):
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        config, b, s = WORKLOADS[name]
        ckpt = _checkpoint(cache, "qwen3-moe-8x-top2" if name == "moe" else f"qwen3-{name}", config)  # bench_moe's
        hf = args.backend == "transformers"
        if name in DENSE:
            runs = RUNS + (HF_RUNS if hf else []) + (COMPILE_RUNS if args.compile else []) \
                + (NO_OVERLAP_RUNS if args.no_overlap else []) + (OPTIM_IN_BWD_RUNS if args.optim_in_backward else [])
        else:
            runs = MOE_RUNS + (MOE_HF_RUNS if hf else [])
        for impl, tp, sp, variant in runs:
            if not (impl in impls or impl in ("tptrain-hf", "tptrain+compile") and "tptrain" in impls) \
                    or tp not in args.tp:
                continue
            key = (name, impl, tp, sp, variant)
            if tp > cores:
                results[key] = f"skipped: {tp} ranks need {tp} cores, this machine has {cores}"
                continue
            spec = dict(mode="train", impl=impl, workload=name, tp=tp, sp=sp, variant=variant, ckpt=str(ckpt),
                        steps=args.steps, warmup=args.warmup)
            ranks = _launch(spec, tp, args.timeout)
            results[key] = ranks if isinstance(ranks, str) else _summarise(ranks, b * s)
            print(f"# {' '.join(map(str, key))}: {results[key]}", file=sys.stderr, flush=True)
    loads = {}
    if not args.no_load:
        ckpt = _checkpoint(cache, "qwen3-0.6b-shape", LOAD_CONFIG)
        for impl in impls:
            ranks = _launch(dict(mode="load", impl=impl, tp=2, sp=False, variant="", ckpt=str(ckpt)), 2, args.timeout)
            loads[impl] = ranks if isinstance(ranks, str) else {
                "load_s": max(r["load_s"] for r in ranks), "load_peak": max(r["load_peak"] for r in ranks),
                "maxrss": max(r["maxrss"] for r in ranks)}
        loads["bytes"] = _checkpoint_bytes(ckpt)
    print(_table(results, loads, args))


def _summarise(ranks: list[dict], tokens: int) -> dict:
    step = statistics.median(max(t) for t in zip(*(r["times"] for r in ranks)))
    cpu = statistics.median(max(t) for t in zip(*(r["cpu"] for r in ranks)))
    opt = statistics.median(max(t) for t in zip(*(r["opt"] for r in ranks)))
    out = {"step": step, "cpu": cpu, "opt": opt, "tok_s": tokens / step, "peak": max(r["peak"] for r in ranks),
           "maxrss": max(r["maxrss"] for r in ranks),
           "saved": max(r["saved"] for r in ranks), "loss0": ranks[0]["loss0"], "coll": ranks[0]["coll"]}
    out.update({k: ranks[0][k] for k in ("min", "full_logit") if k in ranks[0]})
    return out


def _table(results: dict, loads: dict, args) -> str:
    rows = [f"bench_tp.py --workloads {args.workloads} --steps {args.steps} --warmup {args.warmup}: fp32, gloo, "
            f"1 thread per rank; CPU s/step = process CPU time (max over ranks), robust when the machine is "
            f"shared; collectives per step on one rank (count / payload) vs the Megatron minimum",
            "", "| workload | impl | tp | SP | variant | step s | optimizer s/step | CPU s/step | tokens/s | "
            "peak anon MB/rank | max RSS MB/rank | saved act MB/rank | collectives/step | minimum | loss step 0 |",
            "|" + "---|" * 15]
    for (name, impl, tp, sp, variant), r in results.items():
        head = f"| {name} | {impl} | {tp} | {'on' if sp else '-'} | {VARIANTS[variant] or '-'} |"
        if isinstance(r, str):
            rows.append(f"{head} {r} |" + " |" * 9)
            continue
        minimum = r.get("min") or (results.get((name, "tptrain", tp, False, "")) or {}).get("min") if tp > 1 else None
        rows.append(f"{head} {r['step']:.2f} | {r['opt']:.2f} | {r['cpu']:.2f} | {r['tok_s']:.0f} | {r['peak'] / MB:.0f} | "
                    f"{r['maxrss'] / MB:.0f} | {r['saved'] / MB:.0f} | {_fmt_coll(r['coll'] if tp > 1 else None)} | "
                    f"{_fmt_coll(minimum)} | {r['loss0']:.4f} |")

    def get(name, impl, tp, sp=False, variant=""):
        r = results.get((name, impl, tp, sp, variant))
        return r if isinstance(r, dict) else None

    if "moe" in {key[0] for key in results}:
        rows += _moe_headline(get)
    if not {key[0] for key in results} & set(DENSE):
        return "\n".join(rows)
    rows += ["", "| headline | medium | large-vocab | target |", "|---|---|---|---|"]

    def line(label, fn, target):
        cells = []
        for name in DENSE:
            try:
                cells.append(fn(name))
            except (TypeError, KeyError, ZeroDivisionError):
                cells.append("-")
        rows.append(f"| {label} | {' | '.join(cells)} | {target} |")

    line("tp-2 step time, tptrain / peer", lambda n: f"{get(n, 'tptrain', 2)['step'] / get(n, 'peer', 2)['step']:.2f}x "
         f"(speed-up {get(n, 'peer', 2)['step'] / get(n, 'tptrain', 2)['step']:.2f}x)", "<= 0.70 (medium), 0.60 (large-vocab)")
    line("one-process step time, tptrain / peer",
         lambda n: f"{get(n, 'tptrain', 1)['step'] / get(n, 'peer', 1)['step']:.2f}x", "<= 0.95 (medium), 0.90 (large-vocab)")

    def share(n, impl, tp):
        return f"{get(n, impl, tp)['opt'] / get(n, impl, tp)['step']:.0%}"

    line("optimizer share of the step at tp 1 / tp 2, tptrain (peer)", lambda n: f"{share(n, 'tptrain', 1)} / "
         f"{share(n, 'tptrain', 2)} ({share(n, 'peer', 1)} / {share(n, 'peer', 2)})", "-")
    line("tp-4 step time, tptrain / peer", lambda n: f"{get(n, 'tptrain', 4)['step'] / get(n, 'peer', 4)['step']:.2f}x", "-")
    if args.backend == "transformers":
        line("tp-2 step time, tptrain-hf / tptrain (native)",
             lambda n: f"{get(n, 'tptrain-hf', 2)['step'] / get(n, 'tptrain', 2)['step']:.2f}x", "<= 1.1")
        line("tp-2 step time, tptrain-hf / peer",
             lambda n: f"{get(n, 'tptrain-hf', 2)['step'] / get(n, 'peer', 2)['step']:.2f}x", "<= 0.9")
        line("same on CPU time/step: tptrain-hf / native, tptrain-hf / peer",
             lambda n: f"{get(n, 'tptrain-hf', 2)['cpu'] / get(n, 'tptrain', 2)['cpu']:.2f}x, "
             f"{get(n, 'tptrain-hf', 2)['cpu'] / get(n, 'peer', 2)['cpu']:.2f}x", "-")
        line("tptrain-hf collectives == minimum",
             lambda n: f"{get(n, 'tptrain-hf', 2)['coll'] == get(n, 'tptrain-hf', 2)['min']}", "True")
    if args.compile:
        for tp in (1, 2):
            line(f"tp-{tp} step time, compiled / eager (tptrain)",
                 lambda n, t=tp: f"{get(n, 'tptrain+compile', t)['step'] / get(n, 'tptrain', t)['step']:.2f}x", "-")
        line("tp-2 compiled collectives == minimum",
             lambda n: f"{get(n, 'tptrain+compile', 2)['coll'] == get(n, 'tptrain+compile', 2)['min']}", "True")
    line("tp-2 step time with SP, tptrain / peer",
         lambda n: f"{get(n, 'tptrain', 2, True)['step'] / get(n, 'peer', 2)['step']:.2f}x", "-")
    for impl in ("tptrain", "peer"):
        line(f"TP overhead factor {impl} (2 x t2 / t1)",
             lambda n, i=impl: f"{2 * get(n, i, 2)['step'] / get(n, i, 1)['step']:.2f}", "<= 1.05" if impl == "tptrain" else "-")
    line("same on CPU time/step (robust on a shared machine)",
         lambda n: f"{get(n, 'tptrain', 2)['cpu'] / get(n, 'peer', 2)['cpu']:.2f}x; overhead tptrain "
         f"{2 * get(n, 'tptrain', 2)['cpu'] / get(n, 'tptrain', 1)['cpu']:.2f}, peer "
         f"{2 * get(n, 'peer', 2)['cpu'] / get(n, 'peer', 1)['cpu']:.2f}", "-")
    line("peak anon memory/rank at tp 2, tptrain / peer",
         lambda n: f"{get(n, 'tptrain', 2)['peak'] / get(n, 'peer', 2)['peak']:.2f}x", "-")
    line("peak max RSS/rank at tp 2, tptrain / peer",
         lambda n: f"{get(n, 'tptrain', 2)['maxrss'] / get(n, 'peer', 2)['maxrss']:.2f}x", "<= 0.70 (large-vocab)")
    line("saved activations/rank at tp 2 (tptrain)", lambda n: f"{get(n, 'tptrain', 2)['saved'] / MB:.0f} MB",
         "<= 120 MB (large-vocab)")
    for variant, label in VARIANTS.items():
        if variant:
            line(f"tp-2 step with {label} / default (tptrain)",
                 lambda n, v=variant: f"{get(n, 'tptrain', 2, False, v)['step'] / get(n, 'tptrain', 2)['step']:.2f}x; "
                 f"saved act {get(n, 'tptrain', 2, False, v)['saved'] / MB:.0f} MB, max RSS "
                 f"{get(n, 'tptrain', 2, False, v)['maxrss'] / MB:.0f} MB", "-")
    line("tptrain collectives == minimum, full-logit collectives",
         lambda n: f"{get(n, 'tptrain', 2)['coll'] == get(n, 'tptrain', 2)['min'] and get(n, 'tptrain', 2, True)['coll'] == get(n, 'tptrain', 2, True)['min']}, "
         f"{get(n, 'tptrain', 2)['full_logit'] + get(n, 'tptrain', 2, True)['full_logit']}", "True, 0")
    line("saved activations/rank SP / plain TP (tptrain)",
         lambda n: f"{get(n, 'tptrain', 2, True)['saved'] / get(n, 'tptrain', 2)['saved']:.2f}", "<= 0.6")
    line("saved activations/rank tp 2 SP / (tp 1 / 2) (tptrain)",
         lambda n: f"{get(n, 'tptrain', 2, True)['saved'] / (get(n, 'tptrain', 1)['saved'] / 2):.2f}", "<= 1.1")
    if loads:
        total, largest = loads["bytes"]
        bound = 1.1 * (total / 2 + largest)
        rows += ["", f"| load of a {total / 1e9:.2f} GB checkpoint (Qwen3-0.6B shape, fp32) at tp 2 | load s | "
                     f"peak anon MB/rank | max RSS MB/rank | bound on anon: ckpt/tp + largest tensor + 10% |",
                 "|---|---|---|---|---|"]
        for impl in ("tptrain", "peer"):
            r = loads.get(impl)
            if isinstance(r, dict):
                ok = "ok" if r["load_peak"] <= bound else "ABOVE"
                rows.append(f"| {impl} | {r['load_s']:.1f} | {r['load_peak'] / MB:.0f} | {r['maxrss'] / MB:.0f} | "
                            f"{bound / MB:.0f} ({ok}) |")
            elif r:
                rows.append(f"| {impl} | {r} | | | |")
    return "\n".join(rows)


def _moe_headline(get) -> list[str]:
    """The MoE workload's ratios: tptrain native and tptrain-hf against the peer and each other at tp 2, and issue
    36's figures with their targets (tp 2 and one process against the peer, tptrain's TP overhead)."""
    rows = ["", "| moe headline | value | target |", "|---|---|---|"]
    pairs = [("tptrain", "peer"), ("tptrain-hf", "tptrain"), ("tptrain-hf", "peer")]
    for label, key, fmt in (("step time", "step", "{:.2f}x"), ("CPU time/step", "cpu", "{:.2f}x"),
                            ("bytes sent/step/rank", "coll", "{:.2f}x"), ("peak anon memory/rank", "peak", "{:.2f}x")):
        for a, b in pairs:
            target = "<= 0.65x" if (a, b, key) == ("tptrain", "peer", "step") else "-"
            rows.append(f"| {label} at tp 2, {a} / {b} | {_ratio(get, key, fmt, (a, 2), (b, 2))} | {target} |")
    for key in ("step", "cpu"):
        rows.append(f"| {key} at tp 1, tptrain / peer | {_ratio(get, key, '{:.2f}x', ('tptrain', 1), ('peer', 1))} | "
                    f"{'<= 0.90x' if key == 'step' else '-'} |")
        rows.append(f"| TP overhead on {key}, 2 x t(tp 2) / t(tp 1), tptrain | "
                    f"{_ratio(get, key, '{:.2f}', ('tptrain', 2), ('tptrain', 1), factor=2)} | "
                    f"{'<= 1.10' if key == 'step' else '-'} |")
    for impl in ("tptrain", "tptrain-hf"):
        r = get("moe", impl, 2)
        rows.append(f"| {impl} collectives == minimum | {r['coll'] == r['min'] if r and 'min' in r else '-'} | True |")
    return rows


def _ratio(get, key: str, fmt: str, a: tuple, b: tuple, *, factor: float = 1.0) -> str:
    """factor x (run a's `key`) / (run b's) on the moe workload, runs as (impl, tp); "-" where one is missing."""
    try:
        x, y = get("moe", *a)[key], get("moe", *b)[key]
        return fmt.format(factor * (x[1] / y[1] if key == "coll" else x / y))
    except (TypeError, KeyError, ZeroDivisionError):
        return "-"


if __name__ == "__main__":
    main()
