"""Activation bytes of our blocks, per micro-batch, from what their autograd graph actually keeps.

A block's norms, residual and dropout are counted here; what its token and channel mixers keep, each mixer's kind
declares (model/components/: `saved_bytes`, `selective_bytes`, `backward_bytes`). For the built-in kinds, read off
`torch.autograd.graph.saved_tensors_hooks` on our `TransformerBlock` (pre-norm; b = micro-batch, s = sequence,
h = d_model, f = d_ff, a = activation bytes, t = tensor-parallel size; with t > 1 the residual stream is
sequence-parallel, s/t, and each branch works on the all-gathered full sequence; under context parallel s is this
rank's share of the sequence, and self-attention runs once per piece it holds, against every key up to the piece's
end):
- each norm keeps its input (RMSNorm a second (b, s, h) tensor) and fp32 statistics, and the linear after it
  keeps the (gathered) normalised input: with sequence parallel that copy is full length, not s/t;
- SDPA (CPU flash, CUDA flash / memory-efficient) keeps q, k, v (GQA: k and v repeated to every head), its
  output and an fp32 log-sum-exp, and a mask tensor where there is one (padding, a sliding window, packed
  documents, cross-attention), converted to the activation dtype: (b, 1, s, s) per layer; the math backend
  keeps the fp32 softmax (b, heads, s, s) instead; the blockwise CPU kernel
  (`meshformer.model.blockwise_attention`) the probabilities of its query blocks;
- SwiGLU keeps gate, up, silu(gate) and their product; GELU / ReLU keep the input and output of the activation;
- dropout keeps a one-byte mask per element.
- a mixture-of-experts feed-forward (model/moe.py, on this rank's N = b s/t tokens: sequence parallel routes
  locally) keeps its norm, the router's fp32 input, the fp32 scores (N x E) and, with a balance loss, the fp32
  logits; the top-k and sort indices; the rows its experts receive (R x h) and their activations (R x f_e, the
  same factor as the dense feed-forward); the N k expert outputs and weights the combine multiplies; shared experts
  like a dense feed-forward of width n_shared x f_e. R, the rows this rank's experts receive (`moe_rows`): N k
  without expert parallelism (however unbalanced, the rank runs all its tokens' slots); under ep, the balanced
  N k times `moe_imbalance` (default MOE_IMBALANCE), capped by the dropless worst case, every token of the ep group
  sending min(k, E / ep) slots here (ep N min(k, E/ep)); with `capacity_factor` c > 0, exactly the capacity
  bound: E ceil(c N k / E) rows (each source rank sends each expert at most its capacity).
This is Korthikanti et al.'s (2022) accounting, 34 sbh + 5 a s^2 b per layer in their GPT, redone for these
blocks. Selective recomputation keeps what our policy saves (`meshformer.parallel.recompute`): matmul outputs,
the attention kernel's outputs and tensor-parallel reduce-scatters, plus the block input; full recomputation
keeps only the block input, and a block's backward first rebuilds its whole activation set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshformer.config import Config, ModelConfig
from meshformer.loss.fused import default_chunk_rows
from meshformer.model.components import ChannelMixer, TokenMixer, channel_mixer, cross_mixer, token_mixer
from meshformer.model.components.attention import uses_math_attention
from meshformer.model.components.base import FP32, INDEX
from meshformer.model.components.mixture_of_experts import moe_rows
from meshformer.parallel.kernels import runs_blockwise_attention
from meshformer.planner.assumptions import MOE_IMBALANCE


@dataclass(frozen=True)
class ActivationShape:
    batch: int  # sequences in one (pipeline) micro-batch
    seq: int  # this rank's tokens of each sequence (under context parallel, its two pieces)
    tp: int
    bytes: int  # element size of matmul/attention activations: 2 under bf16 (autocast or FSDP params), else 4
    residual_bytes: int  # element size of the residual stream: fp32 under autocast (fp32 weights), else `bytes`
    blockwise: bool = False  # attention runs the blockwise CPU kernel (keeps probabilities, not a log-sum-exp)
    cp: int = 1  # context-parallel ranks sharing each sequence
    masked: bool = False  # self-attention gets a mask tensor (see `self_attention_masked`)
    ep: int = 1  # expert-parallel ranks sharing each MoE layer's experts
    moe_imbalance: float = MOE_IMBALANCE  # received rows over the balanced load, under expert parallelism
    experts_loop: bool = False  # experts run one at a time (`moe_backend` loop), so back-propagate one at a time
    ulysses: bool = False  # context parallel by Ulysses (parallel.cp_method): head shards over whole sequences


def self_attention_masked(cfg: Config) -> bool:
    """Whether self-attention runs with a mask tensor rather than none or `is_causal`: the padded batches of every
    objective but packed causal LM, sliding windows, packed-document masks."""
    m = cfg.model
    return cfg.objective != "causal" or m.attention.window is not None or m.attention.document_mask


def activation_shape(cfg: Config, batch: int, tp: int, fsdp: bool, *, device_type: str = "cuda",
                     compiled: bool = False, cp: int = 1, ep: int = 1,
                     moe_imbalance: float = MOE_IMBALANCE) -> ActivationShape:
    bf16_params = fsdp and cfg.parallel.mixed_precision_param == "bf16"
    a = 2 if bf16_params or cfg.train.dtype == "bf16" else 4
    # moe_backend "auto" takes grouped_mm for bf16 on CUDA (sm90+: what the planner plans for), the loop elsewhere
    backend = cfg.model.moe.backend
    loop = backend == "loop" or (backend == "auto" and not (device_type == "cuda" and a == 2))
    return ActivationShape(batch, cfg.data.seq_len // cp, tp, a, 2 if bf16_params else 4,
                           runs_blockwise_attention(cfg, device_type, compiled), cp, self_attention_masked(cfg), ep,
                           moe_imbalance, loop, cp > 1 and cfg.parallel.cp_method == "ulysses")


def _norm(m: ModelConfig, x: ActivationShape, s_local: int) -> float:
    """A norm's saved input and statistics (RMSNorm upcasts: an fp32 input and an fp32 normalised copy)."""
    rows = x.batch * s_local
    if m.norm.kind == "rmsnorm":
        return rows * (2 * m.d_model + 1) * FP32
    return rows * (m.d_model * x.residual_bytes + 2 * FP32)


