"""Mixture-of-experts feed-forward: a router sends each token to `experts_per_token` of `n_experts` experts;
shared experts see every token.

Plain single-device PyTorch. The experts' weights are stacked 3-D parameters (n_experts, in, out), so expert
parallelism can shard dim 0. Tokens are sorted by expert and run by one compute path (`moe_backend`): a loop over
each expert's contiguous slice, one padded batched matmul, or `torch._grouped_mm`; every path gives the same
result. Each forward records its load-balancing quantities (`MoEStats`) on the layer: `balance_loss` turns them
into the objective's auxiliary terms, `update_expert_bias` applies DeepSeek-V3's auxiliary-loss-free balancing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.model.config import ModelConfig

BACKENDS = ("loop", "padded", "grouped_mm")


def is_moe_block(cfg: ModelConfig, index: int) -> bool:
    """Whether block `index` (from 0, within its stack) has an MoE feed-forward."""
    return cfg.n_experts > 0 and index >= cfg.moe_first_dense and (index + 1) % cfg.moe_every == 0


@dataclass(frozen=True)
class MoEStats:
    """What one forward of an MoE layer measured. The losses are unweighted and carry gradients; the rest is
    detached."""

    tokens_per_expert: torch.Tensor  # (n_experts,) routed token-slots per expert, before any dropping
    aux_loss: torch.Tensor  # Switch/GShard balance loss: n_experts * sum_i fraction_i * mean_score_i
    z_loss: torch.Tensor  # mean over tokens of logsumexp(router logits)^2
    dropped_fraction: torch.Tensor  # token-slots dropped for capacity / all token-slots


@dataclass(frozen=True)
class Routing:
    experts: torch.Tensor  # (N, k) chosen experts of each token
    weights: torch.Tensor  # (N, k) fp32 combine weights
    scores: torch.Tensor  # (N, E) fp32 softmax or sigmoid scores


def route(logits: torch.Tensor, k: int, *, score: str = "softmax", renormalize: bool = True, groups: int = 1,
          groups_per_token: int = 1, bias: torch.Tensor | None = None) -> Routing:
    """Top-k routing of fp32 `logits` (N, E). `bias` (E,) is added to the scores for choosing only, never for
    weighting (DeepSeek-V3). With groups > 1 each token first keeps its best `groups_per_token` groups of experts,
    a group scored by the sum of its best two experts (DeepSeek-V3), then picks its k among those."""
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    choice = scores.detach() if bias is None else scores.detach() + bias
    if groups > 1:
        n, e = choice.shape
        grouped = choice.view(n, groups, e // groups)
        group_score = grouped.topk(min(2, e // groups), dim=-1).values.sum(-1)
        kept = torch.zeros(n, groups, dtype=torch.bool, device=logits.device)
        kept.scatter_(1, group_score.topk(groups_per_token, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // groups, dim=1), float("-inf"))
    experts = choice.topk(k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return Routing(experts, weights, scores)


def balance_aux_loss(scores: torch.Tensor, experts: torch.Tensor, sequences: int = 1) -> torch.Tensor:
    """n_experts * sum_i f_i * P_i (Switch Transformer), f_i the fraction of token-slots routed to expert i and P_i
    the mean score of expert i (scores normalised per token); with sequences > 1 per sequence, then averaged."""
    n, e = scores.shape
    probs = scores / scores.sum(-1, keepdim=True)
    one_hot = F.one_hot(experts, e).sum(1).float()  # (N, E) slots per token and expert
    fraction = one_hot.view(sequences, n // sequences, e).mean(1) / experts.shape[1]
    mean_score = probs.view(sequences, n // sequences, e).mean(1)
    return e * (fraction * mean_score).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.logsumexp(-1).square().mean()


# ---------------------------------------------------------------------------------------------------- compute


def _ffn(x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, down: torch.Tensor, act: nn.Module,
         matmul) -> torch.Tensor:
    h = act(matmul(x, gate)) * matmul(x, up) if gate is not None else act(matmul(x, up))
    return matmul(h, down)


def experts_loop(xs: torch.Tensor, counts: list[int], gate: torch.Tensor | None, up: torch.Tensor,
                 down: torch.Tensor, act: nn.Module) -> torch.Tensor:
    """Each expert on its contiguous slice of the sorted tokens."""
    # unbind: one gradient stack per weight in backward, where indexing would add E zero-filled full-size grads
    gates = [None] * len(counts) if gate is None else gate.unbind(0)
    outs, start = [], 0
    for n, g, u, d in zip(counts, gates, up.unbind(0), down.unbind(0), strict=True):
        if n:
            outs.append(_ffn(xs[start:start + n], g, u, d, act, torch.matmul))
            start += n
    return torch.cat(outs) if outs else xs.new_zeros(0, down.shape[-1])


def experts_padded(xs: torch.Tensor, counts: list[int], gate: torch.Tensor | None, up: torch.Tensor,
                   down: torch.Tensor, act: nn.Module) -> torch.Tensor:
    """All experts in one batched matmul over (n_experts, most tokens of any expert, d); the zero padding rows
    stay zero (no biases, act(0) = 0) and are dropped."""
    sizes = torch.tensor(counts, device=xs.device)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=xs.device), sizes)
    row = torch.arange(xs.shape[0], device=xs.device) - (sizes.cumsum(0) - sizes)[expert]
    padded = xs.new_zeros(len(counts), max(counts, default=0), xs.shape[1]).index_put((expert, row), xs)
    return _ffn(padded, gate, up, down, act, torch.bmm)[expert, row]


def experts_grouped_mm(xs: torch.Tensor, counts: list[int], gate: torch.Tensor | None, up: torch.Tensor,
                       down: torch.Tensor, act: nn.Module) -> torch.Tensor:
    """`torch._grouped_mm`: one kernel per projection over every expert's slice."""
    offsets = torch.tensor(counts, device=xs.device).cumsum(0).to(torch.int32)

    def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, w, offs=offsets)

    return _ffn(xs, gate, up, down, act, matmul)


