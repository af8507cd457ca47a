"""A compact nanoGPT-style GPT and training step: the reference `vs_nanogpt.py` measures our Trainer against.

Written for this benchmark in the style of Karpathy's nanoGPT as shipped: pre-norm GPT-2 blocks (LayerNorm
with bias, causal SDPA, exact GELU MLP), learned positions, tied head, logits for every position, mean
cross-entropy on them, gradient clipping, AdamW with decay on matrices (fused on CUDA only, as nanoGPT does),
whole-model `torch.compile` when compiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTShape:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.c_attn = nn.Linear(s.n_embd, 3 * s.n_embd, bias=s.bias)
        self.c_proj = nn.Linear(s.n_embd, s.n_embd, bias=s.bias)
        self.n_head = s.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(s.n_embd, bias=s.bias)
        self.attn = CausalSelfAttention(s)
        self.ln_2 = nn.LayerNorm(s.n_embd, bias=s.bias)
        self.c_fc = nn.Linear(s.n_embd, 4 * s.n_embd, bias=s.bias)
        self.c_proj = nn.Linear(4 * s.n_embd, s.n_embd, bias=s.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.wte = nn.Embedding(s.vocab_size, s.n_embd)
        self.wpe = nn.Embedding(s.block_size, s.n_embd)
        self.h = nn.ModuleList(Block(s) for _ in range(s.n_layer))
        self.ln_f = nn.LayerNorm(s.n_embd, bias=s.bias)
        self.lm_head = nn.Linear(s.n_embd, s.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * s.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def configure_optimizer(model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float,
                        device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device.type == "cuda")


class ReferenceStep:
    """One nanoGPT training iteration: forward under autocast, backward, clip, step, zero grads."""

    def __init__(self, shape: GPTShape, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 grad_clip: float, dtype: torch.dtype | None, device: torch.device, compile: bool) -> None:
        self.model = GPT(shape).to(device)
        self.optimizer = configure_optimizer(self.model, lr, betas, weight_decay, device)
        self.forward = torch.compile(self.model) if compile else self.model
        self.grad_clip, self.dtype, self.device = grad_clip, dtype, device

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            loss = self.forward(x, y)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
