"""The one layout (tptrain/layout): ParallelDims and its resolution against the world size, the one rule table, the
docs' table generated from it. Pure: no process group, no model weights."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tptrain.layout import (RULES, Case, Features, ModelFacts, ParallelDims, Spelling, case_of, check, refusals, resolve,
                            validate)
from tptrain.layout import schedules, table

ROOT = Path(__file__).resolve().parent.parent


def test_importing_the_layout_imports_no_torch():
    code = "import sys, tptrain.layout, tptrain.layout.table; assert 'torch' not in sys.modules, sorted(sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_the_docs_table_is_the_rule_table():
    """docs/parallelism.md holds `table.render()`: every rule, each once, and the composition matrix from them."""
    doc = (ROOT / "docs" / "parallelism.md").read_text()
    assert table.section(doc) == table.render(), "docs/parallelism.md is stale: paste `python -m tptrain.layout.table`"
    listed = [line.split("`")[1] for line in table.section(doc).splitlines() if line.startswith("| `")]
    assert listed == [r.name for r in RULES]
    for r in RULES:
        assert r.when and r.reason and r.fix, r.name
        for pair in zip(r.between, r.between[1:]):  # every pair a rule is about shows it in the matrix
            assert f"`{r.name}`" in table._cell(*pair), (r.name, pair)


def test_schedules_facts_are_torchs():
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    for name in schedules.SCHEDULES:
        single = issubclass(get_schedule_class(name), PipelineScheduleSingle)
        assert schedules.stages_per_rank(name) == (1 if single else 2), name
    assert schedules.canonical("interleaved1f1b") == "Interleaved1F1B" and schedules.canonical("Zigzag") is None


def test_resolution_and_the_size_rules():
    assert resolve(4, tp_size=2) == ParallelDims(1, 2, 2)
    assert resolve(8, tp_size=2, pp_size=2) == ParallelDims(1, 2, 2, pp=2)
    assert resolve(4, ep_size=2, tp_size=2).dp_shard == 2
    with pytest.raises(ValueError, match=r"DistributedConfig.tp_size must be a positive int, got 0"):
        resolve(4, tp_size=0)
    cli = Spelling(cli=True, processes="--nproc-per-node 6")
    with pytest.raises(ValueError, match=r"^--tp-size must be a positive integer, got 0$"):
        resolve(6, tp_size=0, spelling=cli)
    # the CLI's world counts every axis, pp included (it once checked tp x cp alone)
    with pytest.raises(ValueError, match=r"--nproc-per-node 6 is not a multiple of --tp-size 2 x --pp-size 2"):
        resolve(6, tp_size=2, pp_size=2, spelling=cli)
    with pytest.raises(ValueError, match=r"needs a world size that is a multiple of tp_size=2 .* but the world size is "
                                         r"3 per pipeline stage \(pp_size=2\)"):
        resolve(6, tp_size=2, pp_size=2)


FACTS = ModelFacts(name="Qwen3ForCausalLM", model_type="qwen3", num_layers=4, experts=0)


def test_the_table_decides_each_composition_once():
    too_many = ParallelDims(1, 1, 1, pp=8)
    assert [name for name, _ in refusals(Case(dims=too_many, facts=FACTS))] == ["pp_stages"]
    validate(Case(dims=ParallelDims(1, 1, 2, cp=2, pp=2), facts=FACTS, features=Features(sequence_parallel=True)))
    v = Case(dims=ParallelDims(1, 2, 1, pp=2), facts=FACTS, features=Features(pp_schedule="ZBVZeroBubble"))
    validate(v)  # a V schedule with data parallelism (its rank 0 holds its own copy of a tied head)
    with pytest.raises(ValueError, match=r"ZBVZeroBubble at pp_size=2 needs at least 4 microbatches"):
        validate(Case(dims=v.dims, facts=FACTS, features=Features(pp_schedule="ZBVZeroBubble", batch_size=4,
                                                                   pp_microbatches=2)))
    with pytest.raises(ValueError, match=r"8 pipeline stages for a model of 4 decoder layers"):
        validate(Case(dims=ParallelDims(1, 1, 1, pp=4), facts=FACTS, features=Features(pp_schedule="ZBVZeroBubble")))
    with pytest.raises(ValueError, match=r"ep_size=2 \(--ep-size\), but Qwen3ForCausalLM \('qwen3'\) has no experts"):
        validate(Case(dims=ParallelDims(1, 2, 1, ep=2), facts=FACTS))
    seq = Case(dims=ParallelDims(1, 1, 1, cp=2), features=Features(seq_len=30), spelling=Spelling(seq_len="--seq-len"))
    with pytest.raises(ValueError, match=r"--seq-len is 30, not a multiple of 4"):
        check("cp_seq_len", seq)
    check("pp_stages", seq)  # another row: passes


def test_one_row_is_asked_of_the_values_it_reads():
    # The Case is built by the layout (case_of): the same message as the Case the caller would build.
    assert case_of(cp=2, seq_len=30, spelling=Spelling(seq_len="--seq-len")) == Case(
        dims=ParallelDims(cp=2), features=Features(seq_len=30), spelling=Spelling(seq_len="--seq-len"))
    with pytest.raises(ValueError, match=r"--seq-len is 30, not a multiple of 4"):
        check("cp_seq_len", cp=2, seq_len=30, spelling=Spelling(seq_len="--seq-len"))
    with pytest.raises(ValueError, match=r"ep_size=2 \(--ep-size\), but Qwen3ForCausalLM \('qwen3'\) has no experts"):
        check("ep_dense", ep=2, name="Qwen3ForCausalLM", model_type="qwen3", experts=0)
    check("pp_stages", pp=4, num_layers=4)  # passes
    assert case_of(pp=2).facts is None and case_of(seq_len=8).dims is None  # none given: not known
    with pytest.raises(AssertionError, match="not an input of the rule table"):
        case_of(tp_size=2)
    with pytest.raises(AssertionError, match="reads"):  # a row asked without what it reads would pass unseen
        check("ep_dense", ep=2)


def test_a_parallelism_config_that_contradicts_the_model_is_one_rule():
    case = Case(model_axes=(("tp_size", 2), ("pp_schedule", "1F1B")), config_axes=(("tp_size", None),
                                                                                    ("pp_schedule", "GPipe")))
    with pytest.raises(ValueError, match=r"ParallelismConfig\(pp_schedule='GPipe'\) disagrees with the model, which "
                                         r"was laid out with pp_schedule='1F1B'"):
        validate(case)


# ---------------------------------------------------------------- one message from every entry point

def _entry_points(tmp_path, monkeypatch):
    """(library, trainer, train_cli, plan_cli): each takes a layout and returns the message it refuses it with,
    before any process group or worker: `model.parallelize(DistributedConfig)` (what from_pretrained checks), the
    Trainer's constructor, `tptrain train` (its checks before any worker) and `tptrain plan`."""
    import json
    import shutil

    import tptrain.distributed
    from tptrain.cli import main
    from tptrain.cli import train as train_cli
    from tptrain.distributed import DistributedConfig
    from tptrain.models import AutoConfig, AutoModelForCausalLM
    from tptrain.parallel import pipeline_parallel
    from tptrain.training import ParallelismConfig, Trainer, TrainingArguments

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(train_cli, "_launch", no_workers)
    monkeypatch.setattr(train_cli, "_worker", no_workers)
    bundled = ROOT / "tptrain" / "data" / "tiny-qwen3"  # tied embeddings, 4 layers, config only

    def model_dir(**config):
        path = tmp_path / f"model{len(list(tmp_path.iterdir()))}"
        shutil.copytree(bundled, path)
        (path / "config.json").write_text(json.dumps({**json.loads((bundled / "config.json").read_text()), **config}))
        return path

    def library(path, world, **sizes):
        monkeypatch.setattr(tptrain.distributed, "env_world_size", lambda: world)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), device="meta")
        with pytest.raises(ValueError) as info:
            model.parallelize(DistributedConfig(**sizes))
        return str(info.value)

    def trainer(path, world, *, pp, schedule, cp=1, **args):
        """A meta model as `from_pretrained(DistributedConfig(pp_size=pp, cp_size=cp, ...))` lays it out (its state's
        sizes, pipeline plan and CP context)."""
        from tptrain.distributed.state import ParallelState
        from tptrain.parallel.context_parallel import CPContext

        monkeypatch.setattr(tptrain.distributed, "env_world_size", lambda: world)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), device="meta")
        model.parallel = ParallelState(dims=ParallelDims(pp=pp, cp=cp),
                                       pp=pipeline_parallel.plan_pipeline(model, pp=pp, pp_rank=0, schedule=schedule),
                                       cp=CPContext("unused", cp, 0) if cp > 1 else None)
        config = ParallelismConfig(pp_size=pp, pp_schedule=schedule, pp_microbatches=args.pop("microbatches", None),
                                   **args.pop("parallelism", {}))
        with pytest.raises(ValueError) as info:
            Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "run"), parallelism_config=config,
                                                        **args), train_dataset=["text"])
        return str(info.value)

    def cli(command, capsys, *flags):
        code = main([command, *flags] if command == "plan" else
                    ["train", "--smoke-test", "--output-dir", str(tmp_path / "out"), *flags])
        err = capsys.readouterr().err
        assert code == (1 if command == "plan" else 2) and err.count("\n") == 1, (code, err)
        return err.removeprefix(f"tptrain {command}: error: ").rstrip("\n")

    return model_dir, library, trainer, cli


