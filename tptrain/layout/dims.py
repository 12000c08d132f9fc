"""ParallelDims: the size of every parallel axis of a job, and the sizes resolved against the world size.

    dims = resolve(4, tp_size=2)             # ParallelDims(dp_replicate=1, dp_shard=2, tp=2) (rules.py)
    dims.build_mesh("cpu")                   # the named DeviceMesh (tptrain/distributed/topology.py: torch)

As torchtitan's ParallelDims: the axes are pp (outermost, in the mesh only when > 1), dp_replicate, dp_shard, cp, tp
(innermost, so a TP group is a block of consecutive ranks: one node's GPUs under torchrun). Unused axes have size 1.
Expert parallelism has no ranks of its own: ep is folded over the ranks of dp_shard x cp (`ep_pool`, torchtitan's
and Megatron's MoE folding: the attention side's data- and context-parallel ranks hold different experts). With
ep > 1 the mesh splits dp_shard in two, (dp_shard_mod_ep, dp_shard_in_ep), and the ep group is dp_shard_in_ep x cp
(whole cp groups: ep is a multiple of cp): topology flattens "dp_shard", "ep" and "dp_shard_cp" out of them, so every
axis keeps its meaning.

Pure: imports no torch (the CLI resolves the sizes before it imports anything heavy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
PP_AXIS = "pp"  # outermost; in the mesh only when pp > 1 (each stage's ranks are then a mesh of MESH_AXES)
# the mesh's real axes when ep > 1: "dp_shard" is flattened from (dp_shard_mod_ep, dp_shard_in_ep), "ep" from
# (dp_shard_in_ep, cp): the ep group holds ep / cp dp_shard ranks with all their cp ranks
EP_MESH_AXES = ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
SIZES = ("tp_size", "cp_size", "ep_size", "dp_replicate_size", "dp_shard_size", "pp_size")  # as users spell them
SPELLING_AXES = ("tp", "cp", "pp", "dp_shard", "dp_replicate", "ep")  # the order `spell` writes them in (`--layout`)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel axes. dp_replicate: replicated data parallelism (DDP, or HSDP's replica axis);
    dp_shard: FSDP2's sharding axis; tp: tensor parallelism; ep: expert parallelism, folded over dp_shard x cp (the
    experts are split by expert over `ep` of those ranks; dense layers stay data-parallel over them); cp: context
    parallelism (each rank of a cp group holds 1/cp of every sequence); pp: pipeline stages, the outermost axis
    (each pp rank holds its stage(s) of the model on a mesh of the other axes)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks in all: each holds different samples of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def ep_pool(self) -> int:
        """The ranks ep is folded over: dp_shard x cp (an ep group holds ep / cp dp_shard ranks, each with its whole cp
        group)."""
        return self.dp_shard * self.cp

    @property
    def dp_shard_cp(self) -> int:
        """The ranks FSDP2 shards a dense parameter over: dp_shard x cp (torchtitan's dp_shard_cp; cp ranks compute
        gradients of different tokens of one batch)."""
        return self.dp_shard * self.cp

    @property
    def data_parallel(self) -> bool:
        """Whether the Trainer wraps the model in FSDP2 / HSDP / DDP (dp_replicate x dp_shard x cp > 1: FSDP2 shards
        over dp_shard x cp, torchtitan's dp_shard_cp)."""
        return self.dp_replicate * self.dp_shard_cp > 1

    def spell(self) -> str:
        """"tp=2,cp=2,dp_shard=2": the sizes above 1 (dp_shard always), as `--layout` reads them (`parse`)."""
        return ",".join(f"{axis}={getattr(self, axis)}" for axis in SPELLING_AXES
                        if getattr(self, axis) > 1 or axis == "dp_shard")

    @classmethod
    def parse(cls, text: str, world: int) -> "ParallelDims":
        """`--layout tp=2,cp=2,pp=2,dp_shard=2,dp_replicate=1,ep=2`: omitted sizes are 1, except dp_shard, which
        takes the rest of `world` when omitted. ValueError naming the bad part, or what the world does not divide."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            axis, _, value = (x.strip() for x in part.partition("="))
            if axis not in SPELLING_AXES or not value.isdigit() or int(value) < 1:
                raise ValueError(f"--layout {text!r}: {part!r} is not AXIS=SIZE with AXIS one of "
                                 f"{', '.join(SPELLING_AXES)} and SIZE a positive integer (e.g. tp=2,cp=2,pp=2)")
            if axis in sizes:
                raise ValueError(f"--layout {text!r} gives {axis} twice")
            sizes[axis] = int(value)
        if "dp_shard" not in sizes:
            ranks = {axis: size for axis, size in sizes.items() if axis != "ep"}
            rest = math.prod(ranks.values())
            if world % rest:
                raise ValueError(f"--layout {text!r} needs a multiple of {rest} ranks "
                                 f"({' x '.join(f'{a} {s}' for a, s in ranks.items())}), but --world is {world}; "
                                 f"use a world of {rest} x N, or other sizes")
            sizes["dp_shard"] = world // rest
        dims = cls(**sizes)
        if dims.world_size != world:
            raise ValueError(f"--layout {text!r} is {dims.world_size} ranks ({dims.spell()}), but --world is {world}; "
                             f"make the sizes' product {world}, or leave dp_shard out (it takes the rest)")
        return dims

    def sizes(self) -> dict[str, int]:
        """{axis name: size}: dp_replicate, dp_shard, tp, and "pp" / "ep" / "cp" when larger than 1."""
        out = {axis: getattr(self, axis) for axis in MESH_AXES if axis != "cp"}
        out = {**out, **{axis: getattr(self, axis) for axis in ("ep", "cp") if getattr(self, axis) > 1}}
        return out if self.pp == 1 else {PP_AXIS: self.pp, **out}

    def mesh_shape(self) -> dict[str, int]:
        """{real mesh axis: size}, in mesh order (dp_shard as dp_shard_mod_ep x dp_shard_in_ep when ep > 1, the ep
        group being dp_shard_in_ep x cp)."""
        pp = {PP_AXIS: self.pp} if self.pp > 1 else {}
        if self.ep == 1:
            return {**pp, **{axis: getattr(self, axis) for axis in MESH_AXES}}
        assert self.ep % self.cp == 0 and self.ep_pool % self.ep == 0, self  # the rule table's ep_cp, ep_divides
        in_ep = self.ep // self.cp
        sizes = (self.dp_replicate, self.dp_shard // in_ep, in_ep, self.cp, self.tp)
        return {**pp, **dict(zip(EP_MESH_AXES, sizes))}

    @classmethod
    def of(cls, mesh: Any) -> "ParallelDims":
        """The sizes of a mesh built by `build_mesh` (anything with `mesh_dim_names` and `shape`)."""
        sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
        if "dp_shard_in_ep" not in sizes:
            return cls(**sizes)
        in_ep, cp = sizes["dp_shard_in_ep"], sizes["cp"]
        return cls(dp_replicate=sizes["dp_replicate"], dp_shard=sizes["dp_shard_mod_ep"] * in_ep, tp=sizes["tp"],
                   ep=in_ep * cp, cp=cp, pp=sizes.get(PP_AXIS, 1))

    def build_mesh(self, device_type: str):
        """The named DeviceMesh of these sizes (collective on first use; tptrain/distributed/topology.py)."""
        from tptrain.distributed.topology import build_mesh  # torch: only once a mesh is built

        return build_mesh(self, device_type)


@dataclass(frozen=True)
class Asked:
    """The sizes as given (None: to be resolved: tp and dp_shard take what the world size leaves over)."""

    tp_size: int | None = None
    cp_size: int = 1
    ep_size: int | None = None
    dp_replicate_size: int = 1
    dp_shard_size: int | None = None
    pp_size: int = 1

    def solve(self, world: int) -> ParallelDims | None:
        """The sizes with every axis resolved against `world`, or None when they cannot multiply to it (or pp does
        not divide it). ep is not checked here (its own rules are)."""
        pp = self.pp_size
        if world % pp:
            return None
        world //= pp  # the other axes lay out each stage's ranks
        rep, shard, tp, cp = self.dp_replicate_size, self.dp_shard_size, self.tp_size, self.cp_size or 1
        if tp is None:  # tp takes the rest (with ep_size alone: of dp_shard x cp = ep_size)
            tp = world // (rep * cp * (shard or max(1, (self.ep_size or 1) // cp)))
        if shard is None:
            shard = world // (rep * cp * tp) if tp and world % (rep * cp * tp) == 0 else 0
        if tp < 1 or shard < 1 or rep * shard * cp * tp != world:
            return None
        return ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, ep=self.ep_size or 1, cp=cp, pp=pp)

