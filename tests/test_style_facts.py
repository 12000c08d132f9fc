"""A new partition style is one class: what LoRA, the communication report and the transformers backend need of a
style they read from the facts on its class (adapter_split, sums_output, per_parameter_rules, transformers_names),
never from its name; and a new expert style is one subclass naming its split and dispatch."""
from __future__ import annotations

import pytest

from tptrain.hf.plan import parameter_owner_styles, translate_plan
from tptrain.parallel import expert_parallel
from tptrain.parallel.styles import STYLES, ShardSpec, register_style
from tptrain.parallel.styles.linear import RowwiseParallel
from tptrain.peft.lora import PARTIAL, factor_specs


@pytest.fixture
def probe_style():
    @register_style
    class ProbeRowwise(RowwiseParallel):
        name = "probe_rowwise"
        transformers_names = ("probe_rep",)
        per_parameter_rules = True

    yield ProbeRowwise
    del STYLES[ProbeRowwise.name]


def test_a_new_style_is_read_by_its_facts(probe_style):
    assert translate_plan({"m.down": "probe_rep", "m.up": "colwise_rep", "m.w": "grouped_gemm"}) == {
        "m.down": "probe_rowwise", "m.up": "colwise_gather_output"}
    assert translate_plan({"m.o": "rowwise_rep"}) == {"m.o": "rowwise"}  # not the probe's: it is rowwise's own name
    assert factor_specs("probe_rowwise", ShardSpec(1), "m.down") == (ShardSpec(1), PARTIAL)  # as rowwise's adapter
    assert "probe_rowwise" in parameter_owner_styles()
    with pytest.raises(ValueError, match=r"style 'rowwise_split_input' is not supported \(supported: .*colwise"):
        factor_specs("rowwise_split_input", ShardSpec(1), "m.down")


def test_the_old_name_tables_are_the_facts():
    # what peft/lora.py, hf/plan.py and the accounting listed by name before the styles said it themselves
    adapted = {name for name, cls in STYLES.items() if cls.adapter_split}
    assert adapted == {"colwise", "colwise_gather_output", "fused_colwise", "rowwise", "embedding_rowwise"}
    assert set(parameter_owner_styles()) == {"local_params", "moe_tp_experts", "all_reduce"}
    assert {"rowwise", "embedding_rowwise"} <= {name for name, cls in STYLES.items() if cls.sums_output}


def test_an_expert_style_is_its_split_and_dispatch():
    facts = {name: (cls.split, cls.dispatch) for name, cls in STYLES.items()
             if issubclass(cls, expert_parallel.TPExpertsStyle)}
    assert facts == {"expert_tensor_parallel": ("inner", "all_reduce"),
                     "expert_parallel_all_reduce": ("experts", "all_reduce"),
                     "expert_parallel_all_to_all": ("experts", "all_to_all"),
                     "expert_parallel": ("experts", "auto")}