def test_each_refusal_is_one_message_from_every_entry_point(tmp_path, monkeypatch, capsys):
    model_dir, library, trainer, cli = _entry_points(tmp_path, monkeypatch)
    dense = model_dir()
    # more stages than layers: the library, `tptrain plan`, `tptrain train`
    stages = {library(dense, 8, pp_size=8, tp_size=1),
              cli("plan", capsys, str(dense), "--tp-size", "1", "--pp-size", "8"),
              cli("train", capsys, "--model", str(dense), "--tp-size", "1", "--pp-size", "8", "--nproc-per-node", "8")}
    assert len(stages) == 1 and next(iter(stages)).startswith("8 pipeline stages for a model of 4 decoder layers"), stages
    # sequence and context parallelism under pp compose: `tptrain plan` lays them out
    from tptrain.cli import main

    assert main(["plan", str(dense), "--tp-size", "2", "--pp-size", "2", "--cp-size", "2", "--sequence-parallel"]) == 0
    assert "pp rank 1" in capsys.readouterr().out
    # ep on a dense model: the library, `tptrain plan`, `tptrain train`
    ep = {library(dense, 2, ep_size=2, tp_size=1), cli("plan", capsys, str(dense), "--tp-size", "1", "--ep-size", "2"),
          cli("train", capsys, "--model", str(dense), "--tp-size", "1", "--ep-size", "2", "--nproc-per-node", "2")}
    assert len(ep) == 1 and "has no experts to split" in next(iter(ep)), ep
    # ep folded over cp, not a multiple of it (the router aux loss under cp composes now): the library, `tptrain
    # plan`, `tptrain train`
    moe = model_dir(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=6, num_experts_per_tok=2,
                    moe_intermediate_size=64, output_router_logits=True)
    ep = {library(moe, 6, cp_size=2, ep_size=3, tp_size=1),
          cli("plan", capsys, str(moe), "--tp-size", "1", "--cp-size", "2", "--ep-size", "3"),
          cli("train", capsys, "--model", str(moe), "--tp-size", "1", "--cp-size", "2", "--ep-size", "3",
              "--nproc-per-node", "6")}
    assert len(ep) == 1 and "ep_size=3 (--ep-size) is not a multiple of cp_size=2" in next(iter(ep)), ep
    # what only a training run brings: the Trainer and `tptrain train`
    v = {trainer(dense, 4, pp=2, schedule="ZBVZeroBubble", per_device_train_batch_size=4, microbatches=2),
         cli("train", capsys, "--tp-size", "1", "--pp-size", "2", "--pp-schedule", "ZBVZeroBubble", "--pp-microbatches",
             "2", "--batch-size", "4", "--nproc-per-node", "4")}
    assert len(v) == 1 and next(iter(v)).startswith("pipeline schedule ZBVZeroBubble at pp_size=2 needs at least 4 "
                                                   "microbatches, got pp_microbatches=2"), v


