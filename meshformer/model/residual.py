"""The residual: how a block's branches (token mixer, cross-attention, channel mixer) join the stream between blocks.

A kind (`ResidualKind`, chosen by `[model.residual] kind`) builds one `Residual` per branch, which the block calls as
`residual(x, norm, out_norm, fn, *args)`, and says how a stack's input enters the stream and how the stream leaves it
before the stack's final norm. The block and the stacks name no kind.

- "plain": one stream of width d_model; x + drop(f(norm(x))) with the norm where model.norm.position puts it. It
  holds no parameters.
- "mhc": manifold-constrained hyper-connections (DeepSeek-V4): `streams` copies of the stream, (B, T, n, D). Each
  branch reads a mix of them (`pre`), writes its output into each with its own weight (`post`) and carries them over
  through an n x n matrix projected by Sinkhorn iterations onto the doubly-stochastic ones, so that mixing neither
  grows nor shrinks the streams over a deep stack. The weights come from the normalised streams themselves through
  one linear map; they run in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.model import tp_styles
from meshformer.model.config import ModelConfig

Branch = Callable[..., torch.Tensor]
InitFn = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def autocast_once(h: torch.Tensor) -> torch.Tensor:
    """Cast a branch input to the autocast dtype once, where Q/K/V (or gate/up) projections would each cast it.

    Same forward values; in backward their input gradients are summed in the autocast dtype before the one
    cast back. A no-op without autocast.
    """
    device = h.device.type
    if h.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return h.to(torch.get_autocast_dtype(device))
    return h


class Residual(nn.Module):
    """One branch's join: `forward(x, norm, out_norm, fn, *args, **kwargs)` is the stream after the branch `fn`,
    with the block's `norm` (and a sandwich's `out_norm`) where the kind puts them."""

    def forward(self, x: torch.Tensor, norm: nn.Module, out_norm: nn.Module | None, fn: Branch, *args,
                **kwargs) -> torch.Tensor:
        raise NotImplementedError


class PlainResidual(Residual):
    """Pre-norm: x + drop(f(norm(x))).  Post-norm (the original paper): norm(x + drop(f(x))).
    Post-sublayer (OLMo 2): x + drop(norm(f(x))).  Sandwich (Gemma): x + drop(out_norm(f(norm(x))))."""

    def __init__(self, cfg: ModelConfig, position: str | None = None) -> None:
        super().__init__()
        self.position = position or cfg.norm.position  # the block's (model.norm.by_kind may set it per kind)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, norm: nn.Module, out_norm: nn.Module | None, fn: Branch, *args,
                **kwargs) -> torch.Tensor:
        if self.position == "post":
            return norm(x + F.dropout(fn(autocast_once(x), *args, **kwargs), self.dropout, self.training))
        if self.position == "post_sublayer":
            return x + F.dropout(norm(fn(autocast_once(x), *args, **kwargs)), self.dropout, self.training)
        out = fn(autocast_once(norm(x)), *args, **kwargs)
        if out_norm is not None:
            out = out_norm(out)
        return x + F.dropout(out, self.dropout, self.training)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def sinkhorn(logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """Softmax over the last axis, then alternate column and row normalisation: close to doubly stochastic."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class _TokenShare:
    """A module whose parameters every token reads: under tensor parallel (a slice of the tokens per rank) the
    `token_share` style sets `read_parameter` to the local tensor whose gradient is summed over the ranks."""

    def read_parameter(self, p: torch.Tensor) -> torch.Tensor:
        return p