COMPUTE = {"loop": experts_loop, "padded": experts_padded, "grouped_mm": experts_grouped_mm}


@cache
def grouped_mm_runs(device_type: str) -> bool:
    """Whether `torch._grouped_mm` exists and runs here (CUDA: sm90 and newer)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    try:
        x, w = torch.ones(2, 8, device=device_type), torch.ones(1, 8, 8, device=device_type)
        torch._grouped_mm(x, w, offs=torch.tensor([2], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """`moe_backend` with "auto" resolved for tokens `x`: grouped_mm for bf16 on CUDA where it runs (its kernel's
    dtype); elsewhere the loop, on CPU about as fast as padded at tiny shapes and faster at larger ones."""
    if backend != "auto":
        return backend
    cuda = x.device.type == "cuda" and x.dtype == torch.bfloat16
    return "grouped_mm" if cuda and grouped_mm_runs("cuda") else "loop"


# ---------------------------------------------------------------------------------------------------- modules


class Router(nn.Module):
    """Linear scores without bias, computed in fp32; `expert_bias` steers selection only."""

    expert_bias: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))
        # Not in state_dict yet: checkpoints hold parameters only; saving the bias comes with the training hook
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """After a meta build: the bias starts at zero."""
        self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class Experts(nn.Module):
    """n_experts feed-forward networks without biases, stacked: gate/up (E, d_model, width), down (E, width,
    d_model)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_d_ff
        self.gate_proj = nn.Parameter(torch.empty(e, d, f)) if cfg.activation == "swiglu" else None
        self.up_proj = nn.Parameter(torch.empty(e, d, f))
        self.down_proj = nn.Parameter(torch.empty(e, f, d))