def _mixers(m: ModelConfig, index: int, cross: bool) -> tuple[TokenMixer, TokenMixer | None, ChannelMixer]:
    """Block `index`'s token mixer, cross-attention (a cross-attending stack's) and channel mixer."""
    return token_mixer(m, index), cross_mixer() if cross else None, channel_mixer(m, index)


def block_saved(m: ModelConfig, x: ActivationShape, *, cross: bool = False, memory_len: int = 0,
                causal: bool = True, index: int = 0) -> float:
    """Bytes block `index` of a stack keeps from forward to backward without recomputation: each branch's norm
    (and the sandwich's output norm), what its mixer declares, its dropout mask."""
    s_local = x.seq // x.tp if x.tp > 1 else x.seq
    tokens, cross_attention, channel = _mixers(m, index, cross)
    out_norms = _norm(m, x, s_local) if m.norm.position == "sandwich" else 0.0  # each branch's output norm
    total = 0.0
    for mixer in (tokens, cross_attention, channel) if cross_attention else (tokens, channel):
        if mixer.empty:  # `none`: no branch, so no norm or dropout mask either
            continue
        total += _norm(m, x, s_local) + out_norms
        total += (mixer.saved_bytes(m, x) if isinstance(mixer, ChannelMixer)
                  else mixer.saved_bytes(m, x, memory_len=memory_len, causal=causal))
        if m.dropout > 0:
            total += x.batch * s_local * m.d_model
    return total


def block_selective(m: ModelConfig, x: ActivationShape, *, cross: bool = False, memory_len: int = 0,
                    causal: bool = True, index: int = 0) -> float:
    """Bytes block `index` keeps under our selective policy: its input and what its mixers declare."""
    s_local = x.seq // x.tp if x.tp > 1 else x.seq
    tokens, cross_attention, channel = _mixers(m, index, cross)
    total: float = x.batch * s_local * m.d_model * x.residual_bytes  # the checkpointed block's input
    for mixer in (tokens, cross_attention) if cross_attention else (tokens,):
        total += mixer.selective_bytes(m, x, memory_len=memory_len, causal=causal)
    return total + channel.selective_bytes(m, x)


def block_input(m: ModelConfig, x: ActivationShape) -> float:
    s_local = x.seq // x.tp if x.tp > 1 else x.seq
    return x.batch * s_local * m.d_model * x.residual_bytes


def block_backward_extra(m: ModelConfig, x: ActivationShape, index: int = 0) -> float:
    """Gradients of block `index`'s activations alive at once while it back-propagates: its larger mixer's (the
    token mixer's after the channel mixer has freed what it kept), and the residual stream's."""
    s_local = x.seq // x.tp if x.tp > 1 else x.seq
    tokens, _, channel = _mixers(m, index, False)
    freed = (0.0 if channel.empty else _norm(m, x, s_local)) + channel.saved_bytes(m, x)
    attention = tokens.backward_bytes(m, x, freed)
    return max(channel.backward_bytes(m, x), attention) + 2 * x.batch * x.seq * m.d_model * x.bytes


