"""The Mamba-2 state-space scan (SSD, Dao and Gu 2024) in plain PyTorch: chunked for training, step by step for
generation, with the state reset at every packed document's boundary.

Per head h, with a state S of shape (P, N) (head width P, state size N) and a scalar decay rate A_h < 0:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T      x_t (P,) the head's input, B_t (N,) its group's input map
    y_t = S_t C_t                                     C_t (N,) its group's output map

(the skip term D x_t and the gate are the mixer's, model/mamba2.py). Heads are split into G groups that share B and
C, as the checkpoints store them. This is linear attention with a scalar decay per head and token: C plays the query,
B the key and dt x the value, so the chunked form needs no triangular solve. Inside a chunk of L tokens, with Λ the
cumulative log decay from the chunk's start, y_i = sum_{j <= i} exp(Λ_i - Λ_j) (C_i . B_j) dt_j x_j + exp(Λ_i) S_0 C_i:
one masked (L x L) product per group, batched over every chunk at once, and one GEMM for the state each chunk
hands on. Only the state crosses chunks (a loop of one multiply-add per chunk). The within-chunk products
(`_IntraChunk`) and the chunk-to-chunk states (`_ChunkStates`) have their own backward, so autograd neither keeps nor
replays each step of the masked exponential or of the loop; it runs the backward of the rest.

`recurrent_ssd` runs the recurrence token by token (the reference, and one decoding step with a carried state);
`chunk_ssd` the chunked form. Conventions (transformers' Mamba-2 torch path, so they compare directly): x (B, T, H, P),
dt (B, T, H) after its softplus and clamp, A (H,), B and C (B, T, G, N), state (B, H, P, N). Half-precision inputs
compute in float32 (whatever autocast is on), float64 stays float64; the output is in the input dtype, the state in
the compute dtype.

Packed documents: `doc_ids` (B, T), non-decreasing per row, as for the gated delta rule (model/gated_delta.py). The
state is zeroed where a document starts: the within-chunk products are masked across boundaries and the state
entering a chunk reaches only the tokens of the document it belongs to. An `initial_state` belongs to each row's
first document and the final state is the one after each row's last token, so a row continues across calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshformer.model.gated_delta import _without_autocast


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           doc_ids: torch.Tensor | None) -> None:
    if x.dim() != 4 or dt.shape != x.shape[:3] or A.shape != x.shape[2:3]:
        raise ValueError(f"x must be (B, T, H, P), dt (B, T, H) and A (H,); got {tuple(x.shape)}, {tuple(dt.shape)}, "
                         f"{tuple(A.shape)}")
    if B.shape != C.shape or B.dim() != 4 or B.shape[:2] != x.shape[:2] or x.shape[2] % B.shape[2]:
        raise ValueError(f"B and C must be (B, T, G, N) with G dividing the {x.shape[2]} heads; got {tuple(B.shape)}, "
                         f"{tuple(C.shape)}")
    if doc_ids is not None and doc_ids.shape != x.shape[:2]:
        raise ValueError(f"doc_ids must be (B, T) = {tuple(x.shape[:2])}; got {tuple(doc_ids.shape)}")


def _initial(state: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if state is None:
        return like.new_zeros(shape)
    if tuple(state.shape) != shape:
        raise ValueError(f"initial_state must be (B, H, P, N) = {shape}; got {tuple(state.shape)}")
    return state.to(like.dtype)


@_without_autocast
def recurrent_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
                  initial_state: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token. Returns y (B, T, H, P) and the final state (B, H, P, N)."""
    _check(x, dt, A, B, C, doc_ids)
    batch, length, heads, width = x.shape
    dtype = _compute_dtype(x)
    per_group = heads // B.shape[2]
    Bh, Ch = (m.to(dtype).repeat_interleave(per_group, dim=2) for m in (B, C))  # (B, T, H, N)
    xd, dtd = x.to(dtype), dt.to(dtype)
    state = _initial(initial_state, (batch, heads, width, B.shape[3]), xd)
    outputs = []
    for t in range(length):
        decay = torch.exp(dtd[:, t] * A.to(dtype))  # (B, H)
        if doc_ids is not None and t > 0:
            decay = decay * torch.eq(doc_ids[:, t], doc_ids[:, t - 1]).to(dtype)[:, None]
        state = decay[..., None, None] * state + (dtd[:, t, :, None] * xd[:, t])[..., None] * Bh[:, t, :, None]
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    return torch.stack(outputs, dim=1).to(x.dtype), state


class _IntraChunk(torch.autograd.Function):
    """Each chunk's output from its own tokens, per head: y_i = sum_j exp(Λ_i - Λ_j) (C_i . B_j) xs_j over the
    pairs `same` allows (j <= i, one document). cum (..., L): Λ per head; cb (..., L, L): C B^T per group, broadcast
    over its heads; xs (..., L, P). The backward forms the per-head (L x L) gradients once, where autograd would keep
    and replay every step of the masked exponential and the products."""

    @staticmethod
    def forward(ctx, cum: torch.Tensor, cb: torch.Tensor, xs: torch.Tensor,  # type: ignore[override]
                same: torch.Tensor) -> torch.Tensor:
        # masked before exp: no inf * 0 above the diagonal
        gaps = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~same, float("-inf")).exp_()
        scores = gaps * cb
        ctx.save_for_backward(cb, xs, gaps, scores)
        return scores @ xs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        cb, xs, gaps, scores = ctx.saved_tensors
        d_scores = dy @ xs.transpose(-1, -2)
        d_xs = scores.transpose(-1, -2) @ dy
        d_cb = (d_scores * gaps).sum_to_size(cb.shape)
        pairs = d_scores.mul_(scores)  # d(Λ_i - Λ_j) for each pair: + to row i, - to column j
        d_cum = pairs.sum(-1) - pairs.sum(-2)
        return d_cum, d_cb, d_xs, None


