"""The parallel dimensions (pp × dp_replicate × dp_shard × cp × tp) and the device mesh built from them.

`ParallelDims` is pure arithmetic on the config and the world size, so every mistake in it is reported
before any process-group work. `build_mesh` is the only place that talks to `init_device_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshformer.config import ConfigError, ParallelConfig

# Outer to inner: tp innermost keeps its (most frequent) collectives between neighbouring ranks,
# i.e. inside one node when a node holds tp consecutive ranks, as in Megatron and torchtitan.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve dp_shard = -1 ("the rest of the world") and check the product against the world size."""
        for key in ("pp", "dp_replicate", "cp", "tp"):
            if getattr(cfg, key) < 1:
                raise ConfigError(f"parallel.{key} must be >= 1, got {getattr(cfg, key)}")
        if cfg.dp_shard == 0 or cfg.dp_shard < -1:
            raise ConfigError(f"parallel.dp_shard must be >= 1 or -1 (the rest of the world), got {cfg.dp_shard}")
        others = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallel.pp={cfg.pp} x dp_replicate={cfg.dp_replicate} x cp={cfg.cp} x tp={cfg.tp} = {others} "
                    f"does not divide the world size {world_size}; choose dimensions whose product divides it"
                )
            dp_shard = world_size // others
        product = others * dp_shard
        if product != world_size:
            raise ConfigError(
                f"mesh pp={cfg.pp} x dp_replicate={cfg.dp_replicate} x dp_shard={dp_shard} x cp={cfg.cp} x "
                f"tp={cfg.tp} = {product} processes, but the world has {world_size}; make the product equal the "
                "number of processes (parallel.dp_shard=-1 takes whatever the other dimensions leave)"
            )
        return cls(cfg.pp, cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in ("pp", "dp_replicate", "dp_shard", "tp")]
        return " x ".join(parts) + f" (world {self.world_size})"


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
