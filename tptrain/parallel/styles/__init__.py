"""Partition styles: how one module is split across the tensor-parallel axis.

A style is a small class registered by name. It declares, as data, which dim of each parameter is
split (`ShardSpec`) and installs the forward-time communication on the module. Adding a style means
adding one class (in the file of its kind). Modules stay ordinary `nn.Linear` / `nn.Embedding` / norm
modules holding their local shard under their Hugging Face parameter names.

    spec.py        ShardSpec
    context.py     TPContext: the TP group and per-forward flags every style of a model shares
    base.py        ParallelStyle, the registry (STYLES, aliases, make_style), the local-output hooks
    linear.py      colwise, rowwise, colwise_gather_output (the LM head), rowwise_split_input
    local.py       local_params, all_reduce, moe_tp_experts, moe_identity_expert, mla_kv_a_proj: modules split by
                   per-parameter rules, or whole
    fused.py       fused_colwise (alias packed_colwise): fused q/k/v or gate/up, each segment split on its own
    embedding.py   embedding_rowwise (vocab-parallel embedding)
    replicated.py  replicated_with_grad_allreduce, sequence_parallel (norms), distributed_rmsnorm
The expert styles live beside their dispatch (parallel/expert_parallel.py).
"""
from tptrain.parallel.styles.base import (STYLE_ALIASES, STYLES, ParallelStyle, replace_forward, canonical_style,
                                          make_style, register_local_output_hook, register_style)
from tptrain.parallel.styles.context import TPContext
from tptrain.parallel.styles.embedding import EmbeddingRowwise, vocab_shard_embedding, vocab_shard_ids
from tptrain.parallel.styles.fused import FusedColwiseParallel
from tptrain.parallel.styles.linear import ColwiseGatherOutput, ColwiseParallel, RowwiseParallel, RowwiseSplitInput
from tptrain.parallel.styles.local import AllReduceParallel, LocalParams, MlaKvAProj, MoeIdentityExpert, MoeTPExperts
from tptrain.parallel.styles.replicated import DistributedRMSNorm, ReplicatedWithGradAllreduce, SequenceParallel
from tptrain.parallel.styles.spec import ShardSpec

__all__ = ["STYLES", "STYLE_ALIASES", "AllReduceParallel", "MoeIdentityExpert", "ColwiseGatherOutput", "ColwiseParallel", "DistributedRMSNorm",
           "EmbeddingRowwise", "FusedColwiseParallel", "LocalParams", "MlaKvAProj", "MoeTPExperts", "ParallelStyle", "ReplicatedWithGradAllreduce",
           "RowwiseParallel", "RowwiseSplitInput", "SequenceParallel", "ShardSpec", "TPContext", "canonical_style", "make_style",
           "register_local_output_hook", "register_style", "replace_forward", "vocab_shard_embedding", "vocab_shard_ids"]