class HyperConnection(_TokenShare, Residual):
    """One branch of mHC over (B, T, n, D) streams: weights (pre, post, comb) from the streams, the branch on the pre
    mix, then post x output + comb^T streams."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        r = cfg.residual
        n = self.streams = r.streams
        self.iterations, self.eps, self.norm_eps = r.sinkhorn_iters, r.eps, cfg.norm.eps
        self.dropout = cfg.dropout
        self.weight = nn.Parameter(torch.empty((2 + n) * n, n * cfg.d_model))  # -> pre (n), post (n), comb (n x n)
        self.bias = nn.Parameter(torch.empty((2 + n) * n))
        self.gain = nn.Parameter(torch.empty(3))  # one scale each for pre, post and comb

    def forward(self, x: torch.Tensor, norm: nn.Module, out_norm: nn.Module | None, fn: Branch, *args,
                **kwargs) -> torch.Tensor:
        n, dtype, read = self.streams, x.dtype, self.read_parameter
        mixes = F.linear(_rms(x.flatten(2).float(), self.norm_eps), read(self.weight).float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        bias = read(self.bias).float()
        pre_b, post_b, comb_b = bias.split([n, n, n * n])
        gain = read(self.gain).float()
        pre = torch.sigmoid(pre_w * gain[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * gain[1] + post_b)
        comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * gain[2] + comb_b.view(n, n), self.iterations, self.eps)
        collapsed = (pre.unsqueeze(-1) * x).sum(dim=2).to(dtype)
        out = fn(autocast_once(norm(collapsed)), *args, **kwargs)
        if out_norm is not None:
            out = out_norm(out)
        out = F.dropout(out, self.dropout, self.training)
        # stream k takes sum_j comb[j, k] * stream j: the transpose (Sinkhorn's result is not symmetric)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ x


class HyperMerge(_TokenShare, nn.Module):
    """The end of a stack under mHC: the streams' weighted sum (weights from the streams, as a branch's `pre`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.residual.streams
        self.eps, self.norm_eps = cfg.residual.eps, cfg.norm.eps
        self.weight = nn.Parameter(torch.empty(n, n * cfg.d_model))
        self.bias = nn.Parameter(torch.empty(n))
        self.gain = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        read = self.read_parameter
        mixes = F.linear(_rms(x.flatten(2).float(), self.norm_eps), read(self.weight).float())
        pre = torch.sigmoid(mixes * read(self.gain).float() + read(self.bias).float()) + self.eps
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


class ResidualKind:
    """What a residual scheme declares: its branch joins, how a stack's input enters and leaves the stream, its
    parameters and their initialisation."""

    name: ClassVar[str]
    # the tensor-parallel style of its branch joins and merges (None: they hold no parameters)
    tp_style: ClassVar[str | None] = None

    def branch(self, cfg: ModelConfig, position: str | None = None) -> Residual:
        """A branch join; position: the block's norm position where it differs from model.norm.position."""
        raise NotImplementedError

    def enter(self, cfg: ModelConfig, h: torch.Tensor) -> torch.Tensor:
        """The stream of a stack's embedded (B, T, D) input."""
        return h

    def merge(self, cfg: ModelConfig) -> nn.Module | None:
        """The module turning the stream back into (B, T, D) before the stack's final norm (None: it is already)."""
        return None

    def params(self, cfg: ModelConfig, branches: int, stacks: int) -> int:
        """Parameters of `branches` branch joins and `stacks` merges."""
        return 0

    def flops(self, cfg: ModelConfig, tokens: int) -> int:
        """Forward FLOPs of one branch join over `tokens` positions (beyond the plain residual's add)."""
        return 0

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        """The initialisation of a join's or merge's parameter `name` (inside it)."""
        return None


class Plain(ResidualKind):
    name = "plain"

    def branch(self, cfg: ModelConfig, position: str | None = None) -> Residual:
        return PlainResidual(cfg, position)


class ManifoldHyperConnections(ResidualKind):
    name = "mhc"
    tp_style = tp_styles.TOKEN_SHARE

    def branch(self, cfg: ModelConfig, position: str | None = None) -> Residual:
        return HyperConnection(cfg)  # pre-norm only (config checks refuse the others)

    def enter(self, cfg: ModelConfig, h: torch.Tensor) -> torch.Tensor:
        return h.unsqueeze(2).expand(-1, -1, cfg.residual.streams, -1).contiguous()

    def merge(self, cfg: ModelConfig) -> nn.Module | None:
        return HyperMerge(cfg)

    def params(self, cfg: ModelConfig, branches: int, stacks: int) -> int:
        n, d = cfg.residual.streams, cfg.d_model
        return branches * ((2 + n) * n * (n * d + 1) + 3) + stacks * (n * (n * d + 1) + 1)

    def flops(self, cfg: ModelConfig, tokens: int) -> int:
        n, d = cfg.residual.streams, cfg.d_model
        # the weights' projection, the pre mix, post x output and the n x n mix of the streams
        return tokens * (2 * (2 + n) * n * n * d + 2 * n * d + 2 * n * d + 2 * n * n * d)

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        std = cfg.init.std
        rules: dict[str, InitFn] = {"weight": lambda t, g: nn.init.normal_(t, std=std, generator=g),
                                    "bias": lambda t, g: t.zero_(), "gain": lambda t, g: t.fill_(1.0)}
        return rules.get(name)


RESIDUALS: dict[str, ResidualKind] = {kind.name: kind for kind in (Plain(), ManifoldHyperConnections())}


def residual_kind(cfg: ModelConfig) -> ResidualKind:
    return RESIDUALS[cfg.residual.kind]


__all__ = ["RESIDUALS", "HyperConnection", "HyperMerge", "PlainResidual", "Residual", "ResidualKind", "autocast_once",
           "residual_kind", "sinkhorn"]
