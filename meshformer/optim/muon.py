"""Muon (momentum orthogonalised by Newton–Schulz) for the blocks' weight matrices, AdamW for everything else.

`Muon` is one torch optimizer whose parameter groups each take one of two updates (`group["update"]`):
- "muon": the 2-D weights of the blocks (attention and feed-forward projections, shared experts) and the stacked
  expert weights ([experts, d_in, d_out], each expert its own matrix). Per matrix: Nesterov momentum
  (buf = mu·buf + g; update direction g + mu·buf), 5 quintic Newton–Schulz iterations in fp32 (the update's
  singular values pushed towards 1), the update scaled (`scale`), decoupled weight decay.
- "adamw": embeddings, the output head, norms, biases, routers, anything 1-D: torch's AdamW update, with AdamW's
  state names (step, exp_avg, exp_avg_sq), so that state checkpoints like AdamW's.

Every layout: a parameter under FSDP/TP/EP is a DTensor whose local piece is a slice of its matrix. The update is
elementwise up to Newton–Schulz, which needs each whole matrix: each Muon parameter's update is all-gathered over
the mesh dims that split a matrix (`_whole_placements`: dims 1-2 of expert weights and both dims of 2-D weights; the
expert dim stays sharded: experts stay where expert parallelism put them). One rank of those that share the
matrix, its owner, orthogonalises it (owners chosen so each rank gets an equal share of the Newton–Schulz work,
`_owners`); the others contribute zeros, and a reduce-scatter of the sum (exact: x + 0 = x) hands each rank its
slice. So every layout computes what one process computes, each rank 1/G of the matrices (G: the ranks sharing
them). Pipeline stages hold their own parameters and step alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.adamw import adamw

from meshformer.errors import ConfigError
from meshformer.optim.optimizer_spec import FP32, OptimizerSpec, SharedKeys, decays, local, unique_trainable
from meshformer.renamed import warn_renamed_key

# Quintic Newton–Schulz coefficients (Keller Jordan's): fast growth of small singular values; the result's singular
# values land in about [0.7, 1.2], not exactly 1, which training tolerates.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
Scale = Literal["moonlight", "shape"]


def is_muon_parameter(name: str, param: torch.Tensor) -> bool:
    """Muon for the matrices inside the blocks (names under `*_layers.<i>.`), not their routers; AdamW for the rest
    (embeddings, position and relative-bias tables, output head, head transform, norms, biases) and for weights with
    a single row or column (a depthwise convolution's (C, 1, W), a shared expert's gate (1, d)): orthogonalising a
    vector only normalises it."""
    return (param.ndim in (2, 3) and min(param.shape[-2:]) > 1 and "_layers." in name and ".router." not in name
            and decays(name, param))


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """An approximately orthogonal matrix with `g`'s singular vectors (U·Vᵀ of g = U·S·Vᵀ), computed in fp32;
    batched over leading dims (one matrix per expert)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.float32)
    transposed = x.size(-2) > x.size(-1)
    if transposed:  # iterate on the wide orientation: the Gram matrix x·xᵀ is the smaller one
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transposed else x


def update_scale(shape: torch.Size | tuple[int, ...], scale: Scale) -> float:
    """Factor on the orthogonalised update of one matrix of `shape` (the last two dims).

    "moonlight": 0.2·sqrt(max(m, n)), which gives the update AdamW's typical RMS (0.2), so AdamW's lr and weight
    decay carry over. "shape": sqrt(max(1, fan_out / fan_in)) (Keller Jordan's), with a Linear weight [out, in] and
    a stacked expert weight [experts, in, out].
    """
    rows, cols = shape[-2], shape[-1]
    if scale == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    fan_out, fan_in = (cols, rows) if len(shape) == 3 else (rows, cols)
    return math.sqrt(max(1.0, fan_out / fan_in))


def _keeps(like: DTensor, placement: Placement) -> bool:
    """Whether `placement` leaves each matrix whole: a split of a stacked expert weight's expert dim."""
    return like.ndim == 3 and isinstance(placement, Shard) and placement.dim == 0


def _whole_placements(like: DTensor) -> list[Placement]:
    return [p if _keeps(like, p) else Replicate() for p in like.placements]


