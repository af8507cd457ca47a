"""The gated delta rule (Gated DeltaNet's token mixer) in plain PyTorch: chunked for training, step by step for
generation, with the recurrent state and the convolution window reset at every packed document's boundary.

The rule (Yang, Kautz, Hatamizadeh 2024), per head, with a state S of shape (Dk, Dv):

    S_t = exp(g_t) * S_{t-1}                      decay (g <= 0 is a log decay)
    u_t = beta_t * (v_t - S_t^T k_t)              delta: what the state does not yet predict, scaled by beta
    S_t = S_t + k_t u_t^T                         write
    o_t = S_t^T (scale * q_t)                     read, scale = 1 / sqrt(Dk) by default

`recurrent_gated_delta_rule` runs it token by token (the reference, and one decoding step with a carried state).
`chunk_gated_delta_rule` runs it in chunks of C tokens (the WY / UT-transform form). Inside a chunk the updates
u solve one unit lower-triangular system, (I + A) U = beta V - beta exp(G) K S_0 with A[i, j] = beta_i
exp(G_i - G_j) k_i.k_j for j < i (G: the cumulative log decay from the chunk's start), so U = W_v - W_k S_0 with
W = (I + A)^-1 [beta V, beta exp(G) K]; that inverse and every other within-chunk product are batched over all
chunks at once. Only the state crosses chunks: a scan of two GEMMs per chunk (`_StateScan`, which also runs its
backward as two GEMMs per chunk and batches the rest); the outputs of all chunks follow it as one batched
product, o = P U + exp(G) q S_0 with P[i, j] = exp(G_i - G_j) q_i.k_j for j <= i. Everything else is autograd.
Against `transformers`' fallback, forward + backward: docs/benchmarks/training.md (`bench/gated_delta.py`).

Per-channel decay (Kimi Delta Attention, KDA): g may also be (B, T, H, Dk), a log decay per key channel, so the
first line becomes S_t = diag(exp(g_t)) S_{t-1}. Everything above holds with the decays as vectors, except the
within-chunk products exp(G_i - G_j) q_i.k_j, which do not factor into one GEMM: `_channel_pair_products` splits
each chunk into blocks, computes the pairs within a block directly and those across blocks as one GEMM with every
factor referred to the end of the earlier block, so no factor exceeds 1 (nothing overflows, however fast the decay).

Conventions (those of `transformers`' Qwen3-Next `torch_chunk_gated_delta_rule` and Kimi Linear's
`chunk_kimi_delta_attention`, so they compare directly): q, k (B, T, Hk, Dk); v (B, T, H, Dv); g (B, T, H) or
(B, T, H, Dk) and beta (B, T, H); H a multiple of Hk (each q/k head serves H / Hk consecutive value heads);
state (B, H, Dk, Dv); output (B, T, H, Dv) in the input dtype. Half-precision inputs compute in float32, float64
stays float64; the returned state is in the compute dtype. Queries and keys are used as given unless
`use_qk_l2norm=True` (then each is divided by sqrt(sum of squares + 1e-6) first, as the checkpoints' kernels do).

Packed documents: `doc_ids` (B, T), each row's document index (non-decreasing, as the batches carry them when
`model.attention.document_mask` is on; `doc_ids_from_cu_seqlens` converts cumulative lengths). The state is zeroed where
a document starts, so no information crosses documents; the chunked form masks the within-chunk decays across
boundaries and drops the carried state past one, with no loop over documents. An `initial_state` belongs to each
row's first document and the final state is the state after each row's last token (its last document's), so a
row continues across calls (generation, context parallel). `causal_conv1d` is the short depthwise causal
convolution before the rule, with the same resets and a carried window for generation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F

Rule = TypeVar("Rule", bound=Callable[..., tuple[torch.Tensor, torch.Tensor | None]])

L2_EPS = 1e-6  # the checkpoints' kernels (flash-linear-attention) normalise q and k with this epsilon


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _without_autocast(rule: Rule) -> Rule:
    """Run `rule` in the compute dtype it picks itself, whatever autocast the caller is under (autocast would turn
    its float32 products back into half precision and cannot write the scan's preallocated float32 outputs)."""

    @functools.wraps(rule)
    def run(q: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        with torch.autocast(q.device.type, enabled=False):
            return rule(q, *args, **kwargs)

    return run  # type: ignore[return-value]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: float | None, use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """Checks shapes; returns q (scaled), k, v as (B, H, T, D), g as (B, H, T, Dk or 1) and beta as (B, H, T) in the
    compute dtype."""
    _check_shapes(q, k, v, g, beta)
    heads, k_heads = v.shape[2], k.shape[2]
    dtype = _compute_dtype(q)
    if heads != k_heads:
        q, k = (x.repeat_interleave(heads // k_heads, dim=2) for x in (q, k))
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).to(dtype) for x in (g, beta))
    if g.dim() == 3:  # one decay per head: a trailing channel dimension of 1 broadcasts over the state's rows
        g = g[..., None]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    if q.shape != k.shape or q.dim() != 4 or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be (B, T, Hk, Dk) and v (B, T, H, Dv); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    heads, k_heads = v.shape[2], k.shape[2]
    if heads % k_heads or g.shape not in (v.shape[:3], (*v.shape[:3], k.shape[3])) or beta.shape != v.shape[:3]:
        raise ValueError(f"value heads ({heads}) must be a multiple of key heads ({k_heads}), g (B, T, H) or "
                         f"(B, T, H, Dk) and beta (B, T, H) = {tuple(v.shape[:3])}; got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")


def _check_docs(doc_ids: torch.Tensor | None, batch: int, seq: int) -> None:
    if doc_ids is not None and tuple(doc_ids.shape) != (batch, seq):
        raise ValueError(f"doc_ids must be (B, T) = {(batch, seq)}; got {tuple(doc_ids.shape)}")


def _initial(initial_state: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    if tuple(initial_state.shape) != shape:
        raise ValueError(f"initial_state must be (B, H, Dk, Dv) = {shape}; got {tuple(initial_state.shape)}")
    return initial_state.to(dtype)


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(1, T) document ids of one packed row from its cumulative lengths [0, n_0, n_0 + n_1, ..., T] (the
    `cu_seqlens` of flash-attention and flash-linear-attention)."""
    if cu_seqlens.dim() != 1 or len(cu_seqlens) < 2 or int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must be 1-D [0, ..., T]; got {cu_seqlens.tolist()}")
    positions = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:], positions, right=True)[None]


