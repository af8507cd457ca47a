"""The device mesh built from the parallel dimensions (`meshformer.parallel_dims.ParallelDims`).

`build_mesh` is the only place that talks to `init_device_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshformer.parallel_dims import ParallelDims

# Outer to inner: tp innermost keeps its (most frequent) collectives between neighbouring ranks,
# i.e. inside one node when a node holds tp consecutive ranks, as in Megatron and torchtitan; cp next to it
# (a K/V all-gather per layer).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# With expert parallelism dp_shard is built from two dimensions: its inner part joins cp and tp in the expert-
# parallel group (next to each other, for the all-to-alls), the outer part shards the experts with FSDP.
EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")


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
        return self._fsdp

    @property
    def dp(self) -> DeviceMesh:
        """The data-parallel ranks (each reads its own samples) flattened into one dimension."""
        return self._dp

    @property
    def tokens(self) -> DeviceMesh:
        """Every rank holding different tokens of the step (data and context parallel): token counts and losses
        are summed over it."""
        return self._tokens

    @cached_property
    def moe_tokens(self) -> DeviceMesh:
        """The ranks of one pipeline stage holding different tokens of a micro-batch inside MoE layers (data,
        context and tensor parallel: under sequence parallel each tensor-parallel rank routes its own tokens)."""
        return self.world["dp_replicate", *self._shard, "cp", "tp"]._flatten("moe_tokens")

    @cached_property
    def sequence(self) -> DeviceMesh:
        """The ranks holding pieces of the same sequences (context x tensor parallel)."""
        return self.world["cp", "tp"]._flatten("cp_tp")

    @cached_property
    def ep(self) -> DeviceMesh:
        """Expert parallel: the ranks splitting each MoE layer's experts and exchanging tokens all-to-all."""
        assert self.dims.ep_enabled
        return self.world["dp_shard_in_ep", "cp", "tp"]._flatten("ep")

    @cached_property
    def expert_fsdp(self) -> DeviceMesh:
        """FSDP's mesh for expert-parallel weights: the data-parallel ranks that expert parallelism leaves,
        (dp_replicate, dp_shard_mod_ep) under HSDP."""
        assert self.dims.ep_enabled
        shard = self.world["dp_shard_mod_ep"]
        return _join(self.world, self.world["dp_replicate"], shard) if self.dims.hsdp else shard

    def __post_init__(self) -> None:
        w, dims = self.world, self.dims
        # torch 2.13 deprecates slicing a flattened dimension from the root mesh: each sub-mesh is flattened from
        # the world's own dimensions, and a flattened one is joined to another by concatenation.
        self._shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if dims.ep_enabled else ("dp_shard",)
        self._dp = w["dp_replicate", *self._shard]._flatten("dp")
        self._tokens = self._dp if not dims.cp_enabled else w["dp_replicate", *self._shard, "cp"]._flatten("dp_cp")
        sharded = (*self._shard, "cp") if dims.cp_enabled else self._shard
        fsdp = w[sharded[0]] if len(sharded) == 1 else w[sharded]._flatten("dp_shard_cp" if dims.cp_enabled
                                                                           else "dp_shard")
        self._fsdp = _join(w, w["dp_replicate"], fsdp) if dims.hsdp else fsdp

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.tp.get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.pp.get_local_rank()


def _join(world: DeviceMesh, replicate: DeviceMesh, shard: DeviceMesh) -> DeviceMesh:
    """The 2-D (replicate, shard) mesh of HSDP, `shard` possibly flattened (torch 2.11 has no `_concatenate`:
    there the flattened name is sliced from the world mesh)."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate([replicate, shard])
    assert replicate.mesh_dim_names is not None and shard.mesh_dim_names is not None
    return world[(*replicate.mesh_dim_names, *shard.mesh_dim_names)]


def build_mesh(dims: ParallelDims, device: torch.device | str) -> Meshes:
    """The world mesh on this job's device type (gloo on CPU, nccl on CUDA: the process group's choice): 5-D, or
    6-D with expert parallelism (dp_shard split in two)."""
    names: tuple[str, ...]
    if dims.ep_enabled:
        names = EP_MESH_DIMS
        shape = tuple(dims.dp_shard_mod_ep if n == "dp_shard_mod_ep" else dims.dp_shard_in_ep
                      if n == "dp_shard_in_ep" else getattr(dims, n) for n in names)
    else:
        names, shape = MESH_DIMS, tuple(getattr(dims, name) for name in MESH_DIMS)
    return Meshes(init_device_mesh(device_type_of(device), shape, mesh_dim_names=names), dims)