def _whole_matrices(update: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`update` (the local piece of a parameter shaped like `like`) with each of its matrices whole on this rank."""
    if not isinstance(like, DTensor):
        return update
    full = DTensor.from_local(update, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
                              run_check=False)
    return full.redistribute(like.device_mesh, _whole_placements(like)).to_local()


def _own_slice(whole_update: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a whole update that only the matrix's owner computed (zeros elsewhere): the sum over
    the ranks sharing the matrix, reduce-scattered."""
    if not isinstance(like, DTensor):
        return whole_update
    mesh = like.device_mesh
    partial = [p if _keeps(like, p) else Partial("sum") for p in like.placements]
    full = DTensor.from_local(whole_update, mesh, partial, shape=like.shape, stride=like.stride(), run_check=False)
    if any(isinstance(p, _StridedShard) for p in like.placements):  # FSDP over TP: no direct reduce-scatter to it
        full = full.redistribute(mesh, _whole_placements(like))
    return full.redistribute(mesh, like.placements).to_local()


def _share(like: torch.Tensor) -> tuple[tuple[Any, ...], int, int]:
    """(the group of ranks that share `like`'s matrices, its size G, this rank's index in it)."""
    if not isinstance(like, DTensor):
        return (), 1, 0
    mesh = like.device_mesh
    dims = [d for d, p in enumerate(like.placements) if not _keeps(like, p)]
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # this rank holds a piece of the parameter
    size, index = 1, 0
    for d in dims:
        index = index * mesh.size(d) + coordinate[d]
        size *= mesh.size(d)
    return (id(mesh), tuple(dims)), size, index


def _owners(params: list[torch.Tensor]) -> list[bool]:
    """Whether this rank orthogonalises each parameter's matrices: per group of ranks sharing them, each parameter
    to the least-loaded rank by Newton–Schulz cost (the same choice on every rank: it depends on shapes only)."""
    loads: dict[tuple[Any, ...], list[float]] = {}
    mine = []
    for p in params:
        group, size, index = _share(p)
        load = loads.setdefault(group, [0.0] * size)
        owner = min(range(size), key=lambda r: load[r])
        rows, cols = p.shape[-2:]
        load[owner] += p.numel() * min(rows, cols)
        mine.append(owner == index)
    return mine


class Muon(torch.optim.Optimizer):
    """Muon groups (`update="muon"`: lr, weight_decay, momentum, ns_steps, scale) and AdamW groups (`update="adamw"`:
    lr, betas, eps, weight_decay); see the module notes."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        defaults = dict(lr=1e-3, weight_decay=0.0, momentum=0.95, ns_steps=5, scale="moonlight", betas=(0.9, 0.95),
                        eps=1e-8, update="adamw")
        super().__init__([_renamed_group(group, warn=True) for group in groups], defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, reading the groups' `kind` of state saved by earlier releases as `update`."""
        groups = [_renamed_group(group, warn=False) for group in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "Muon takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["update"] == "muon":
                self._muon_step(group, params)
            else:
                self._adamw_step(group, params)

    def _muon_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p, owner in zip(params, _owners(params), strict=True):
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grad, buf = local(p.grad), local(state["momentum_buffer"])  # type: ignore[arg-type]
            buf.mul_(mu).add_(grad)
            update = grad.add(buf, alpha=mu)  # Nesterov
            whole = _whole_matrices(update, p)
            ortho = newton_schulz(whole, group["ns_steps"]).to(update.dtype) if owner else torch.zeros_like(whole)
            ortho, scale = self._finish(group, p, ortho, owner)
            ortho = _own_slice(ortho, p)
            weight = local(p)
            if wd:
                weight.mul_(1 - lr * wd)
            weight.add_(ortho, alpha=-lr * scale)

    def _finish(self, group: dict[str, Any], p: torch.Tensor, ortho: torch.Tensor, owner: bool
                ) -> tuple[torch.Tensor, float]:
        """The whole update of `p`'s matrices (zeros where this rank is not their owner) and its factor; every
        rank sharing them calls it (a variant may reduce over them, optim/normuon.py)."""
        return ortho, update_scale(p.shape, group["scale"])

    def _adamw_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        grads: list[torch.Tensor] = []
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad)  # type: ignore[arg-type]  # params with a gradient only
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, amsgrad=False,
                                beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                                eps=group["eps"], maximize=False)