@_without_autocast
def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, *, scale: float | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                               doc_ids: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rule token by token: the reference, and decoding (T = 1 with the carried state). Returns the output
    (B, T, H, Dv) and, with `output_final_state`, the state (B, H, Dk, Dv)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, use_qk_l2norm)
    batch, heads, seq, dk = k.shape
    _check_docs(doc_ids, batch, seq)
    state = _initial(initial_state, (batch, heads, dk, v.shape[-1]), v.dtype, v.device)
    decay = g.exp()
    if doc_ids is not None:  # a document's first token starts from an empty state
        starts = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0))
        decay = decay.masked_fill(starts[:, None, :, None], 0.0)
    outputs = []
    for t in range(seq):
        state = state * decay[:, :, t, :, None]
        delta = (v[:, :, t] - (k[:, :, t, :, None] * state).sum(-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((q[:, :, t, :, None] * state).sum(-2))
    out = torch.stack(outputs, dim=1).to(out_dtype)
    return out, (state if output_final_state else None)


class _StateScan(torch.autograd.Function):
    """The chunk-to-chunk recurrence, N steps over (B*H)-batched blocks, chunk-major:

        U_n = W_v[n] - W_k[n] S_n              the chunk's delta-rule updates, given the state entering it
        S_{n+1} = d_n S_n + K_w[n] U_n         the state leaving it (K_w: keys decayed to the chunk's end, (Dk, C);
                                               d_n (BH, Dk or 1): the chunk's decay of each state row, or of all)

    Returns U (N, BH, C, Dv), the entering states S_0..S_{N-1} (N, BH, Dk, Dv) and S_N. Backward runs the same
    two GEMMs per step in reverse for dU and dS and leaves every other gradient to one batched product after the
    loop, where autograd would record and replay several small operations per chunk."""

    @staticmethod
    def forward(ctx, w_v: torch.Tensor, w_k: torch.Tensor, k_write: torch.Tensor, decay: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = w_v.shape[0]
        updates = torch.empty_like(w_v)
        states = state.new_empty((n + 1, *state.shape))
        states[0] = state
        for i in range(n):
            torch.baddbmm(w_v[i], w_k[i], states[i], alpha=-1, out=updates[i])
            torch.mul(states[i], decay[i, :, :, None], out=states[i + 1])
            states[i + 1].baddbmm_(k_write[i], updates[i])
        ctx.save_for_backward(w_k, k_write, decay, updates, states)
        return updates, states[:-1], states[-1]  # separate outputs: no slicing backward over all the states

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_updates: torch.Tensor | None, d_entering: torch.Tensor | None,
                 d_final: torch.Tensor | None) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        w_k, k_write, decay, updates, states = ctx.saved_tensors
        n = w_k.shape[0]
        # written in place below: dU_n gains the path through S_{n+1}, dS_n those through S_{n+1} and U_n
        d_u = torch.zeros_like(updates) if d_updates is None else d_updates.clone(memory_format=torch.contiguous_format)
        d_s = torch.empty_like(states)
        for part, grad in ((d_s[:-1], d_entering), (d_s[-1], d_final)):
            part.zero_() if grad is None else part.copy_(grad)
        for i in range(n - 1, -1, -1):
            d_u[i].baddbmm_(k_write[i].transpose(-1, -2), d_s[i + 1])
            d_s[i].addcmul_(d_s[i + 1], decay[i, :, :, None])
            d_s[i].baddbmm_(w_k[i].transpose(-1, -2), d_u[i], alpha=-1)
        d_next = d_s[1:]
        d_k_write = d_next @ updates.transpose(-1, -2)
        d_decay = (d_next * states[:-1]).sum(-1)
        if decay.shape[-1] == 1:  # one decay for all the rows
            d_decay = d_decay.sum(-1, keepdim=True)
        d_w_k = -(d_u @ states[:-1].transpose(-1, -2))
        return d_u, d_w_k, d_k_write, d_decay, d_s[0]


@_without_autocast
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           *, chunk_size: int = 64, scale: float | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           doc_ids: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rule computed in chunks of `chunk_size` tokens (any T: the last chunk is padded). Same arguments and
    results as `recurrent_gated_delta_rule`."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    out_dtype = v.dtype
    _check_shapes(q, k, v, g, beta)
    batch, seq, heads, dv = v.shape
    dk = k.shape[-1]
    _check_docs(doc_ids, batch, seq)
    size = chunk_size
    pad = -seq % size
    n = (seq + pad) // size
    dtype = _compute_dtype(q)
    state = _initial(initial_state, (batch, heads, dk, dv), dtype, v.device).reshape(batch * heads, dk, dv)
    if heads != k.shape[2]:
        q, k = (x.repeat_interleave(heads // k.shape[2], dim=2) for x in (q, k))
    # chunk-major (N, B*H, C, D): each chunk's blocks are contiguous for the scan and every batched product.
    # Padding: k = v = beta = 0 writes nothing, g = 0 decays nothing, so the final state is the last real token's.
    q, k, v, g, beta = (_chunk_major(x.to(dtype), n, pad) for x in (q, k, v, g, beta))
    q_scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm:  # the scale rides on the norm's factor: one pass over q
        q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * q_scale)
        k = l2norm(k)
    else:
        q = q * q_scale
    per_channel = g.dim() == 4  # (N, B*H, C, Dk): a decay per key channel (KDA)
    cum = g.cumsum(-2 if per_channel else -1)  # G: log decay from the chunk's start through each token

    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    reads_state = writes_state = keeps_state = None
    if doc_ids is None:
        allowed = causal
    else:
        docs = _chunk_major(doc_ids[:, :, None].expand(batch, seq, heads), n, pad, mode="replicate")
        # the state entering a chunk is the document of the token before it (an initial state: the first token's)
        before = torch.cat([docs[:1, :, :1], docs[:-1, :, -1:]], dim=0)
        allowed = causal & (docs[..., :, None] == docs[..., None, :])
        reads_state = docs == before  # tokens the entering state reaches
        writes_state = docs == docs[..., -1:]  # tokens whose writes reach the leaving state
        keeps_state = reads_state[..., -1]

    # decays with a trailing channel dimension (1 for a decay per head), broadcast over each token's key channels
    cum_c = cum if per_channel else cum[..., None]
    read_decay = cum_c.exp()  # entering state -> token i
    write_decay = (cum_c[..., -1:, :] - cum_c).exp()  # token j -> leaving state
    chunk_decay = cum_c[..., -1, :].exp()  # entering state -> leaving state, (N, B*H, Dk or 1)
    if reads_state is not None and writes_state is not None and keeps_state is not None:
        read_decay = read_decay * reads_state[..., None]
        write_decay = write_decay * writes_state[..., None]
        chunk_decay = chunk_decay * keeps_state[..., None]

    # within-chunk products with the keys, exp(G_i - G_j) a_i.k_j for j <= i in the same document, 0 elsewhere (each
    # row scaled by row_scale)
    if per_channel:
        with_keys = _channel_pair_products(k, cum, allowed)

        def pairs(a: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
            out = with_keys(a)
            return out if row_scale is None else row_scale[..., None] * out
    else:  # masked before exp: no overflow, no NaN
        pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~allowed, float("-inf")).exp()

        def pairs(a: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
            products = a @ k.transpose(-1, -2)
            return (products if row_scale is None else row_scale[..., None] * products) * pair_decay

    # the UT transform, every chunk at once: T = (I + A)^-1 with A strictly lower (the solve reads only A's strict
    # lower triangle, the unit diagonal implied; C columns rather than Dv + Dk), then U = W_v - W_k S_0 with
    # W_v = T beta V, W_k = T beta exp(G) K
    ut = pairs(k, beta)
    eye = torch.eye(size, dtype=dtype, device=q.device)
    t_inv = torch.linalg.solve_triangular(ut, eye.expand_as(ut), upper=False, unitriangular=True)
    w_v = t_inv @ (v * beta[..., None])
    w_k = t_inv @ (k * (beta[..., None] * read_decay))
    k_write = (k * write_decay).transpose(-1, -2)

    # the sequential part: only the state crosses chunks
    updates, entering, final_state = _StateScan.apply(w_v, w_k, k_write, chunk_decay, state)

    # outputs of every chunk at once: o = P U + (exp(G) q) S_0, P[i, j] = exp(G_i - G_j) q_i.k_j for j <= i
    out = pairs(q) @ updates + (q * read_decay) @ entering
    out = out.reshape(n, batch, heads, size, dv).permute(1, 0, 3, 2, 4).reshape(batch, n * size, heads, dv)
    final = final_state.reshape(batch, heads, dk, dv) if output_final_state else None
    return out[:, :seq].to(out_dtype), final


def _block_size(size: int, most: int = 16) -> int:
    """The largest divisor of the chunk size `size` up to `most`: the blocks of `_channel_pair_products`."""
    return next(b for b in range(min(size, most), 0, -1) if size % b == 0)


def _channel_pair_products(b: torch.Tensor, cum: torch.Tensor, allowed: torch.Tensor
                           ) -> Callable[[torch.Tensor], torch.Tensor]:
    """For b and the cumulative log decays G (N, BH, C, Dk) (G non-increasing along C: every g <= 0), the function
    a -> M with M[i, j] = sum_d a_i[d] b_j[d] exp(G_i[d] - G_j[d]) where `allowed` (j <= i), else 0. The chunk is cut
    into blocks of S tokens. Pairs within a block are computed directly (an (S, S, Dk) product per block). A pair
    across blocks, i after block J >= j's, factors through R_J, G at J's last token: (a_i exp(G_i - R_J)) .
    (b_j exp(R_J - G_j)), both exponents <= 0; for each J that is one GEMM of every row's a, scaled to R_J, with J's
    b. Everything that depends on b and G alone is computed once for every a (the rule reads k and q against k)."""
    n, bh, size, dk = b.shape
    block = _block_size(size)
    nb = size // block
    blocks = torch.arange(size, device=b.device) // block
    cum_blocks = cum.view(n, bh, nb, block, dk)
    ends = cum_blocks[..., -1, :]  # R_J (N, BH, nb, Dk)
    b_across = (b * (ends[:, :, blocks] - cum).exp()).view(n, bh, nb, block, dk).transpose(-1, -2)  # (.., Dk, S)
    # every row's factor to each R_J, zero unless the row's block comes after J (masked before exp: no overflow)
    later = blocks[None, :] > torch.arange(nb, device=b.device)[:, None]  # (nb, C)
    to_end = (cum[:, :, None] - ends[:, :, :, None]).masked_fill(~later[..., None], float("-inf")).exp()
    lower = torch.ones(block, block, dtype=torch.bool, device=b.device).tril()
    diff = (cum_blocks[..., :, None, :] - cum_blocks[..., None, :, :]).masked_fill(~lower[..., None], float("-inf"))
    b_within = diff.exp() * b.view(n, bh, nb, block, dk)[..., None, :, :]  # (N, BH, nb, S [i], S [j], Dk)

    def products(a: torch.Tensor) -> torch.Tensor:
        across = (a[:, :, None] * to_end) @ b_across  # (N, BH, nb [J], C [i], S [j in J])
        across = across.permute(0, 1, 3, 2, 4).reshape(n, bh, size, size)
        within = (b_within @ a.view(n, bh, nb, block, dk)[..., None]).squeeze(-1)  # (N, BH, nb, S, S)
        # the blocks onto the diagonal: (N, BH, S, S, nb, nb) -> (N, BH, nb, S, nb, S)
        diagonal = torch.diag_embed(within.permute(0, 1, 3, 4, 2)).permute(0, 1, 4, 2, 5, 3)
        return (across + diagonal.reshape(n, bh, size, size)) * allowed

    return products


def _chunk_major(x: torch.Tensor, n: int, pad: int, mode: str = "constant") -> torch.Tensor:
    """(B, T, H, *D) -> (N, B*H, C, *D), T padded at the end to N chunks of C."""
    if pad:
        if mode == "replicate":  # F.pad replicates only trailing dimensions
            x = torch.cat([x, x[:, -1:].expand(x.shape[0], pad, *x.shape[2:])], dim=1)
        else:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    batch, total, heads, *rest = x.shape
    x = x.reshape(batch, n, total // n, heads, *rest).transpose(0, 1).transpose(2, 3)
    return x.reshape(n, batch * heads, total // n, *rest)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  state: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time: out[t] = bias + sum_j weight[:, W-1-j] * x[t-j], j < W, where
    x[t-j] counts only within x[t]'s document. x (B, T, C), weight (C, W) (a depthwise Conv1d's weight without
    its middle dimension), bias (C,). `state` (B, W-1, C): the inputs before x (zeros if None), of the row's first
    document; with T = 1 this is one decoding step. Returns the output (B, T, C) and the next state: the last W-1
    inputs, those of earlier documents zeroed. No activation."""
    batch, seq, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight must be (C, W) with C = {channels}; got {tuple(weight.shape)}")
    width = weight.shape[1]
    _check_docs(doc_ids, batch, seq)
    if state is None:
        state = x.new_zeros(batch, width - 1, channels)
    elif tuple(state.shape) != (batch, width - 1, channels):
        raise ValueError(f"conv state must be (B, W-1, C) = {(batch, width - 1, channels)}; got {tuple(state.shape)}")
    full = torch.cat([state.to(x.dtype), x], dim=1)  # (B, W-1+T, C)
    docs = None if doc_ids is None else torch.cat([doc_ids[:, :1].expand(batch, width - 1), doc_ids], dim=1)
    out = x * weight[:, -1] if bias is None else torch.addcmul(bias, x, weight[:, -1])
    for j in range(1, width):  # W is small (4): one fused multiply-add per tap
        shifted = full[:, width - 1 - j: width - 1 - j + seq]
        if docs is not None and doc_ids is not None:
            shifted = shifted * torch.eq(docs[:, width - 1 - j: width - 1 - j + seq], doc_ids)[..., None]
        out = torch.addcmul(out, shifted, weight[:, -1 - j])
    next_state = full[:, seq:]
    if docs is not None and doc_ids is not None:
        next_state = next_state * torch.eq(docs[:, seq:], doc_ids[:, -1:])[..., None]
    return out, next_state