class _ChunkStates(torch.autograd.Function):
    """The state entering each chunk: S_0 given, S_{c+1} = through_c S_c + writes_c. through (..., n), writes
    (..., n, P, N), state (..., P, N). Returns the entering states (..., n, P, N) and the final one. The backward
    runs the recurrence in reverse (one multiply-add per chunk) and the decays' gradients in one product after it."""

    @staticmethod
    def forward(ctx, through: torch.Tensor, writes: torch.Tensor,  # type: ignore[override]
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entering = torch.empty_like(writes)
        for c in range(writes.shape[-3]):
            entering[..., c, :, :] = state
            state = torch.addcmul(writes[..., c, :, :], state, through[..., c, None, None])
        ctx.save_for_backward(through, entering)
        return entering, state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_entering: torch.Tensor | None,  # type: ignore[override]
                 d_final: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        through, entering = ctx.saved_tensors
        d_writes = torch.empty_like(entering)  # slot c: the gradient of S_{c+1}
        d_state = torch.zeros_like(entering[..., 0, :, :]) if d_final is None else d_final.clone()
        for c in range(entering.shape[-3] - 1, -1, -1):
            d_writes[..., c, :, :] = d_state
            d_state = d_state * through[..., c, None, None]
            if d_entering is not None:
                d_state = d_state + d_entering[..., c, :, :]
        d_through = (d_writes * entering).sum((-1, -2))
        return d_through, d_writes, d_state


@_without_autocast
def chunk_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
              chunk_size: int = 64, initial_state: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form. Returns y (B, T, H, P) and the final state (B, H, P, N)."""
    _check(x, dt, A, B, C, doc_ids)
    batch, length, heads, width = x.shape
    groups, size = B.shape[2], B.shape[3]
    per_group = heads // groups
    dtype = _compute_dtype(x)
    chunk = min(chunk_size, length)
    n = -(-length // chunk)
    pad = n * chunk - length

    def chunked(t: torch.Tensor) -> torch.Tensor:
        """(B, T, H or G, *D) -> (B, G, H/G or 1, n, L, *D), padded with zeros at the end."""
        t = F.pad(t.to(dtype), (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t.to(dtype)
        t = t.reshape(batch, n, chunk, groups, -1, *t.shape[3:])
        return t.movedim(3, 1).movedim(4, 2)

    state = _initial(initial_state, (batch, heads, width, size), x.to(dtype))
    xs = chunked(x * dt[..., None].to(x.dtype) if x.dtype == dtype else x.to(dtype) * dt[..., None].to(dtype))
    xs = xs.contiguous()  # (B, G, H/G, n, L, P): each head's chunks in the batched products' layout
    Bc, Cc = (chunked(m[:, :, :, None]).squeeze(-2).contiguous() for m in (B, C))  # (B, G, 1, n, L, N)
    log_decay = chunked((dt.to(dtype) * A.to(dtype))[..., None]).squeeze(-1)  # (B, G, H/G, n, L): zero past the end
    cum = log_decay.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    if doc_ids is None:
        same = causal
        reach = continues = None
    else:
        docs = torch.cat([doc_ids, doc_ids[:, -1:].expand(batch, pad)], dim=1).reshape(batch, n, chunk)
        same = causal & torch.eq(docs[..., :, None], docs[..., None, :])[:, None, None]  # (B, 1, 1, n, L, L)
        # the document the entering state belongs to: the token before the chunk's (the first token's for chunk 0)
        before = torch.cat([docs[:, :1, :1], docs[:, :-1, -1:]], dim=1)  # (B, n, 1)
        reach = torch.eq(docs, before)[:, None, None]  # (B, 1, 1, n, L): tokens the entering state reaches
        continues = torch.eq(docs[..., -1:], docs)[:, None, None]  # tokens whose input survives to the chunk's end
    y = _IntraChunk.apply(cum, Cc @ Bc.transpose(-1, -2), xs, same)  # (B, G, H/G, n, L, P)
    # what each chunk writes to the state it hands on: inputs decayed to the chunk's end
    to_end = (cum[..., -1:] - cum).exp()
    if continues is not None:
        to_end = to_end * continues
    writes = xs.transpose(-1, -2) @ (Bc * to_end[..., None])  # (B, G, H/G, n, P, N)
    through = cum[..., -1].exp()  # (B, G, H/G, n): the entering state's decay across the chunk
    if reach is not None:
        through = through * reach[..., -1]
    states, state = _ChunkStates.apply(through, writes, state.view(batch, groups, per_group, width, size))
    from_start = cum.exp() if reach is None else cum.exp() * reach
    # y + (exp(Λ_i) C_i) S^T in one product: the decay rides on C, each head's own (L x N) rows
    reads = (Cc * from_start[..., None]).flatten(0, 3)
    y = torch.baddbmm(y.flatten(0, 3), reads, states.flatten(0, 3).transpose(-1, -2)).view_as(y)
    y = y.movedim(2, 4).movedim(1, 3).reshape(batch, n * chunk, heads, width)[:, :length]
    return y.to(x.dtype), state.reshape(batch, heads, width, size)
