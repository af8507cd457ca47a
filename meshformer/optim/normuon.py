"""NorMuon (Li et al. 2025, arXiv:2510.05491): Muon whose orthogonalised update is then normalised per neuron by a
second-moment estimate, Adam-style, and rescaled to AdamW's update RMS.

Why this one as the third optimizer: Muon's orthogonalised updates leave the neurons' update norms uneven (a few
neurons dominate); NorMuon evens them out for one extra fp32 per neuron (a vector per matrix, not a second moment
per element); its paper reports faster training than both Muon and AdamW at 1.1B parameters. It reuses
Muon's distributed step (optim/muon.py: owners, whole matrices) unchanged, so it adds one file. Dion (low-rank,
its own distributed algorithm) and schedule-free AdamW (evaluation on another weight average than training's)
would each reach into the training loop or the layouts.

Per matrix W (m x n: a Linear's [out, in]; a stacked expert's [in, out], its neurons the last dim), on the matrix's
owner (optim/muon.py's module notes):
    O = NewtonSchulz(g + mu·buf)                    Muon's Nesterov momentum and orthogonalisation
    v = beta2·v + (1 - beta2)·mean_over_inputs(O²)  one value per output neuron (state `second_momentum`)
    U = O / (sqrt(v) + eps);  U *= 0.2·sqrt(m·n) / ‖U‖_F   (update RMS 0.2: AdamW's lr carries over)
    W ← W·(1 - lr·wd) - lr·U
`v` is whole on every rank that shares the matrix: the owner's new value, summed over them with the others' zeros.
Under FSDP/TP it is a DTensor replicated over the dims that split a matrix and sharded as its parameter over the
expert dim (`neuron_state`); that layout is its resharding rule (`state_template`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor import empty as dtensor_empty

from meshformer.errors import ConfigError
from meshformer.optim.muon import Muon, MuonSpec, _keeps, _whole_placements, check_matrix_keys, matrix_groups
from meshformer.optim.optimizer_spec import FP32, OptimizerSpec, SharedKeys, local, unique_trainable

SECOND_MOMENT = "second_momentum"


@dataclass
class NorMuonConfig:
    """`[optim.normuon]`: the matrices' hyperparameters (the rest takes the shared `[optim]` AdamW keys)."""

    lr: float = 3e-3  # peak lr of the matrices (the schedule scales it as optim.lr); updates have AdamW's RMS 0.2
    weight_decay: float = 0.1  # decoupled, on the matrices
    momentum: float = 0.95  # Nesterov momentum (Muon's)
    beta2: float = 0.95  # decay of the per-neuron second moment
    ns_steps: int = 5  # Newton–Schulz iterations per matrix


def _input_dim(param: torch.Tensor) -> int:
    """The dim averaged over per neuron: a Linear [out, in]'s last; a stacked expert [E, in, out]'s middle."""
    return -1 if param.ndim == 2 else -2


def neuron_state(param: torch.Tensor) -> torch.Tensor:
    """An empty fp32 tensor for `param`'s per-neuron second moment (its input dim of size 1), laid out as the
    step keeps it: whole matrices' worth on every rank sharing them."""
    shape = list(param.shape)
    shape[_input_dim(param)] = 1
    if isinstance(param, DTensor):
        return dtensor_empty(shape, dtype=torch.float32, device_mesh=param.device_mesh,
                             placements=_whole_placements(param))
    return torch.empty(shape, dtype=torch.float32, device=param.device)


class NorMuon(Muon):
    """Muon's groups (`update="muon"` adds beta2 and eps) with the per-neuron normalisation; AdamW groups as Muon's."""

    def _finish(self, group: dict[str, Any], p: torch.Tensor, ortho: torch.Tensor, owner: bool
                ) -> tuple[torch.Tensor, float]:
        state = self.state[p]
        if SECOND_MOMENT not in state:
            state[SECOND_MOMENT] = neuron_state(p).zero_()
        v = state[SECOND_MOMENT]
        mine = local(v)
        if owner:
            o = ortho.float()
            new = mine * group["beta2"] + (1 - group["beta2"]) * o.square().mean(dim=_input_dim(p), keepdim=True)
            normed = o / (new.sqrt() + group["eps"])
            rows, cols = p.shape[-2:]
            rms = normed.norm(dim=(-2, -1), keepdim=True).clamp_min(group["eps"]) / math.sqrt(rows * cols)
            ortho = (normed * (0.2 / rms)).to(ortho.dtype)
        else:
            new = torch.zeros_like(mine)
        mine.copy_(_sum_over_sharers(new, v, p))
        return ortho, 1.0


def _sum_over_sharers(mine: torch.Tensor, like: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The sum of `mine` (laid out as `like`) over the ranks that share `param`'s matrices: the owner's value."""
    if not isinstance(like, DTensor) or not isinstance(param, DTensor):
        return mine
    placements = [pl if _keeps(param, pl) else Partial("sum") for pl in param.placements]
    summed = DTensor.from_local(mine, like.device_mesh, placements, shape=like.shape, stride=like.stride(),
                                run_check=False)
    return summed.redistribute(like.device_mesh, like.placements).to_local()


class NorMuonSpec(OptimizerSpec):
    name = "normuon"
    table = NorMuonConfig
    optimizer_class = NorMuon
    state_description = ("NorMuon momentum 1 x fp32 on its matrices (+1 fp32 per neuron), AdamW moments 2 x fp32 "
                         "on the rest")

    def build(self, model_parts: list[nn.Module], shared: SharedKeys, table: NorMuonConfig
              ) -> tuple[torch.optim.Optimizer, str]:
        groups = matrix_groups(unique_trainable(model_parts), shared,
                               dict(lr=table.lr, weight_decay=table.weight_decay, momentum=table.momentum,
                                    ns_steps=table.ns_steps, beta2=table.beta2, eps=shared.eps))
        return NorMuon(groups), f"{table.ns_steps} Newton-Schulz steps, per-neuron normalised; AdamW part foreach"

    def check(self, table: NorMuonConfig) -> None:
        check_matrix_keys(self.name, table.lr, table.weight_decay, table.momentum, table.ns_steps)
        if not 0 <= table.beta2 < 1:
            raise ConfigError(f"optim.normuon.beta2={table.beta2} must lie in [0, 1)", "e.g. 0.95")

    def state_bytes(self, numel: int, matrix_numel: int, matrix_gather: int) -> tuple[float, float]:
        # Muon's, plus one fp32 per neuron: at most 1/min(m, n) of the matrices (below 1% from width 128 on), so
        # counted as 1/128 of them; the normalisation works on the owner's whole fp32 update (one more copy)
        state, step = MuonSpec().state_bytes(numel, matrix_numel, matrix_gather)
        return state + FP32 * matrix_numel / 128, step + FP32 * matrix_gather

    def state_template(self, key: str, param: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if key == SECOND_MOMENT:
            return neuron_state(param).to(dtype)
        return super().state_template(key, param, shape, dtype)