def _plan_train(capsys, path, world: int, layout: str, seq_len: int = 16) -> str:
    """`tptrain plan --train --layout LAYOUT`'s refusal (exit 1: the sizes; exit 2: the layout's run)."""
    from tptrain.cli import main

    code = main(["plan", str(path), "--train", "--world", str(world), "--layout", layout, "--batch-size", "2",
                 "--seq-len", str(seq_len)])
    err = capsys.readouterr().err
    assert code in (1, 2) and err.count("\n") == 1, (code, err)
    return err.rstrip("\n").split(": error: " if code == 1 else " is refused: ", 1)[1]


def test_issue_33_bad_input_from_every_entry_point(tmp_path, monkeypatch, capsys):
    """Issue 33 section 3, each refused before any process group or worker by the library (from_pretrained's
    checks: `model.parallelize`, or the input's split), the Trainer, `tptrain train` and `tptrain plan`, with the
    rule table's message spelled as each entry point names the sizes. The Trainer takes tp, cp, ep and the stages
    from the model, so a refusal of those alone (more stages than layers, the experts) is the library's."""
    import torch

    from tptrain.parallel.context_parallel import CPContext

    model_dir, library, trainer, cli = _entry_points(tmp_path, monkeypatch)
    dense = model_dir()
    moe = model_dir(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=6, num_experts_per_tok=2,
                    moe_intermediate_size=64)
    # an 8-rank layout on a machine told 4: each says to launch 8
    lib = library(dense, 4, tp_size=2, cp_size=2, pp_size=2)
    layout = _plan_train(capsys, dense, 4, "tp=2,cp=2,pp=2")
    assert layout == cli("train", capsys, "--model", str(dense), "--layout", "tp=2,cp=2,pp=2", "--nproc-per-node", "4")
    assert lib.replace("_size", "").split(" needs ")[1] == layout.split(" needs ")[1], (lib, layout)
    assert "launch a multiple of 8 processes" in lib
    assert "needs 1 x 4 x 1 = 4 processes (tp x dp_shard x dp_replicate), but the world size is 2 per pipeline stage " \
           "(pp_size=2); launch 8 (`torchrun --nproc-per-node 8`)" in trainer(dense, 4, pp=2, schedule="1F1B",
                                                                          parallelism=dict(dp_shard_size=4))
    assert cli("train", capsys, "--model", str(dense), "--tp-size", "2", "--cp-size", "2", "--pp-size", "2",
               "--nproc-per-node", "4").startswith("--nproc-per-node 4 is not a multiple of --tp-size 2 x --cp-size 2 "
                                                   "x --pp-size 2;")
    # a size not an int >= 1
    assert library(dense, 4, tp_size=0) == "DistributedConfig.tp_size must be a positive int, got 0"
    assert library(dense, 4, tp_size=1, cp_size=1.5) == "DistributedConfig.cp_size must be a positive int, got 1.5"
    assert trainer(dense, 4, pp=2, schedule="1F1B", parallelism=dict(dp_shard_size=0)) == \
        "ParallelismConfig.dp_shard_size must be a positive int, got 0"
    assert {cli("train", capsys, "--model", str(dense), "--tp-size", "0", "--nproc-per-node", "4"),
            cli("plan", capsys, str(dense), "--tp-size", "0")} == {"--tp-size must be a positive integer, got 0"}
    assert _plan_train(capsys, dense, 4, "tp=0,cp=2") == "tp in --layout 'tp=0,cp=2' must be a positive int, got 0"
    assert {trainer(dense, 4, pp=2, schedule="1F1B", microbatches=0),
            cli("train", capsys, "--model", str(dense), "--tp-size", "1", "--pp-size", "2", "--pp-microbatches", "0",
                "--nproc-per-node", "2")} == {"pipeline schedule 1F1B at pp_size=2 needs at least 2 microbatches, got "
                                              "pp_microbatches=0; raise pp_microbatches (--pp-microbatches) to 2"}
    # cp not dividing the sequence's 2 x cp chunks: the input's split, the Trainer, `tptrain train`, `tptrain plan`
    with pytest.raises(ValueError) as info:
        CPContext("unused", 2, 0).split(torch.zeros(1, 10, dtype=torch.long))
    seq = {str(info.value).replace("input_ids' length (shape (1, 10))", "X"),
           trainer(dense, 2, pp=1, schedule="1F1B", cp=2, seq_len=10).replace("TrainingArguments.seq_len (--seq-len)",
                                                                              "X"),
           cli("train", capsys, "--model", str(dense), "--tp-size", "1", "--cp-size", "2", "--seq-len", "10",
               "--nproc-per-node", "2").replace("--seq-len", "X", 1),
           _plan_train(capsys, dense, 2, "cp=2", seq_len=10).replace("--seq-len", "X", 1)}
    assert seq == {"context parallelism (cp_size=2) cuts every sequence into 2 x cp_size = 4 equal chunks, but X is 10, "
                   "not a multiple of 4; pad the batch to 12 tokens (labels -100), or use a seq_len (--seq-len) that is "
                   "a multiple of 4"}, seq
    # more stages than layers: the rule table's message from `tptrain plan --train` too
    assert _plan_train(capsys, dense, 8, "pp=8") == library(dense, 8, pp_size=8, tp_size=1)
    # ep not dividing the experts: the plan's problem, the same line from each
    problem = ("model.layers.*.mlp.experts: num_experts=6 is not divisible by ep_size=4: every ep rank holds the same "
               "number of whole experts; use an ep_size that divides 6")
    assert library(moe, 4, tp_size=1, ep_size=4).endswith(f"\n  - {problem}")
    assert _plan_train(capsys, moe, 4, "ep=4") == problem
    assert problem in cli("train", capsys, "--model", str(moe), "--tp-size", "1", "--ep-size", "4", "--nproc-per-node",
                          "4")
    from tptrain.cli import main

    assert main(["plan", str(moe), "--tp-size", "1", "--ep-size", "4"]) == 2 and f"  - {problem}" in \
        capsys.readouterr().out
    # ep not fitting inside dp_shard x cp
    fit = {library(moe, 4, tp_size=2, cp_size=2, ep_size=4).split(": ", 1)[1],
           cli("train", capsys, "--model", str(moe), "--tp-size", "2", "--cp-size", "2", "--ep-size", "4",
               "--nproc-per-node", "4").split(": ", 1)[1],
           _plan_train(capsys, moe, 4, "tp=2,cp=2,ep=4").split(": ", 1)[1]}
    assert fit == {"ep_size=4 must divide dp_shard x cp = 1 x 2 (world size 4 = dp_replicate 1 x dp_shard 1 x cp 2 x tp "
                   "2): the experts' owners are the dp_shard x cp ranks; launch a multiple of 8 processes (ep x tp x "
                   "dp_replicate), or use an ep_size that divides 2"}, fit