def _renamed_group(group: dict[str, Any], warn: bool) -> dict[str, Any]:
    """`group` with `kind`, the update's key in earlier releases, as `update` (a caller's group warns once)."""
    if "kind" not in group:
        return group
    if warn:
        warn_renamed_key("Muon parameter group key 'kind'", "'update'")
    renamed = {k: v for k, v in group.items() if k != "kind"}
    renamed.setdefault("update", group["kind"])  # a group holding both (a loaded one merged into ours): ours wins
    return renamed


def matrix_groups(named: Iterable[tuple[str, nn.Parameter]], shared: SharedKeys, matrices: dict[str, Any]
                  ) -> list[dict[str, Any]]:
    """Parameter groups by rule (`is_muon_parameter`): AdamW with decay (other matrices), AdamW without decay
    (1-D), and the matrices with the hyperparameters `matrices` (update="muon")."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    muon: list[nn.Parameter] = []
    for name, param in named:
        if is_muon_parameter(name, param):
            muon.append(param)
        else:
            (decay if decays(name, param) else no_decay).append(param)
    adamw = dict(update="adamw", lr=shared.lr, betas=shared.betas, eps=shared.eps)
    return [{**adamw, "params": decay, "weight_decay": shared.weight_decay},
            {**adamw, "params": no_decay, "weight_decay": 0.0},
            dict(update="muon", params=muon, **matrices)]


@dataclass
class MuonConfig:
    """`[optim.muon]`: the matrices' hyperparameters (the rest takes the shared `[optim]` AdamW keys)."""

    lr: float = 3e-3  # Muon's peak lr (the schedule scales it as optim.lr)
    weight_decay: float = 0.1  # decoupled, on the Muon matrices
    momentum: float = 0.95  # Nesterov momentum
    ns_steps: int = 5  # Newton–Schulz iterations per matrix
    # update scale: "moonlight" 0.2*sqrt(max(m, n)) (AdamW's update RMS: AdamW's lr carries over) or "shape"
    # sqrt(max(1, fan_out/fan_in)) (Keller Jordan's; wants a larger lr, e.g. 0.02)
    scale: Literal["moonlight", "shape"] = "moonlight"


def check_matrix_keys(name: str, lr: float, weight_decay: float, momentum: float, ns_steps: int) -> None:
    if lr <= 0 or weight_decay < 0 or not 0 <= momentum < 1 or ns_steps < 1:
        raise ConfigError(f"optim.{name}.lr={lr}, optim.{name}.weight_decay={weight_decay}, "
                          f"optim.{name}.momentum={momentum}, optim.{name}.ns_steps={ns_steps} out of range",
                          "use lr > 0, weight_decay >= 0, momentum in [0, 1), ns_steps >= 1 (e.g. 5)")


class MuonSpec(OptimizerSpec):
    name = "muon"
    table = MuonConfig
    optimizer_class = Muon
    state_description = "Muon momentum 1 x fp32 on its matrices, AdamW moments 2 x fp32 on the rest"

    def build(self, model_parts: list[nn.Module], shared: SharedKeys, table: MuonConfig
              ) -> tuple[torch.optim.Optimizer, str]:
        groups = matrix_groups(unique_trainable(model_parts), shared,
                               dict(lr=table.lr, weight_decay=table.weight_decay, momentum=table.momentum,
                                    ns_steps=table.ns_steps, scale=table.scale))
        return Muon(groups), f"{table.ns_steps} Newton-Schulz steps, {table.scale} scale; AdamW part foreach"

    def check(self, table: MuonConfig) -> None:
        check_matrix_keys(self.name, table.lr, table.weight_decay, table.momentum, table.ns_steps)

    def state_bytes(self, numel: int, matrix_numel: int, matrix_gather: int) -> tuple[float, float]:
        # one momentum on the matrices, two moments elsewhere; stepping one matrix at a time holds the gathered
        # update, Newton–Schulz's iterate, its product and the result (fp32): about 5 copies of the largest
        return FP32 * (2.0 * numel - matrix_numel), 5.0 * FP32 * matrix_gather
