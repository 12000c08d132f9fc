"""The one layout (tptrain/layout): ParallelDims and its resolution against the world size, the one rule table, the
docs' table generated from it. Pure: no process group, no model weights."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tptrain.layout import RULES, Case, Features, ModelFacts, ParallelDims, Spelling, check, refusals, resolve, validate
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


FACTS = ModelFacts(name="Qwen3ForCausalLM", model_type="qwen3", num_layers=4,
                   tied=("model.embed_tokens.weight", "lm_head.weight"), experts=0)


def test_the_table_decides_each_composition_once():
    pp_cp = ParallelDims(1, 1, 1, cp=2, pp=2)
    assert [name for name, _ in refusals(Case(dims=pp_cp, facts=FACTS))] == ["pp_cp"]
    with pytest.raises(ValueError, match=r"DistributedConfig\(pp_size=2\) does not compose with cp_size yet"):
        validate(Case(dims=pp_cp, facts=FACTS))
    v = Case(dims=ParallelDims(1, 2, 1, pp=2), facts=FACTS, features=Features(pp_schedule="ZBVZeroBubble"))
    validate(v)  # the library: whether data parallelism will wrap the model is not known yet
    with pytest.raises(ValueError, match=r"'ZBVZeroBubble' puts the first and the last stage on one rank"):
        validate(Case(dims=v.dims, facts=FACTS, features=Features(pp_schedule="ZBVZeroBubble", data_parallel=True)))
    with pytest.raises(ValueError, match=r"8 pipeline stages for a model of 4 decoder layers"):
        validate(Case(dims=ParallelDims(1, 1, 1, pp=4), facts=FACTS, features=Features(pp_schedule="ZBVZeroBubble")))
    with pytest.raises(ValueError, match=r"ep_size=2, but Qwen3ForCausalLM \('qwen3'\) has no experts to split"):
        validate(Case(dims=ParallelDims(1, 2, 1, ep=2), facts=FACTS))
    seq = Case(dims=ParallelDims(1, 1, 1, cp=2), features=Features(seq_len=30), spelling=Spelling(seq_len="--seq-len"))
    with pytest.raises(ValueError, match=r"--seq-len is 30, not a multiple of 4"):
        check("cp_seq_len", seq)
    check("pp_sp", seq)  # another row: passes


def test_a_parallelism_config_that_contradicts_the_model_is_one_rule():
    case = Case(model_axes=(("tp_size", 2), ("pp_schedule", "1F1B")), config_axes=(("tp_size", None),
                                                                                    ("pp_schedule", "GPipe")))
    with pytest.raises(ValueError, match=r"ParallelismConfig\(pp_schedule='GPipe'\) disagrees with the model, which "
                                         r"was laid out with pp_schedule='1F1B'"):
        validate(case)
