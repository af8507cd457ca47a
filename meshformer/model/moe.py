"""Mixture-of-experts feed-forward: a router sends each token to `experts_per_token` of `n_experts` experts;
shared experts see every token.

Plain single-device PyTorch. The experts' weights are stacked 3-D parameters (n_experts, in, out), so expert
parallelism can shard dim 0. Tokens are sorted by expert and run by one compute path (`moe_backend`): a loop over
each expert's contiguous slice, one padded batched matmul, or `torch._grouped_mm`; every path gives the same
result. Each forward records its load-balancing statistics (`MoEStats`, over the whole micro-batch) and hands its raw
balance terms ("moe/aux_loss", "moe/z_loss") to the objective (meshformer/loss/layer_terms.py: the objective weighs
them); `update_expert_bias` applies DeepSeek-V3's auxiliary-loss-free balancing after each optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.loss.layer_terms import LayerTerms
from meshformer.model.config import ModelConfig
from meshformer.model.sharded import local_part

BACKENDS = ("loop", "padded", "grouped_mm")


def is_moe_block(cfg: ModelConfig, index: int) -> bool:
    """Whether block `index` (from 0, within its stack) has an MoE feed-forward."""
    return cfg.is_moe(index)


@dataclass(frozen=True)
class MoEStats:
    """What one forward of an MoE layer measured over its whole micro-batch (every rank of its token group); detached,
    the losses unweighted."""

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
          groups_per_token: int = 1, group_score: str = "top2_sum", bias: torch.Tensor | None = None,
          scale: float = 1.0) -> Routing:
    """Top-k routing of fp32 `logits` (N, E). `bias` (E,) is added to the scores for choosing only, never for
    weighting (DeepSeek-V3). With groups > 1 each token first keeps its best `groups_per_token` groups of experts,
    a group scored by the sum of its best two experts (DeepSeek-V3; `group_score` "max": by its best one, DeepSeek-V2),
    then picks its k among those. `scale` multiplies
    the combine weights last (DeepSeek-V3's routed_scaling_factor)."""
    if score == "softmax":
        scores = logits.softmax(-1)
    else:
        scores = F.softplus(logits).sqrt() if score == "sqrt_softplus" else logits.sigmoid()
    choice = scores.detach() if bias is None else scores.detach() + bias
    if groups > 1:
        n, e = choice.shape
        grouped = choice.view(n, groups, e // groups)
        best = 1 if group_score == "max" else min(2, e // groups)
        per_group = grouped.topk(best, dim=-1).values.sum(-1)
        kept = torch.zeros(n, groups, dtype=torch.bool, device=logits.device)
        kept.scatter_(1, per_group.topk(groups_per_token, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // groups, dim=1), float("-inf"))
    experts = choice.topk(k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return Routing(experts, weights, scores)


# ---------------------------------------------------------------------------------------------------- compute


# The experts' biases (gate's or None, up's, down's), each shaped to add to its projection's rows; None: none
Biases = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None


def _ffn(x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, down: torch.Tensor, act: nn.Module,
         matmul, biases: Biases = None) -> torch.Tensor:
    """`act` as `layers.feed_forward_unit` builds it: of (gate, up) when there is a gate."""
    gate_bias, up_bias, down_bias = biases if biases is not None else (None, None, None)

    def project(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return matmul(h, w) if b is None else matmul(h, w) + b

    h = act(project(x, gate, gate_bias), project(x, up, up_bias)) if gate is not None else act(project(x, up, up_bias))
    return project(h, down, down_bias)


@torch.compiler.disable  # a loop over sizes read on the host: eager inside compiled code (a graph break; "auto"
# takes padded there)
def experts_loop(xs: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                 down: torch.Tensor, act: nn.Module, biases: Biases = None) -> torch.Tensor:
    """Each expert on its contiguous slice of the sorted tokens (the slice sizes are read on the host); `biases`
    stacked (E, width) like the weights."""
    sizes = counts.tolist()

    def each(t: torch.Tensor | None) -> list:
        # unbind: one gradient stack per weight in backward, where indexing would add E zero-filled full-size grads
        return [None] * len(sizes) if t is None else list(t.unbind(0))

    gate_bias, up_bias, down_bias = biases if biases is not None else (None, None, None)
    outs, start = [], 0
    for n, g, u, d, gb, ub, db in zip(sizes, each(gate), up.unbind(0), down.unbind(0), each(gate_bias),
                                      each(up_bias), each(down_bias), strict=True):
        if n:
            expert_biases = None if ub is None else (gb, ub, db)
            outs.append(_ffn(xs[start:start + n], g, u, d, act, torch.matmul, expert_biases))
            start += n
    if not outs:  # no rows (expert parallel): keep rows and weights in the graph, so the backward runs the same
        # exchanges and gradient reductions (of zeros) as on every other rank
        weights = sum(w.sum() for w in (gate, up, down, gate_bias, up_bias, down_bias) if w is not None)
        return xs.new_zeros(0, down.shape[-1]) + (xs.sum() + weights) * 0
    return torch.cat(outs)


def experts_padded(xs: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                   down: torch.Tensor, act: nn.Module, biases: Biases = None) -> torch.Tensor:
    """All experts in one batched matmul over (n_experts, most tokens of any expert, d); the padding rows are
    dropped (without biases they stay zero: every unit is 0 at 0)."""
    sizes = counts.to(xs.device)
    expert = torch.repeat_interleave(torch.arange(len(sizes), device=xs.device), sizes, output_size=xs.shape[0])
    row = torch.arange(xs.shape[0], device=xs.device) - (sizes.cumsum(0) - sizes)[expert]
    # the padded size, one host read; at least 2 rows, so that compiled code (inductor asks whether a bmm has a
    # single row) needs no guard on a value it cannot know
    longest = torch.sym_max(int(sizes.max()), 2) if len(sizes) else 0
    padded = xs.new_zeros(len(sizes), longest, xs.shape[1]).index_put((expert, row), xs)
    if biases is not None:  # (E, width) -> (E, 1, width): one row per expert, broadcast over its padded rows
        biases = tuple(None if b is None else b.unsqueeze(1) for b in biases)  # type: ignore[assignment]
    return _ffn(padded, gate, up, down, act, torch.bmm, biases)[expert, row]


def experts_grouped_mm(xs: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                       down: torch.Tensor, act: nn.Module, biases: Biases = None) -> torch.Tensor:
    """`torch._grouped_mm`: one kernel per projection over every expert's slice; the slice ends stay on the device
    (no host sync). Biases are gathered per row."""
    offsets = counts.cumsum(0).to(torch.int32)
    if biases is not None:
        expert = torch.repeat_interleave(torch.arange(len(counts), device=xs.device), counts.to(xs.device),
                                         output_size=xs.shape[0])
        biases = tuple(None if b is None else b.index_select(0, expert) for b in biases)  # type: ignore[assignment]

    def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, w, offs=offsets)

    return _ffn(xs, gate, up, down, act, matmul, biases)


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
    dtype); elsewhere the loop, on CPU about as fast as padded at tiny shapes and faster at larger ones, but padded
    under torch.compile (the loop's slice sizes are host values: a graph break per expert)."""
    if backend != "auto":
        return backend
    cuda = x.device.type == "cuda" and x.dtype == torch.bfloat16
    if cuda and grouped_mm_runs("cuda"):
        return "grouped_mm"
    return "padded" if torch.compiler.is_compiling() else "loop"


# ---------------------------------------------------------------------------------------------------- modules


class TokenGroup(Protocol):
    """The ranks holding other tokens of the same micro-batch (data-, context- and, under sequence parallel,
    tensor-parallel ranks of one pipeline stage). Parallel code supplies it through `Transformer.set_parallel_context`
    so that balance statistics are those of the whole micro-batch, whatever the layout."""

    sequence_shards: int  # ranks holding pieces of each sequence (context x tensor parallel)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` (detached) over every rank of the group."""
        ...

    def sum_within_sequences(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` (detached) over the ranks holding other pieces of this rank's sequences."""
        ...


class Router(nn.Module):
    """Linear scores (with a learned bias under model.moe.router_bias), computed in fp32; the `expert_bias` buffer
    steers selection only."""

    expert_bias: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.moe.n_experts, cfg.d_model))
        self.bias = nn.Parameter(torch.empty(cfg.moe.n_experts)) if cfg.moe.router_bias else None
        # Part of the model's state (checkpoints, final weights): trained by bias balancing, it changes the function
        self.register_buffer("expert_bias", torch.zeros(cfg.moe.n_experts))

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """After a meta build: the bias starts at zero."""
        self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class ExpertExchange(Protocol):
    """Expert parallelism (meshformer/parallel/expert_parallel.py): sends each expert's rows to the rank holding the
    expert, runs `compute` there on the rows sorted by local expert, and brings the results back in the rows' order."""

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor,
                 compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ...


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of `Experts`' parameters by name (those the config has), all n_experts experts stacked on dim 0."""
    e, d, f = cfg.moe.n_experts, cfg.d_model, cfg.expert_d_ff
    gated, biased = cfg.gated, cfg.moe.expert_linear_bias
    shapes: dict[str, tuple[int, ...]] = {"gate_proj": (e, d, f)} if gated else {}
    shapes |= {"up_proj": (e, d, f), "down_proj": (e, f, d)}
    if biased:
        shapes |= ({"gate_bias": (e, f)} if gated else {}) | {"up_bias": (e, f), "down_bias": (e, d)}
    return shapes


class Experts(nn.Module):
    """n_experts feed-forward networks, stacked: gate/up (E, d_model, width), down (E, width, d_model); with
    model.moe.expert_linear_bias their biases gate_bias/up_bias (E, width), down_bias (E,
                                                                                      d_model), split with the experts.

    `forward(xs, counts)` runs the token rows `xs`, sorted by expert, `counts[e]` of them for expert e; under expert
    parallelism through `exchange`, set by parallel code. A forward keeps no state between calls: torch.compile
    traces it whole, all-to-alls included."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        from meshformer.model.layers import feed_forward_unit  # layers builds this module

        shapes = expert_shapes(cfg)

        def optional(name: str) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(shapes[name])) if name in shapes else None

        self.gate_proj = optional("gate_proj")
        self.up_proj = nn.Parameter(torch.empty(shapes["up_proj"]))
        self.down_proj = nn.Parameter(torch.empty(shapes["down_proj"]))
        self.gate_bias = optional("gate_bias")
        self.up_bias = optional("up_bias")
        self.down_bias = optional("down_bias")
        self.act = feed_forward_unit(cfg)
        self.backend = cfg.moe.backend
        self.exchange: ExpertExchange | None = None  # None: every expert is here

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self._compute(xs, counts) if self.exchange is None else self.exchange(xs, counts, self._compute)

    def _compute(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The rows of this module's (local) experts."""
        dtype = xs.dtype  # under autocast the routed rows are cast once; the weights follow them
        gate = None if self.gate_proj is None else local_part(self.gate_proj).to(dtype)
        up, down = local_part(self.up_proj).to(dtype), local_part(self.down_proj).to(dtype)
        biases: Biases = None
        if self.up_bias is not None and self.down_bias is not None:
            biases = (None if self.gate_bias is None else local_part(self.gate_bias).to(dtype),
                      local_part(self.up_bias).to(dtype), local_part(self.down_bias).to(dtype))
        return COMPUTE[resolve_backend(self.backend, xs)](xs, counts, gate, up, down, self.act, biases)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,
                k: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, index // k if k > 1 else index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        rows = grad.index_select(0, inverse)
        if ctx.k > 1:
            rows = rows.view(inverse.numel() // ctx.k, ctx.k, grad.shape[1]).sum(1)  # -1: ambiguous at 0 rows
        return rows, None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, k: int = 1) -> torch.Tensor:
    """`x[index // k]` for a permutation `index` of the rows x would have with each repeated k times, `inverse` its
    inverse permutation. The backward gathers too (row i's gradient is the sum of its k rows at `inverse`), where
    indexing's backward would scatter-add, atomically or after a sort: on a GPU the permutation's largest cost."""
    return _GatherRows.apply(x, index, inverse, k)


class MoEFeedForward(nn.Module):
    """router -> top-k -> tokens sorted by expert -> experts -> weighted sum back per token (+ shared experts).

    Each forward hands its balance terms, "moe/aux_loss" and "moe/z_loss" (unweighted means over the micro-batch),
    to `loss_terms`, which adds them with the objective's weights times the step's scale (1 / forwards per optimizer
    step: the step optimises their mean over its micro-batches). Their statistics cover the whole micro-batch
    (every rank of `token_group`)."""

    tokens_this_step: torch.Tensor
    latest: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        from meshformer.model.layers import FeedForward  # layers builds this module

        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        shared_width = cfg.moe.n_shared_experts * cfg.expert_d_ff  # the shared experts as one wide FFN: same sum
        shared_cfg = replace(cfg, ffn=replace(cfg.ffn, d_ff=shared_width))
        self.shared_experts = FeedForward(shared_cfg) if shared_width else None
        # Qwen3-Next: the shared experts' output scaled by sigmoid(w . x) per token
        self.shared_expert_gate = (nn.Linear(cfg.d_model, 1, bias=False)
                                   if shared_width and cfg.moe.shared_expert_gate else None)
        self.token_group: TokenGroup | None = None  # set by Transformer.set_parallel_context; None: one process
        self.loss_terms = LayerTerms()  # the objective's weights of this layer's terms (meshformer/loss/layer_terms.py)
        self.counts_load = True  # off for forwards that are not training (a pipeline's shape inference)
        self.drops_tokens = True  # capacity_factor applies; off while generating (`dropless`)
        # Token-slots per expert over the training forwards since the last reset (every rank of the token group):
        # the load that auxiliary-loss-free balancing reads after each optimizer step.
        self.register_buffer("tokens_this_step", torch.zeros(cfg.moe.n_experts), persistent=False)
        # The latest training forward's sums over the token group, read by `last_stats`: routed token-slots per expert,
        # router probabilities per expert, logsumexp(logits)^2, kept token-slots, the aux loss's value. Forwards write
        # buffers in place, never Python attributes: a compiled block with recomputation admits no other side effect.
        self.register_buffer("latest", torch.zeros(2 * cfg.moe.n_experts + 3), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        self.tokens_this_step.zero_()
        self.latest.zero_()

    def term_values(self) -> dict[str, torch.Tensor]:
        """The latest training forward's balance terms by name, unweighted, for the objective's logged parts."""
        stats = self.last_stats
        return {"moe/aux_loss": stats.aux_loss, "moe/z_loss": stats.z_loss}

    @property
    def last_stats(self) -> MoEStats:
        """What the latest training forward measured over its whole micro-batch (zeros before the first)."""
        e, k = self.cfg.moe.n_experts, self.cfg.moe.experts_per_token
        latest = self.latest.detach()
        counts = latest[:e]
        slots = counts.sum()  # every token routes to k experts
        per_slot = 1 / slots.clamp(min=1)
        return MoEStats(tokens_per_expert=counts, aux_loss=latest[-1], z_loss=latest[2 * e] * k * per_slot,
                        dropped_fraction=(slots - latest[2 * e + 1]) * per_slot)

    def _route(self, flat: torch.Tensor, token_ids: torch.Tensor | None) -> tuple[torch.Tensor, Routing]:
        """The router's fp32 logits (N, E) and each token's experts and weights."""
        cfg = self.cfg
        logits = self.router(flat)
        return logits, route(logits, cfg.moe.experts_per_token, score=cfg.moe.router_score,
                             renormalize=cfg.moe.router_renormalize, groups=cfg.moe.router_groups,
                             groups_per_token=cfg.moe.router_groups_per_token, group_score=cfg.moe.router_group_score,
                             bias=self.router.expert_bias, scale=cfg.moe.router_scale)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids (B, T): x's tokens, for a router that reads them (`HashRoutedMoE`)."""
        cfg = self.cfg
        k, n_experts = cfg.moe.experts_per_token, cfg.moe.n_experts
        flat = x.reshape(-1, x.shape[-1])
        n = flat.shape[0]
        logits, routing = self._route(flat, token_ids)
        slots = routing.experts.reshape(-1)  # token-slot s = token * k + j
        order = torch.argsort(slots, stable=True)  # by expert, then by token
        routed = slots.new_zeros(n_experts).scatter_add_(0, slots, torch.ones_like(slots))  # bincount: a host sync
        counts = routed
        capped = cfg.moe.capacity_factor > 0 and self.drops_tokens
        if capped:  # each expert keeps its earliest tokens up to capacity (this rank's tokens)
            capacity = math.ceil(cfg.moe.capacity_factor * n * k / n_experts)
            rank = torch.arange(order.numel(), device=x.device) - (routed.cumsum(0) - routed)[slots[order]]
            order = order[rank < capacity]
            counts = routed.clamp(max=capacity)
        # dropless: `order` is a permutation of the token-slots. Compiled code with a capacity takes the dropping path
        # whatever was dropped: a branch on a routed size would break the graph
        dropless = not capped or (not torch.compiler.is_compiling() and order.numel() == n * k)
        if dropless:
            position = torch.empty_like(order).scatter_(0, order, torch.arange(n * k, device=x.device))
            out = self.experts(gather_rows(flat, order, position, k), counts)
            by_slot = gather_rows(out, position, order)  # each result back to its slot token * k + j
        else:  # some slots dropped for capacity: they stay zero
            out = self.experts(flat[order // k], counts)
            by_slot = out.new_zeros(n * k, out.shape[1]).index_copy(0, order, out)
        # each token's k results weighted and summed: no atomic scatter-add
        weights = routing.weights.unsqueeze(-1).to(by_slot.dtype)
        result = (by_slot.view(n, k, by_slot.shape[1]) * weights).sum(1).view_as(x)  # -1: ambiguous at n = 0
        result = self.loss_terms.add(result, self._balance(x, logits, routing, routed, counts))
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            result = result + shared
        return result

    def _balance(self, x: torch.Tensor, logits: torch.Tensor, routing: Routing, routed: torch.Tensor,
                 kept: torch.Tensor) -> dict[str, torch.Tensor]:
        """Record this forward's statistics (`latest`, `tokens_this_step`) and return its balance terms by name,
        unweighted. `routed`/`kept`: token-slots per expert before/after dropping for capacity.

        Every statistic is of the whole micro-batch: counts and sums are added over the token group first, and each
        rank's term is its tokens' share of the global one, so the terms summed over ranks (as gradients are) give
        exactly the single-process value. Every figure comes from device tensors: no host-to-device copy stalls the
        launch queue."""
        cfg, group = self.cfg, self.token_group
        k, n_experts = cfg.moe.experts_per_token, cfg.moe.n_experts
        scores = routing.scores  # (N, E); as probabilities per token: softmax scores already sum to 1
        probs = scores if cfg.moe.router_score == "softmax" else scores / scores.sum(-1, keepdim=True)
        prob_sum, lse_sq_sum = probs.sum(0), logits.logsumexp(-1).square().sum()
        local = torch.cat([routed.float(), prob_sum.detach(), lse_sq_sum.detach().view(1), kept.sum().float().view(1)])
        total = local if group is None else group.sum(local)
        counts = total[:n_experts]
        slots = counts.sum()  # every token routes to k experts
        tokens = slots / k
        z = lse_sq_sum / tokens
        if cfg.moe.aux_per_sequence and x.dim() == 3:
            aux, aux_value = self._aux_per_sequence(x, probs, routing.experts)
        else:
            fraction = counts / slots
            aux = torch.dot(fraction, prob_sum) * n_experts / tokens
            aux_value = torch.dot(fraction, total[n_experts:2 * n_experts]) * n_experts / tokens
        if self.training and torch.is_grad_enabled():
            self.latest.copy_(torch.cat([total, aux_value.detach().view(1)]))
            if self.counts_load and not _in_recomputation():
                self.tokens_this_step.add_(counts)
        return {"moe/aux_loss": aux, "moe/z_loss": z}

    def _aux_per_sequence(self, x: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The balance loss of each sequence, averaged over the micro-batch's sequences: (this rank's term, the
        global value)."""
        group, n_experts, k = self.token_group, self.cfg.moe.n_experts, self.cfg.moe.experts_per_token
        b, t = x.shape[0], x.shape[1]
        slots = F.one_hot(experts, n_experts).sum(1).float().view(b, t, n_experts).sum(1)  # (B, E)
        probs_by_sequence = probs.view(b, t, n_experts).sum(1)
        local = torch.cat([slots, probs_by_sequence.detach(), torch.full((b, 1), float(t), device=x.device)], 1)
        total = local if group is None else group.sum_within_sequences(local)
        counts, prob_sum, tokens = total[:, :n_experts], total[:, n_experts:2 * n_experts], total[:, -1:]
        sequences = torch.full((), float(b), device=x.device)  # filled on the device: no host-to-device copy
        if group is not None:
            sequences = group.sum(sequences) / group.sequence_shards
        fraction = counts / (tokens * k)
        aux = n_experts * (fraction * probs_by_sequence / tokens).sum() / sequences
        value = n_experts * (fraction * prob_sum / tokens).sum() / sequences
        return aux, value


# ---------------------------------------------------------------------------------------------------- balancing


def hash_table(vocab_size: int, n_experts: int, k: int) -> torch.Tensor:
    """A fresh model's token id -> k distinct experts table: the same on every rank and run (a fixed seed), each
    row an independent draw, so the experts share the vocabulary evenly on average."""
    generator = torch.Generator().manual_seed(0)
    return torch.rand(vocab_size, n_experts, generator=generator, device="cpu").argsort(dim=-1)[:, :k].contiguous()


class HashRoutedMoE(MoEFeedForward):
    """DeepSeek-V4's first MoE blocks: each token's experts are its token id's row of a fixed table (a buffer saved
    with the model, as `HashRouter` in model/compressed_attention.py); the router's sqrt-softplus scores of those
    experts, normalised to sum 1 and times moe.router_scale, weigh them."""

    experts_of_token: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.register_buffer("experts_of_token", torch.zeros(cfg.vocab_size, cfg.moe.experts_per_token,
                                                             dtype=torch.long))
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """After a meta build: the fixed table (a checkpoint's, imported or resumed, is loaded over it)."""
        super().reset_buffers()
        m = self.cfg.moe
        if not self.experts_of_token.is_meta:
            self.experts_of_token.copy_(hash_table(self.cfg.vocab_size, m.n_experts, m.experts_per_token))

    def _route(self, flat: torch.Tensor, token_ids: torch.Tensor | None) -> tuple[torch.Tensor, Routing]:
        from meshformer.model.compressed_attention import sqrt_softplus

        if token_ids is None or token_ids.numel() != flat.shape[0]:
            raise ValueError("hash-routed MoE blocks need each of their tokens' ids (token_ids, one per row of x)")
        logits = self.router(flat)
        scores = sqrt_softplus(logits)
        experts = self.experts_of_token[token_ids.reshape(-1)]
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.cfg.moe.router_scale
        return logits, Routing(experts, weights, scores)


def _in_recomputation() -> bool:
    """Whether this forward reruns inside a backward (activation recomputation): its load is counted already. Never in
    compiled code: a compiled block recomputes inside its compiled backward, which replays no buffer update (and
    dynamo cannot trace the check)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoEFeedForward]]:
    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            yield name, module


@contextmanager
def loads_not_counted(layers: Iterable[MoEFeedForward]) -> Iterator[None]:
    """Forwards inside this block add nothing to the layers' step loads."""
    layers = list(layers)
    for layer in layers:
        layer.counts_load = False
    try:
        yield
    finally:
        for layer in layers:
            layer.counts_load = True


@contextmanager
def dropless(layers: Iterable[MoEFeedForward]) -> Iterator[None]:
    """Forwards inside this block drop no token for capacity (model.moe.capacity_factor is ignored): what a token
    gets from the experts depends on it alone, not on the other tokens of the batch, which differ with the batch's
    prompts and with a KV cache (one new token per forward instead of the whole sequence)."""
    layers = list(layers)
    for layer in layers:
        layer.drops_tokens = False
    try:
        yield
    finally:
        for layer in layers:
            layer.drops_tokens = True


@torch.no_grad()
def update_expert_bias(layers: Iterable[MoEFeedForward], applied: torch.Tensor | float = 1.0) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: bias += rate * sign(mean load - load)
    per layer, from the step's token-slots per expert over every rank (`tokens_this_step`), which restart at zero.
    `applied` 0 (the step's update was skipped, e.g. an inf/nan gradient norm): the bias stays too; a device tensor
    is read without a host sync."""
    for layer in layers:
        rate = layer.cfg.moe.router_bias_update_rate
        load = layer.tokens_this_step
        if rate > 0:
            layer.router.expert_bias += rate * applied * torch.sign(load.mean() - load)
        load.zero_()
