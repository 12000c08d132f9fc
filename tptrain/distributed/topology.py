"""The job's one topology: the size of every mesh axis, and the DeviceMesh built from it.

    dims = DistributedConfig(tp_size=2).parallel_dims()      # ParallelDims(dp_replicate=1, dp_shard=2, tp=2) on 4 ranks
    mesh = dims.build_mesh("cpu")                             # axes dp_replicate, dp_shard, tp; dp_mesh(mesh)

As torchtitan's ParallelDims: the axes are ("dp_replicate", "dp_shard", "tp"), TP innermost, so a TP
group is a block of consecutive ranks (one node's GPUs under torchrun). Unused axes have size 1.
`dp_mesh(mesh)` is the flattened dp_replicate x dp_shard axis: the reductions over every data-parallel
rank (token counts, the loss) run on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tptrain.distributed import comm

MESH_AXES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh axes. dp_replicate: replicated data parallelism (DDP, or HSDP's replica axis);
    dp_shard: FSDP2's sharding axis; tp: tensor parallelism."""

    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks in all: each holds different samples of the global batch."""
        return self.dp_replicate * self.dp_shard

    def sizes(self) -> dict[str, int]:
        """{axis name: size}, in mesh order."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @classmethod
    def of(cls, mesh: DeviceMesh) -> "ParallelDims":
        """The sizes of a mesh built by `build_mesh`."""
        return cls(**dict(zip(mesh.mesh_dim_names, mesh.shape)))

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh (collective: every rank calls it once for the job), released at exit with the groups."""
        assert math.prod(self.sizes().values()) == self.world_size
        mesh = init_device_mesh(device_type, tuple(self.sizes().values()), mesh_dim_names=MESH_AXES)
        dp_mesh(mesh)  # created now, on every rank together (it makes process groups)
        return comm.track_mesh(mesh)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened dp_replicate x dp_shard axis of a mesh built by `ParallelDims.build_mesh` (the same
    object each call: torch keeps it on the root mesh)."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")
