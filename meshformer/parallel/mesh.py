"""The device mesh built from the parallel dimensions (`meshformer.layout.ParallelDims`).

`build_mesh` is the only place that talks to `init_device_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshformer.layout import ParallelDims

# Outer to inner: tp innermost keeps its (most frequent) collectives between neighbouring ranks,
# i.e. inside one node when a node holds tp consecutive ranks, as in Megatron and torchtitan.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def device_type_of(device: torch.device | str) -> str:
    return torch.device(device).type


@dataclass
class Meshes:
    """The world mesh and the sub-meshes the plans use; sub-meshes of size 1 are still valid meshes."""

    world: DeviceMesh
    dims: ParallelDims

    @property
    def pp(self) -> DeviceMesh:
        return self.world["pp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.world["tp"]

    @property
    def fsdp(self) -> DeviceMesh:
        """1-D (dp_shard) mesh for FSDP, 2-D (dp_replicate, dp_shard) for HSDP."""
        if self.dims.hsdp:
            return self.world["dp_replicate", "dp_shard"]
        return self.world["dp_shard"]

    @property
    def dp(self) -> DeviceMesh:
        """All data-parallel ranks flattened into one dimension (token counts, loss reductions)."""
        return self._dp

    def __post_init__(self) -> None:
        self._dp = self.world["dp_replicate", "dp_shard"]._flatten("dp")

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.tp.get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.pp.get_local_rank()


def build_mesh(dims: ParallelDims, device: torch.device | str) -> Meshes:
    """The 4-D world mesh on this job's device type (gloo on CPU, nccl on CUDA: the process group's choice)."""
    shape = tuple(getattr(dims, name) for name in MESH_DIMS)
    return Meshes(init_device_mesh(device_type_of(device), shape, mesh_dim_names=MESH_DIMS), dims)