class MoEFeedForward(nn.Module):
    """router -> top-k -> tokens sorted by expert -> experts -> weighted sum back per token (+ shared experts)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        from meshformer.model.layers import FeedForward, activation_fn  # layers builds this module

        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.act = activation_fn(cfg.activation)
        shared_width = cfg.n_shared_experts * cfg.expert_d_ff  # the shared experts as one wide FFN: same sum
        self.shared_experts = FeedForward(replace(cfg, d_ff=shared_width)) if shared_width else None
        self.last_stats: MoEStats | None = None  # the latest forward's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        k, n_experts = cfg.experts_per_token, cfg.n_experts
        flat = x.reshape(-1, x.shape[-1])
        n = flat.shape[0]
        logits = self.router(flat)
        routing = route(logits, k, score=cfg.router_score, renormalize=cfg.router_renormalize,
                        groups=cfg.router_groups, groups_per_token=cfg.router_groups_per_token,
                        bias=self.router.expert_bias)
        slots = routing.experts.reshape(-1)  # token-slot s = token * k + j
        order = torch.argsort(slots, stable=True)  # by expert, then by token
        routed = torch.bincount(slots, minlength=n_experts)
        counts = routed
        if cfg.capacity_factor > 0:  # each expert keeps its earliest tokens up to capacity
            capacity = math.ceil(cfg.capacity_factor * n * k / n_experts)
            rank = torch.arange(order.numel(), device=x.device) - (routed.cumsum(0) - routed)[slots[order]]
            order = order[rank < capacity]
            counts = routed.clamp(max=capacity)
        tokens = order // k
        experts = self.experts
        out = COMPUTE[resolve_backend(cfg.moe_backend, flat)](
            flat[tokens], counts.tolist(), None if experts.gate_proj is None else experts.gate_proj.to(flat.dtype),
            experts.up_proj.to(flat.dtype), experts.down_proj.to(flat.dtype), self.act)  # autocast cast x once
        weights = routing.weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        combined = flat.new_zeros(n, flat.shape[1]).index_add(0, tokens, out * weights)
        sequences = x.shape[0] if cfg.moe_aux_per_sequence and x.dim() == 3 else 1
        self.last_stats = MoEStats(
            tokens_per_expert=routed.detach().float(),
            aux_loss=balance_aux_loss(routing.scores, routing.experts, sequences),
            z_loss=z_loss(logits),
            dropped_fraction=(1 - order.numel() / slots.numel()) * torch.ones((), device=x.device),
        )
        result = combined.view_as(x)
        if self.shared_experts is not None:
            result = result + self.shared_experts(x)
        return result


# ---------------------------------------------------------------------------------------------------- balancing


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoEFeedForward]]:
    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            yield name, module


def balance_loss(parts: Iterable[nn.Module]) -> torch.Tensor | None:
    """moe_aux_loss * aux + router_z_loss * z summed over the MoE layers' latest forward (None: nothing to add).

    A per-micro-batch mean: the caller weights it by the micro-batch's share of the step's tokens."""
    total: torch.Tensor | None = None
    for part in parts:
        for _, layer in moe_layers(part):
            cfg, stats = layer.cfg, layer.last_stats
            if stats is None or (cfg.moe_aux_loss == 0 and cfg.router_z_loss == 0):
                continue
            term = cfg.moe_aux_loss * stats.aux_loss + cfg.router_z_loss * stats.z_loss
            total = term if total is None else total + term
    return total


def expert_loads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each MoE layer's tokens per expert in its latest forward, by module name."""
    return {name: layer.last_stats.tokens_per_expert for name, layer in moe_layers(model)
            if layer.last_stats is not None}


@torch.no_grad()
def update_expert_bias(model: nn.Module, loads: Mapping[str, torch.Tensor]) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: bias += rate * sign(mean load - load), per layer in `loads`
    (the step's tokens per expert; summed over ranks by the caller)."""
    for name, layer in moe_layers(model):
        rate = layer.cfg.router_bias_update_rate
        if rate > 0 and name in loads:
            load = loads[name].to(layer.router.expert_bias)
            layer.router.expert_bias += rate * torch.sign(load.mean() - load)
