"""tptrain's experts over 2 ranks against the peer (transformers' tp_plan="auto" with its expert parallelism) on
CPU: one table.

    .venv/bin/python benchmarks/bench_moe.py                      # everything (a few minutes on an idle machine)
    .venv/bin/python benchmarks/bench_moe.py --steps 2 --warmup 1 # quick look
    .venv/bin/python benchmarks/bench_moe.py --model deepseek_v3  # DeepSeek-V3's shape (MLA, grouped routing)

A Qwen3-MoE-shaped model (8 experts, top-2, 4 layers, hidden 512) written once by transformers under --cache; with
`--model deepseek_v3` a DeepSeek-V3-shaped one (latent attention, 8 experts in 4 groups of which a token sees 2,
top-2, one shared expert, the first layer dense; hidden 512, 4 layers), where tptrain's native code also runs against
tptrain's engine on transformers' code (the row "tptrain transformers backend tp 2").
Every run is 2 fresh ranks (`python -m torch.distributed.run --standalone --nproc-per-node 2`), one thread each,
gloo, fp32, the AdamW step included (each library's own, as its Trainer builds it: bench_tp.py's `_optimizer`); all
implementations load the same files and train on the same batches.
Rows: tptrain tp 2 (experts split inside, `expert_tensor_parallel`), tptrain ep 2
(`enable_expert_parallel=True`; at 2 ranks and top-2 it sums partial outputs in the layer's one all-reduce, which
sends fewer bytes than dispatching), tptrain ep 2 forced to dispatch by all-to-all, tptrain with the ep axis at tp
1 (`DistributedConfig(tp_size=1, ep_size=2)`: attention data-parallel, each rank on half the batch with its dense
gradients averaged by one flat all-reduce, counted in its bytes; the experts split over the 2 ranks serve both
halves by all-to-all), and the peer at tp 2 with
`DistributedConfig(enable_expert_parallel=True)`. Bytes sent = the input bytes of every collective one rank issues
in one training step (forward + backward), counted the same way for both. Memory is peak anonymous RSS minus the
value right after the imports (as in bench_tp.py).
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
from bench_tp import (MB, MOE_BATCH as BATCH, MOE_SEQ as SEQ, QWEN3_MOE, PeakSampler,  # noqa: E402 - the sibling
                      PeerCollectives, _batches, _optimizer)  # benchmark's tools, its MoE shape (one definition)

DEEPSEEK_V3 = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=128,
                   qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
                   n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=4096,
                   tie_word_embeddings=False)
MODELS = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE),  # --model: transformers classes, shape
          "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3)}
RUNS = {  # name: (impl, tptrain DistributedConfig keywords)
    "tptrain tp 2 (expert TP)": ("tptrain", {}),
    "tptrain ep 2 (auto: all-reduce)": ("tptrain", {"enable_expert_parallel": True}),
    "tptrain ep 2 (all-to-all)": ("tptrain", {"tp_plan": {"layers.*.mlp.experts": "expert_parallel_all_to_all"}}),
    # The ep axis at tp 1: each rank trains on its half of the batch (dense layers data-parallel, their gradients
    # averaged by one flat all-reduce, as DDP does), its 4 experts serving both halves by all-to-all.
    "tptrain ep_size 2, tp 1 (dense DP 2)": ("tptrain", {"tp_size": 1, "ep_size": 2}),
    "tptrain transformers backend tp 2": ("tptrain", {"backend": "transformers"}),  # --model deepseek_v3 only
    "peer tp 2 + expert parallel": ("peer", {}),
    # One process each (no TP): what a user without several devices pays for each implementation.
    "tptrain one process": ("tptrain", {"tp_size": 1}),
    "peer one process": ("peer", None),
}
PEER_OF = {"tptrain one process": "peer one process", "peer one process": "peer one process"}  # the rest compare with the peer at tp 2


def _nproc(run: str) -> int:
    return 1 if "one process" in run else 2


def _load(impl: str, ckpt: str, kwargs: dict):
    import torch
    if impl == "tptrain":
        from tptrain import AutoModelForCausalLM, DistributedConfig
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                    distributed_config=DistributedConfig(**{"tp_size": 2, **kwargs}))
    import transformers
    if kwargs is None:  # one process: transformers' model as it is
        return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    dc = transformers.DistributedConfig(tp_size=2, tp_plan="auto", enable_expert_parallel=True)
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, distributed_config=dc)


def _data_parallel_sync(model) -> int:
    """The ep axis at tp 1: average the dense gradients over the 2 data-parallel ranks in one flat all-reduce, and
    halve the experts' (their owners summed both ranks' tokens); returns the bytes all-reduced."""
    import torch
    import torch.distributed as dist
    dense = [p.grad for n, p in model.named_parameters() if ".experts." not in n and p.grad is not None]
    flat = torch.cat([g.flatten() for g in dense])
    dist.all_reduce(flat)
    for g, piece in zip(dense, flat.split([g.numel() for g in dense])):
        g.copy_(piece.view_as(g))
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(2)
    return flat.numel() * flat.element_size()


def _step_bytes(impl: str, model, ids, labels, data_parallel: bool) -> int:
    """Input bytes of every collective of one forward + backward on this rank."""
    if impl == "tptrain":
        from tptrain.distributed.comm import CommTracker
        with CommTracker() as tracker:
            model(ids, labels=labels).loss.backward()
        total = tracker.total_bytes("forward") + tracker.total_bytes("backward")
        total += _data_parallel_sync(model) if data_parallel else 0
    else:
        counter = PeerCollectives()  # the peer at tp 2: no data parallelism
        try:
            model(input_ids=ids, labels=labels).loss.backward()
        finally:
            counter.close()
        total = sum(r[2] for r in counter.records)
    model.zero_grad(set_to_none=True)
    return total


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist
    import tptrain.distributed
    import tptrain.models.auto  # `import tptrain` alone imports them only on first use
    import transformers
    assert tptrain and transformers  # imported here so both count in the baseline, for both implementations
    torch.set_num_threads(1)
    sampler = PeakSampler()
    baseline = sampler.reset()
    impl, kwargs = RUNS[spec["run"]]
    if not dist.is_initialized():  # the peer in one process starts no process group of its own
        dist.init_process_group("gloo")
    model = _load(impl, spec["ckpt"], kwargs)
    model.train()
    batches = _batches(MODELS[spec["model"]][2]["vocab_size"], BATCH, SEQ, spec["warmup"] + spec["steps"])
    data_parallel = bool(kwargs) and kwargs.get("ep_size", 1) > 1 and kwargs.get("tp_size") == 1
    if data_parallel:  # this rank's half of every batch
        batches = [(ids.chunk(2)[dist.get_rank()], labels.chunk(2)[dist.get_rank()]) for ids, labels in batches]
    opt = _optimizer(impl, model, "")  # each library's own, as its Trainer builds it (bench_tp.py)
    times, cpu, losses = [], [], []
    for ids, labels in batches:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if data_parallel:
            _data_parallel_sync(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss.detach())
    if data_parallel:  # the whole batch's loss: the mean of the halves' (equal token counts)
        dist.all_reduce(losses[0])
        losses[0] /= 2
    result = {"times": times[spec["warmup"]:], "cpu": cpu[spec["warmup"]:], "loss0": losses[0].item(), "peak": sampler.peak - baseline,
              "bytes": _step_bytes(impl, model, *batches[0], data_parallel)}
    Path(spec["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _checkpoint(cache: Path, model: str) -> Path:
    path = cache / {"qwen3_moe": "qwen3-moe-8x-top2"}.get(model, f"{model}-8x-top2")
    if (path / "config.json").exists():
        return path
    import torch
    import transformers
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{model}-"))
    config_cls, model_cls, shape = MODELS[model]
    getattr(transformers, model_cls)(getattr(transformers, config_cls)(**shape)).save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def _launch(spec: dict, timeout: float) -> list[dict] | str:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={_nproc(spec['run'])}", __file__,
               "--worker", json.dumps(dict(spec, out=out))]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f}s"
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.strip().splitlines() if "Error" in ln and "ChildFailedError" not in ln
                     ] or proc.stderr.splitlines() or ["?"]  # the worker's error, not torchrun's wrapper
            return "failed: " + lines[-1][:200]
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(_nproc(spec["run"]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/tptrain-bench"), help="checkpoint cache dir")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--runs", default="", help="only the rows whose name contains this text")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3_moe", help="the model's shape")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    ckpt = _checkpoint(cache, args.model)
    results = {}
    runs = [r for r in RUNS if args.runs in r and (args.model == "deepseek_v3" or "transformers backend" not in r)]
    for run in runs:
        spec = dict(run=run, ckpt=str(ckpt), steps=args.steps, warmup=args.warmup, model=args.model)
        ranks = _launch(spec, args.timeout)
        results[run] = ranks if isinstance(ranks, str) else {
            "step": statistics.median(max(t) for t in zip(*(r["times"] for r in ranks))),
            "cpu": statistics.median(max(t) for t in zip(*(r["cpu"] for r in ranks))),
            "peak": max(r["peak"] for r in ranks), "bytes": max(r["bytes"] for r in ranks), "loss0": ranks[0]["loss0"]}
        print(f"# {run}: {results[run]}", file=sys.stderr, flush=True)
    print(_table(results, args))


def _table(results: dict, args) -> str:
    shape = MODELS[args.model][2]
    rows = [f"bench_moe.py --model {args.model} --steps {args.steps} --warmup {args.warmup}: {args.model} shape "
            f"(8 experts, top-2, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}), "
            f"batch {BATCH} x {SEQ}, "
            "fp32, gloo, 1 thread per rank (2 ranks; 1 for the one-process rows); CPU s/step = process CPU time (max "
            "over ranks), robust when the machine is shared", "",
            "| run | step s | vs peer | CPU s/step | bytes sent/step/rank | vs peer | peak anon MB/rank | loss step 0 |",
            "|---|---|---|---|---|---|---|---|"]
    for run, r in results.items():
        peer = results.get(PEER_OF.get(run, "peer tp 2 + expert parallel"))
        peer = peer if isinstance(peer, dict) else None
        if isinstance(r, str):
            rows.append(f"| {run} | {r} | | | | | | |")
            continue
        vs_t = f"{r['step'] / peer['step']:.2f}x" if peer else "-"
        vs_b = f"{r['bytes'] / peer['bytes']:.2f}x" if peer and peer["bytes"] else "-"
        rows.append(f"| {run} | {r['step']:.2f} | {vs_t} | {r['cpu']:.2f} | {r['bytes'] / MB:.1f} MB | {vs_b} | "
                    f"{r['peak'] / MB:.0f} | {r['loss0']:.4f} |")
    return "\n".join(rows + _headline(results))


def _headline(results: dict) -> list[str]:
    """Issue 36's MoE figures, on step time (and on CPU time, which a shared machine moves less), with targets."""
    def get(run):
        r = results.get(run)
        return r if isinstance(r, dict) else None

    tp2, one, peer2, peer1 = (get(r) for r in ("tptrain tp 2 (expert TP)", "tptrain one process",
                                               "peer tp 2 + expert parallel", "peer one process"))
    figures = [("tp 2 step, tptrain (expert TP) / peer (tp 2 + expert parallel)", tp2, peer2, 1, "<= 0.65x"),
               ("one-process step, tptrain / peer", one, peer1, 1, "<= 0.90x"),
               ("MoE TP overhead 2 x t(tp 2) / t(one process), tptrain", tp2, one, 2, "<= 1.10")]
    rows = ["", "| headline | step time | CPU time | target |", "|---|---|---|---|"]
    for label, a, b, factor, target in figures:
        cells = [f"{factor * a[key] / b[key]:.2f}" if a and b else "-" for key in ("step", "cpu")]
        rows.append(f"| {label} | {cells[0]} | {cells[1]} | {target} |")
    rows.append("\nand ep 2 sending strictly fewer bytes than the peer")
    return rows


if __name__ == "__main__":
    main()
