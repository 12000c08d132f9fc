"""The DeviceMesh of a layout: built from a ParallelDims (tptrain/layout/dims.py: the sizes, pure), and its axes
by name.

    mesh = DistributedConfig(tp_size=2).parallel_dims().build_mesh("cpu")   # axes dp_replicate, dp_shard, cp, tp

As torchtitan's: the axes are ("dp_replicate", "dp_shard", "cp", "tp"), TP innermost, so a TP group is a block of
consecutive ranks (one node's GPUs under torchrun); "pp" outermost when pp > 1. Unused axes have size 1.
`dp_mesh(mesh)` is the flattened dp_replicate x dp_shard axis: the reductions over every data-parallel rank (token
counts, the loss) run on it. The cp ranks of one dp rank hold the same batch (each computes a share of its sequence,
parallel/context_parallel.py), so they are not data-parallel ranks; FSDP2 shards over `dp_shard_cp_mesh(mesh)`
(dp_shard x cp flattened, torchtitan's dp_shard_cp), which sums their gradients.

Expert parallelism borrows its ranks from dp_shard x cp (torchtitan's layout, Megatron's MoE folding): with `ep > 1`
the mesh's axes are ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp"); "dp_shard" is the flattened
(dp_shard_mod_ep, dp_shard_in_ep), "ep" the flattened (dp_shard_in_ep, cp) and, with cp > 1, "dp_shard_cp" the
flattened (dp_shard_mod_ep, dp_shard_in_ep, cp), so `mesh["dp_shard"]`, `dp_mesh(mesh)`, `dp_shard_cp_mesh(mesh)`,
`cp_mesh(mesh)` and everything dense keep their meaning. An expert's owners are the `ep` ranks of one "ep" group
(same tp index, same dp_shard_mod_ep: ep / cp dp_shard ranks with their whole cp groups, each rank routing its own
tokens); "dp_shard_mod_ep" (x dp_replicate) is what is left of data parallelism over ranks holding the same
experts.

This module reads a ParallelDims through its attributes only (it does not import tptrain.layout, whose
`ParallelDims.build_mesh` calls `build_mesh` here).
"""
from __future__ import annotations

import math
import warnings

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tptrain.distributed import comm

PP_AXIS = "pp"

# "dp_shard" is a flattened axis of the ep mesh; torch warns on each lookup of one that it may someday want the
# flattened mesh kept by the caller. This library looks it up by name on purpose (one mesh, its axes by name).
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


def build_mesh(dims, device_type: str) -> DeviceMesh:
    """The named mesh of `dims` (a ParallelDims; collective on first use), released at exit with the groups; one
    per layout and process group (`comm.shared_mesh`): every model and Trainer of a process with these sizes shares
    it."""
    shape = dims.mesh_shape()
    assert dims.ep_pool % dims.ep == 0 and math.prod(shape.values()) == dims.world_size, dims
    return comm.shared_mesh((device_type, tuple(shape.items())), lambda: _new_mesh(shape, device_type))


def _new_mesh(shape: dict[str, int], device_type: str) -> DeviceMesh:
    mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    if "dp_shard_in_ep" in shape:  # created now, on every rank together (it makes process groups)
        mesh["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten("dp_shard")
        mesh["dp_shard_in_ep", "cp"]._flatten("ep")
        if shape["cp"] > 1:
            mesh["dp_shard_mod_ep", "dp_shard_in_ep", "cp"]._flatten("dp_shard_cp")
    dp_mesh(mesh)
    if shape.get("cp", 1) > 1:
        dp_shard_cp_mesh(mesh)
    return mesh


def rank_grid(mesh: DeviceMesh):
    """The ranks of a mesh built by `build_mesh` as a (dp_replicate, dp_shard, tp) tensor, whichever axes it has
    (dp_shard's order is the flattened (dp_shard_mod_ep, dp_shard_in_ep)'s; with cp > 1, dp_shard x cp flattened:
    the ranks FSDP2 shards over, in "dp_shard_cp"'s order)."""
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    return stage_mesh(mesh).mesh.reshape(sizes["dp_replicate"], -1, sizes["tp"])


def stage_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """This pipeline stage's ranks as a mesh without the pp axis (the mesh itself when it has none): what a stage's
    model, its TP, FSDP and checkpoints are laid out on, exactly as a whole model on a mesh without pp."""
    names = mesh.mesh_dim_names
    return mesh if PP_AXIS not in names else mesh[tuple(n for n in names if n != PP_AXIS)]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened dp_replicate x dp_shard axis of a mesh built by `ParallelDims.build_mesh` (the same
    object each call: torch keeps it on the root mesh)."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def dp_shard_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP2 shards over: dp_shard, or with cp > 1 the flattened dp_shard x cp axis ("dp_shard_cp"): the cp
    ranks of a dp rank compute gradients of different tokens of one batch, which its reduce-scatter sums."""
    if cp_mesh(mesh) is None:
        return mesh["dp_shard"]
    if "dp_shard_in_ep" in mesh.mesh_dim_names:  # flattened from the real axes when the mesh was built
        return mesh["dp_shard_cp"]
    return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The cp axis of a mesh built by `build_mesh`, or None when it has size 1."""
    return mesh["cp"] if "cp" in mesh.mesh_dim_names and mesh["cp"].size() > 1 else None


def dp_placements(t) -> dict:
    """{mesh axis: placement} of an FSDP2-sharded DTensor `t` ({} for a plain tensor), its flattened dp_shard x cp
    axis read as "dp_shard": checkpoint views and the gradient norm see FSDP's shards along one dp_shard axis of
    size dp_shard x cp (`rank_grid`'s)."""
    names = getattr(getattr(t, "device_mesh", None), "mesh_dim_names", None) or ()
    return {("dp_shard" if name == "dp_shard_cp" else name): p for name, p in zip(names, getattr(t, "placements", ()))}


def expert_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel axes over ranks holding the same experts, as FSDP2 takes them for the experts of a mesh
    with an ep axis: (dp_replicate, dp_shard_mod_ep) as HSDP when dp_replicate > 1, else dp_shard_mod_ep (of size
    1 when dp_shard == ep: each expert is then on one rank of the ep group only)."""
    assert "dp_shard_mod_ep" in mesh.mesh_dim_names, mesh
    return mesh["dp_replicate", "dp_shard_mod_ep"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard_mod_ep"]
