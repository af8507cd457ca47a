"""The device mesh built from the parallel dimensions (`meshformer.parallel_dims.ParallelDims`).

`build_mesh` is the only place that talks to `init_device_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshformer.parallel_dims import ParallelDims

# Outer to inner: tp innermost keeps its (most frequent) collectives between neighbouring ranks,
# i.e. inside one node when a node holds tp consecutive ranks, as in Megatron and torchtitan; cp next to it
# (a K/V all-gather per layer).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def device_type_of(device: torch.device | str) -> str:
    return torch.device(device).type


@dataclass
class Meshes:
    """The world mesh and the sub-meshes the parallel models use; sub-meshes of size 1 are still valid meshes."""

    world: DeviceMesh
    dims: ParallelDims

    @property
    def pp(self) -> DeviceMesh:
        return self.world["pp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.world["tp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.world["cp"]

    @property
    def fsdp(self) -> DeviceMesh:
        """1-D (dp_shard x cp) mesh for FSDP, 2-D (dp_replicate, dp_shard x cp) for HSDP: context-parallel ranks
        hold the same parameters, so they shard them too and the gradient reduce-scatter sums their chunks."""
        if self._shard_cp is None:
            return self.world["dp_replicate", "dp_shard"] if self.dims.hsdp else self.world["dp_shard"]
        if not self.dims.hsdp:
            return self._shard_cp
        # torch 2.13 joins a flattened dimension to another by concatenation (slicing it from the root mesh is
        # deprecated); torch 2.11 has no `_concatenate` and slices.
        concatenate = getattr(DeviceMesh, "_concatenate", None)
        if concatenate is not None:
            return concatenate([self.world["dp_replicate"], self._shard_cp])
        return self.world["dp_replicate", "dp_shard_cp"]

    @property
    def dp(self) -> DeviceMesh:
        """The data-parallel ranks (each reads its own samples) flattened into one dimension."""
        return self._dp

    @property
    def tokens(self) -> DeviceMesh:
        """Every rank holding different tokens of the step (data and context parallel): token counts and losses
        are summed over it."""
        return self._tokens

    def __post_init__(self) -> None:
        self._dp = self.world["dp_replicate", "dp_shard"]._flatten("dp")
        self._tokens = self._dp
        self._shard_cp: DeviceMesh | None = None  # (dp_shard, cp) flattened, under context parallel
        if self.dims.cp_enabled:
            self._tokens = self.world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            self._shard_cp = self.world["dp_shard", "cp"]._flatten("dp_shard_cp")

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
    """The 5-D world mesh on this job's device type (gloo on CPU, nccl on CUDA: the process group's choice)."""
    shape = tuple(getattr(dims, name) for name in MESH_DIMS)
    return Meshes(init_device_mesh(device_type_of(device), shape, mesh_dim_names=MESH_DIMS), dims)
