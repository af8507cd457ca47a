"""Activation bytes of our blocks, per micro-batch, from what their autograd graph actually keeps.

Read off `torch.autograd.graph.saved_tensors_hooks` on our `TransformerBlock` (pre-norm; b = micro-batch,
s = sequence, h = d_model, f = d_ff, a = activation bytes, t = tensor-parallel size; with t > 1 the residual
stream is sequence-parallel, s/t, and each branch works on the all-gathered full sequence; under context parallel
s is this rank's share of the sequence, and self-attention runs once per piece it holds, against every key up to
the piece's end):
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

import math
from dataclasses import dataclass

import torch

from meshformer.config import Config, ModelConfig
from meshformer.loss.fused import default_chunk_rows
from meshformer.model.attention import pieces_held
from meshformer.model.blockwise_attention import backward_workspace, stored_probabilities
from meshformer.parallel.kernels import runs_blockwise_attention
from meshformer.planner.assumptions import MOE_IMBALANCE

FP32 = 4
INDEX = 8  # int64 routing indices


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


def _attention_calls(x: ActivationShape, cross: bool, memory_len: int, causal: bool = True) -> list[tuple[int, int]]:
    """(queries, keys) of each attention call of a branch: one call, or under context parallel one per sequence
    piece this rank holds, against the keys up to its end (causal: the same totals on every rank, which is what
    the pieces are chosen for) or all of them."""
    if cross:
        return [(x.seq, memory_len)]
    if x.cp == 1:
        return [(x.seq, x.seq)]
    return [(n, at + n if causal else x.seq * x.cp) for _, n, at in pieces_held(0, x.cp, x.seq)]


def _keys_kept(x: ActivationShape, calls: list[tuple[int, int]]) -> int:
    """Key (and value) rows attention keeps: every call's, except SDPA under context parallel, whose calls keep
    views of one gathered (and grouped-query repeated) tensor."""
    if len(calls) > 1 and not x.blockwise:
        return max(k for _, k in calls)
    return sum(k for _, k in calls)


def uses_math_attention(m: ModelConfig) -> bool:
    """Whether attention runs as explicit matmuls and softmax: the math backend, or soft-capped scores."""
    return m.attention.backend == "math" or m.attention.softcap is not None


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
                           moe_imbalance, loop)


def moe_rows(m: ModelConfig, x: ActivationShape) -> tuple[int, float]:
    """(rows this rank sends to experts, rows its experts receive) per MoE layer and micro-batch (see the module
    docstring): N k sent (capped by capacity); received as sent without expert parallelism, else the imbalance
    times sent, or the capacity bound, never above the dropless worst case ep N min(k, E / ep)."""
    n, k, experts = x.batch * (x.seq // x.tp if x.tp > 1 else x.seq), m.moe.experts_per_token, m.moe.n_experts
    sent = n * k
    capacity = math.ceil(m.moe.capacity_factor * n * k / experts) if m.moe.capacity_factor > 0 else 0
    if capacity:
        sent = min(sent, experts * capacity)
    if x.ep == 1:
        return sent, float(sent)
    local = experts // x.ep
    most = x.ep * n * min(k, local)
    if capacity:
        return sent, float(min(most, x.ep * local * capacity))
    return sent, min(x.moe_imbalance * sent, float(most))


def _activation_factor(m: ModelConfig) -> int:
    """Tensors of the feed-forward's width its activation keeps: SwiGLU gate, up, silu(gate), product; GELU input
    and output; ReLU its output; the clamped SwiGLU (gpt-oss) gate, up, their clamps (up + 1), sigmoid(alpha * gate),
    gate * sigmoid, product."""
    if m.ffn.activation == "swiglu_clamped":
        return 7
    return 4 if m.gated else {"relu": 1}.get(m.ffn.activation, 2)


def _moe_branch_saved(m: ModelConfig, x: ActivationShape, s_local: int) -> float:
    """What an MoE feed-forward branch keeps (module docstring)."""
    n, h, a = x.batch * s_local, m.d_model, x.bytes
    sent, received = moe_rows(m, x)
    factor = _activation_factor(m)
    total = _norm(m, x, s_local) + n * h * FP32  # the router's fp32 input (the normalised tokens when fp32)
    total += n * m.moe.n_experts * FP32 * (2 if m.moe.aux_loss or m.moe.router_z_loss else 1)  # scores (+ logits)
    total += n * m.moe.experts_per_token * (INDEX + FP32) + 2 * sent * INDEX  # top-k, weights; sort order, tokens
    if x.ep > 1:
        total += 2 * received * INDEX  # the regrouping of received rows and its inverse
    total += received * (h + factor * m.expert_d_ff) * a  # expert input rows and activations
    total += sent * (h * a + FP32)  # expert outputs and their weights, multiplied in the combine
    if m.moe.n_shared_experts:
        total += factor * n * m.moe.n_shared_experts * m.expert_d_ff * a + (n * h * a if a != FP32 else 0)
    return total


def _sdpa_mask(x: ActivationShape, calls: list[tuple[int, int]], cross: bool) -> float:
    """The mask SDPA keeps for its backward, in the activation dtype: one (b, 1, q, k) per call (cross-attention
    always masks the source's padding)."""
    return x.batch * sum(q * k for q, k in calls) * x.bytes if cross or x.masked else 0.0


def _norm(m: ModelConfig, x: ActivationShape, s_local: int) -> float:
    """A norm's saved input and statistics (RMSNorm upcasts: an fp32 input and an fp32 normalised copy)."""
    rows = x.batch * s_local
    if m.norm.kind == "rmsnorm":
        return rows * (2 * m.d_model + 1) * FP32
    return rows * (m.d_model * x.residual_bytes + 2 * FP32)


def _head_width(m: ModelConfig) -> int:
    """The per-head width of the attention tensors: multi-head latent attention's query/key width (its values are
    narrower, its latents small beside them: an upper estimate)."""
    return m.mla.qk_head_dim if m.uses_mla else m.attention_head_dim


def _ffn_branch_saved(m: ModelConfig, x: ActivationShape, s_local: int) -> float:
    """What the feed-forward branch keeps: its norm, the (gathered) normalised input, the activation's tensors."""
    ffn = x.batch * x.seq * (m.ffn.d_ff // x.tp) * x.bytes
    gathered = x.batch * x.seq * m.d_model * x.bytes
    return _norm(m, x, s_local) + gathered + _activation_factor(m) * ffn


def block_saved(m: ModelConfig, x: ActivationShape, *, cross: bool = False, memory_len: int = 0,
                causal: bool = True, moe: bool = False) -> float:
    """Bytes one block keeps from forward to backward without recomputation."""
    b, s, t, a = x.batch, x.seq, x.tp, x.bytes
    h = m.d_model
    s_local = s // t if t > 1 else s
    gathered = b * s * h * a  # the normalised input the projections read (all-gathered under SP)
    heads = m.attention.n_heads // t
    qkv_out = b * s * heads * _head_width(m) * a
    total = 0.0
    out_norms = _norm(m, x, s_local) if m.norm.position == "sandwich" else 0.0  # each branch's output norm
    for branch_cross in ([False, True] if cross else [False]):
        total += _norm(m, x, s_local) + out_norms + gathered
        calls = _attention_calls(x, branch_cross, memory_len, causal)
        kv = b * _keys_kept(x, calls) * heads * _head_width(m) * a
        if uses_math_attention(m):
            scores = b * heads * sum(q * k for q, k in calls)
            total += 2 * qkv_out + 2 * kv + scores * FP32 + (scores * a if a != FP32 else 0)
            if m.attention.softcap is not None:  # the capped scores' tanh, kept for its backward
                total += scores * a
            if m.attention.dropout > 0:
                total += scores * (a + 1)
        elif x.blockwise:
            causal_here = causal and not branch_cross
            total += 2 * qkv_out + 2 * kv + sum(stored_probabilities(b * heads, q, k, causal_here)
                                                for q, k in calls) * a
        else:
            total += 2 * qkv_out + 2 * kv + b * heads * s * FP32 + _sdpa_mask(x, calls, branch_cross)
        if m.dropout > 0:
            total += b * s_local * h
    total += out_norms + (_moe_branch_saved(m, x, s_local) if moe else _ffn_branch_saved(m, x, s_local))
    if m.dropout > 0:
        total += b * s_local * h
    return total


def block_selective(m: ModelConfig, x: ActivationShape, *, cross: bool = False, memory_len: int = 0,
                    causal: bool = True, moe: bool = False) -> float:
    """Bytes one block keeps under our selective policy: block input, matmul and attention outputs."""
    b, s, t, a = x.batch, x.seq, x.tp, x.bytes
    h = m.d_model
    s_local = s // t if t > 1 else s
    heads, kv_heads = m.attention.n_heads // t, m.kv_heads // t
    branches = 2 if cross else 1
    total: float = b * s_local * h * x.residual_bytes  # the checkpointed block's input
    for branch_cross in ([False, True] if cross else [False]):
        calls = _attention_calls(x, branch_cross, memory_len, causal)
        total += b * s * heads * _head_width(m) * a * 2  # q projection and attention output
        total += 2 * b * (memory_len if branch_cross else s) * kv_heads * _head_width(m) * a  # k, v projections
        if x.blockwise:  # the kernel's own q/k/v rows (GQA: repeated) and probabilities
            total += (s + 2 * sum(k for _, k in calls)) * b * heads * _head_width(m) * a
            total += sum(stored_probabilities(b * heads, q, k, causal and not branch_cross) for q, k in calls) * a
        else:
            total += b * heads * s * FP32 + _sdpa_mask(x, calls, branch_cross)  # log-sum-exp, mask
        if uses_math_attention(m):  # the two attention matmuls' outputs (scores, weighted values)
            total += 2 * b * heads * sum(q * k for q, k in calls) * a
    widths = 2 if m.gated else 1  # gate and up (or up) projection outputs
    if moe:  # the router's and experts' matmul outputs, on this rank's tokens (sequence parallel routes locally)
        n = b * s_local
        _, received = moe_rows(m, x)
        total += n * m.moe.n_experts * FP32 + received * (widths * m.expert_d_ff + h) * a
        total += n * (widths * m.moe.n_shared_experts * m.expert_d_ff + h) * a if m.moe.n_shared_experts else 0
    else:
        total += widths * b * s * (m.ffn.d_ff // t) * a
    outputs = branches + (0 if moe else 1)
    total += outputs * b * s * h * a  # o_proj / down_proj outputs before the reduce-scatter
    if t > 1:
        total += outputs * b * s_local * h * a  # reduce-scatter outputs
    return total


def block_input(m: ModelConfig, x: ActivationShape) -> float:
    s_local = x.seq // x.tp if x.tp > 1 else x.seq
    return x.batch * s_local * m.d_model * x.residual_bytes


def block_backward_extra(m: ModelConfig, x: ActivationShape, moe: bool = False) -> float:
    """Gradients of a block's activations alive at once while it back-propagates (its largest branch); an MoE
    branch: its experts' activation gradients, those of the received rows and, arriving back all-to-all, of the
    sent ones."""
    b, s, t, a = x.batch, x.seq, x.tp, x.bytes
    ffn_grads: float = (3 if m.gated else 2) * b * s * (m.ffn.d_ff // t) * a
    if moe:
        sent, received = moe_rows(m, x)
        # the loop back-propagates one expert's rows at a time (the balanced share of the received ones)
        rows = received / max(1, m.moe.n_experts // x.ep) if x.experts_loop else received
        ffn_grads = ((3 if m.gated else 2) * rows * m.expert_d_ff + (received + sent) * m.d_model
                     ) * a
    heads = m.attention.n_heads // t
    calls = _attention_calls(x, False, 0)
    keys = max(k for _, k in calls)  # under context parallel: the gathered sequence's key/value gradients
    attention: float = 2 * b * (s + keys) * heads * _head_width(m) * a  # gradients of q and output, k and v
    if m.attention.backend == "math":
        attention += 2 * b * heads * sum(q * k for q, k in calls) * FP32
    elif x.blockwise:
        # its workspace is large, but by then the feed-forward branch has back-propagated and freed what it kept
        # (under context parallel counted at this rank's length: within 6% of measured, see README)
        branch = _moe_branch_saved if moe else _ffn_branch_saved
        attention = backward_workspace(b * heads, s, _head_width(m), a) - branch(m, x, s // t if t > 1 else s)
    return max(ffn_grads, attention) + 2 * b * s * m.d_model * a


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


def loss_memory(m: ModelConfig, x: ActivationShape, kind: str, device_type: str) -> tuple[float, float]:
    """(kept, transient) of the configured loss; liger's fused kernel is counted like the chunked loss."""
    if kind == "plain":
        return logits(m, x)
    if kind == "chunked_recompute":
        return recomputed_chunked_loss(m, x, device_type)
    return chunked_loss(m, x, device_type)


def recompute_mode_blocks(cfg: Config, layers: tuple[int, ...], mode: str) -> list[str]:
    """Per held block: 'none', 'selective' or 'full', as `apply_recompute` assigns them."""
    if mode == "every_k":
        return ["full" if index % cfg.parallel.recompute_every == 0 else "none" for index in layers]
    return [mode] * len(layers)