def head_saved(m: ModelConfig, x: ActivationShape, last: bool) -> float:
    """Final norm and the (gathered) input of the output projection; on the first stage, the token ids."""
    if not last:
        return 0.0
    s_local = x.seq // x.tp if x.tp > 1 else x.seq
    return _norm(m, x, s_local) + x.batch * x.seq * m.d_model * x.bytes


def logits(m: ModelConfig, x: ActivationShape) -> tuple[float, float]:
    """(kept, transient) of the plain loss: logits and the fp32 log-softmax (vocab-parallel: exp) kept per
    micro-batch until its backward, and two fp32 logit-sized gradients alive while the loss back-propagates."""
    elements = x.batch * x.seq * (m.vocab_size // x.tp)
    return elements * (x.bytes + FP32), 2 * elements * FP32


def _chunk_work(m: ModelConfig, x: ActivationShape, device_type: str) -> tuple[float, float]:
    """(chunk work, weight gradient) of the chunked head loss: one chunk of fp32 logits (and its low-precision
    copy), the low-precision weight copy, a chunk's weight-gradient product and its fp32 copy; one fp32 V x D."""
    rows, vocab = x.batch * x.seq, m.vocab_size // x.tp
    chunk = min(rows, default_chunk_rows(rows, vocab, m.d_model, torch.device(device_type)))
    weight = vocab * m.d_model
    low = x.bytes < FP32
    work = chunk * vocab * (FP32 + (x.bytes if low else 0))
    if low:
        work += weight * x.bytes + weight * (x.bytes + FP32)
    return work, weight * FP32


def chunked_loss(m: ModelConfig, x: ActivationShape, device_type: str) -> tuple[float, float]:
    """(kept, transient) of the chunked head loss (meshformer.loss.fused), which computes its gradients in the
    forward: kept until backward are the hidden-state gradient and the fp32 weight gradient; transient is the
    forward's chunk work or, later, the scaled weight gradient its backward returns, whichever is larger."""
    work, weight_grad = _chunk_work(m, x, device_type)
    return x.batch * x.seq * m.d_model * x.bytes + weight_grad, max(work, weight_grad)


def recomputed_chunked_loss(m: ModelConfig, x: ActivationShape, device_type: str) -> tuple[float, float]:
    """(kept, transient) of the recomputing chunked loss: one fp32 log-partition per row until its backward,
    which does the chunk work while it builds the fp32 weight gradient."""
    work, weight_grad = _chunk_work(m, x, device_type)
    return x.batch * x.seq * FP32, work + weight_grad


def loss_memory(m: ModelConfig, x: ActivationShape, method: str, device_type: str) -> tuple[float, float]:
    """(kept, transient) of the configured loss; liger's fused kernel is counted like the chunked loss."""
    if method == "plain":
        return logits(m, x)
    if method == "chunked_recompute":
        return recomputed_chunked_loss(m, x, device_type)
    return chunked_loss(m, x, device_type)


def mtp_module_saved(m: ModelConfig, x: ActivationShape, mode: str, loss_kept: float) -> tuple[float, float]:
    """(kept through forward, rebuilt in its backward) of one multi-token prediction module (model/mtp.py): its two
    norms' inputs and the concatenation eh_proj reads, its block (the last block's kinds, recomputed under
    "full"/"selective" as the main blocks are), its final norm and the shared head's input, and what its loss keeps
    (`loss_kept`, the configured loss's)."""
    s_local = x.seq // x.tp if x.tp > 1 else x.seq
    index = m.n_layers - 1
    joined = 2 * _norm(m, x, s_local) + x.batch * s_local * 2 * m.d_model * x.bytes
    full = block_saved(m, x, index=index)
    block = {"none": full, "selective": block_selective(m, x, index=index)}.get(mode, block_input(m, x))
    return joined + block + head_saved(m, x, True) + loss_kept, full - block


def recompute_mode_blocks(cfg: Config, layers: tuple[int, ...], mode: str) -> list[str]:
    """Per held block: 'none', 'selective' or 'full', as `apply_recompute` assigns them."""
    if mode == "every_k":
        return ["full" if index % cfg.parallel.recompute_every == 0 else "none" for index in layers]
    return [mode] * len(layers)


__all__ = ["FP32", "INDEX", "MOE_IMBALANCE", "ActivationShape", "activation_shape", "block_backward_extra",
           "block_input", "block_saved", "block_selective", "head_saved", "loss_memory", "moe_rows",
           "mtp_module_saved",
           "recompute_mode_blocks", "uses_math_attention"]
