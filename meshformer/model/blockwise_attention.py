"""Attention for CPUs: query blocks against the keys they may see, probabilities kept for backward.

Why not SDPA on a CPU: torch's CPU flash-attention kernel recomputes in a slow backward and runs well below the
CPU's GEMM rate (`bench/cpu_attention.py`). Here each block
of queries is one batched GEMM against its keys (causal: none of the masked triangle beyond the diagonal block),
a fused softmax, and one GEMM with the values; backward reuses the stored probabilities instead of recomputing
them. Scores and their gradients are fp32 (fp32 GEMMs on the upcast operands, as flash accumulates in fp32), so
the accuracy is flash's; the probabilities are stored in the input dtype (flash also rounds them to it before
multiplying by V). Speed and error against the CPU flash kernel: docs/benchmarks/training.md.

The cost is memory: B*H*T*(T+block)/2 stored probabilities per layer instead of flash's B*H*T statistics. Relative
to the ~17*d_model activation elements a block keeps per token that is about T / (34 * head_dim), so `auto` picks
this kernel only while T <= 16 * head_dim (at most about half again a block's activations), on a CPU, outside
torch.compile (inductor fuses SDPA itself), for causal or unmasked attention without dropout or biases.
"""

from __future__ import annotations

import torch

MAX_SEQ_PER_HEAD_DIM = 16  # `auto`: sequence length up to 16 x head_dim (probabilities <= ~half the activations)


def block_rows(seq_len: int) -> int:
    """Queries per block: 64 up to T 512, then 128 (small blocks skip more of the masked
    triangle, larger ones run larger GEMMs)."""
    return 64 if seq_len <= 512 else 128


def stored_probabilities(batch_heads: int, q_len: int, k_len: int, causal: bool) -> int:
    """Probabilities one layer keeps for backward: each query block's rows against the keys it sees."""
    rows, total = block_rows(q_len), 0
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        total += (end - start) * (end + k_len - q_len if causal else k_len)
    return batch_heads * total


def picks_blockwise(backend: str, device_type: str, seq_len: int, head_dim: int, plain: bool,
                    recording: bool = False) -> bool:
    """Whether attention runs this kernel. `plain`: causal or unmasked, no bias or dropout, not under
    torch.compile, plain tensors; `seq_len`: the longer of queries and keys. `blockwise` forces it wherever it
    applies; `auto` picks it on a CPU within the memory rule above, and on any device while `recording` each head's
    largest logit (MuonClip: SDPA kernels never hold the scores; the other calls run the math path)."""
    if not plain:
        return False
    if backend == "blockwise" or (backend == "auto" and recording):
        return True
    return backend == "auto" and device_type == "cpu" and seq_len <= MAX_SEQ_PER_HEAD_DIM * head_dim


def backward_workspace(batch_heads: int, seq_len: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes alive while one layer back-propagates, the input gradients included: per (T, D) element the fp32
    key/value gradients and upcast values (12 B) and eight input-dtype tensors (output gradient, partial
    products, results); per query block one score gradient in fp32 and in the input dtype, and the row sums.
    Calibrated against the live-tensor count (planner/measure.py) of one attention backward, held by the
    planner's predicted-vs-measured layouts (tests/unit/planner/test_plan.py)."""
    return batch_heads * (seq_len * head_dim * (12 + 8 * elem_bytes) + block_rows(seq_len) * seq_len * (5 + elem_bytes))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) as a new contiguous (B*H, T, D) tensor (an op's outputs may not alias its inputs)."""
    rows = t.reshape(-1, t.shape[2], t.shape[3]).contiguous()
    return rows.clone() if rows.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else rows


# One custom op (not an autograd.Function of many aten ops) so that selective recomputation, which keeps chosen
# ops' outputs, can keep this kernel's output and probabilities as it keeps an SDPA kernel's (parallel/recompute.py).
@torch.library.custom_op("meshformer::blockwise_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
               sinks: torch.Tensor | None, record_max: bool) -> list[torch.Tensor]:
    """[output, each row's largest logit (N,) (record_max; else empty), q, k, v as (B*H, T, D) rows, each query's
    sink probability (N, Tq) (empty without sinks), probabilities of each query block]; q (B, H, Tq, D), k and v
    (B, H, Tk, D), sinks (H,) or None. Backward keeps the rows (no second copy of the heads) and the probabilities.
    Causal: the queries are the last Tq of the Tk positions (a KV-cache step or a context-parallel piece when
    Tq < Tk). The largest logit (q·k·scale over the keys each query sees; MuonClip) has no gradient."""
    batch, heads, q_len, head_dim = q.shape
    k_len = k.shape[2]
    shift = k_len - q_len  # causal: query i sits at key position i + shift
    q, k, v = (_rows(t) for t in (q, k, v))  # (N, T, D), N = batch x heads
    rows = block_rows(q_len)
    wide = torch.promote_types(q.dtype, torch.float32)  # scores in at least fp32 (fp64 stays fp64)
    # a sink joins each row's denominator: softmax(scores) scaled by sigmoid(logsumexp(scores) - sink)
    sink_of_row = None if sinks is None else sinks.to(wide).repeat(batch).view(-1, 1)  # row n = b * H + h
    sink_probs = q.new_empty((0,) if sinks is None else (batch * heads, q_len), dtype=wide)
    max_logit = torch.full((batch * heads,) if record_max else (0,), float("-inf"), dtype=wide, device=q.device)
    q_wide = q.to(wide) * scale
    k_wide_t = k.to(wide).transpose(1, 2).contiguous()  # (N, D, Tk): each block reads a prefix of keys
    above_diagonal = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
    # (B, H, Tq, D) laid out as (B, Tq, H, D), so merging the heads for the output projection is a view
    out = q.new_empty(batch, q_len, heads, head_dim).transpose(1, 2)
    probs = []
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        keys = end + shift if causal else k_len
        scores = torch.bmm(q_wide[:, start:end], k_wide_t[:, :, :keys])
        if causal:
            n = end - start
            scores[:, :, start + shift:].masked_fill_(above_diagonal[:n, :n], float("-inf"))
        if record_max:  # a read of the block the softmax reads anyway (masked keys are -inf)
            torch.maximum(max_logit, scores.amax(dim=(1, 2)), out=max_logit)
        p = torch.softmax(scores, dim=-1)
        if sink_of_row is not None:
            beyond = torch.logsumexp(scores, dim=-1) - sink_of_row  # (N, rows)
            p = p.mul_(torch.sigmoid(beyond).unsqueeze(-1))
            sink_probs[:, start:end] = torch.sigmoid(-beyond)
        p = p.to(q.dtype)
        out[:, :, start:end] = torch.bmm(p, v[:, :keys]).view(batch, heads, end - start, head_dim)
        probs.append(p)
    return [out, max_logit, q, k, v, sink_probs, *probs]


@_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
      sinks: torch.Tensor | None, record_max: bool) -> list[torch.Tensor]:
    batch, heads, q_len, head_dim = q.shape
    rows, k_len = block_rows(q_len), k.shape[2]
    probs = [q.new_empty(batch * heads, min(rows, q_len - start),
                         min(start + rows, q_len) + k_len - q_len if causal else k_len)
             for start in range(0, q_len, rows)]
    rows_of = [t.new_empty(batch * heads, t.shape[2], head_dim) for t in (q, k, v)]
    wide = torch.promote_types(q.dtype, torch.float32)
    sink_probs = q.new_empty((0,) if sinks is None else (batch * heads, q_len), dtype=wide)
    max_logit = q.new_empty((batch * heads,) if record_max else (0,), dtype=wide)
    return [q.new_empty(batch, q_len, heads, head_dim).transpose(1, 2), max_logit, *rows_of, sink_probs, *probs]


def _save(ctx, inputs: tuple, output: list[torch.Tensor]) -> None:
    q, _, _, scale, causal, sinks, _ = inputs
    ctx.save_for_backward(*output[2:])
    ctx.scale, ctx.causal, ctx.heads = scale, causal, q.shape[1]
    ctx.sinks_dtype = None if sinks is None else sinks.dtype


def _backward(ctx, grads: list[torch.Tensor | None]):
    q, k, v, sink_probs, *probs = ctx.saved_tensors  # (N, T, D) rows
    q_len, head_dim, k_len = q.shape[1], q.shape[2], k.shape[1]
    heads = ctx.heads
    batch = q.shape[0] // heads
    rows = block_rows(q_len)
    shift = k_len - q_len
    wide = torch.promote_types(q.dtype, torch.float32)
    grad_out = grads[0].reshape(batch * heads, q_len, head_dim)  # type: ignore[union-attr]
    v_wide_t = v.to(wide).transpose(1, 2).contiguous()
    grad_q = torch.empty_like(q)
    grad_k = torch.zeros(k.shape, dtype=wide, device=k.device)
    grad_v = torch.zeros(k.shape, dtype=wide, device=k.device)
    # a sink's logit gradient: -p_sink * rowsum(P * dP) per query (its value is zero, so its dP is 0)
    grad_sink_rows = None if ctx.sinks_dtype is None else torch.empty_like(sink_probs)
    for p, start in zip(probs, range(0, q_len, rows), strict=True):
        end = min(start + rows, q_len)
        keys = end + shift if ctx.causal else k_len
        grad_v[:, :keys] += torch.bmm(p.transpose(1, 2), grad_out[:, start:end])
        # softmax backward in fp32: dS = P*dP - P*rowsum(P*dP), with dP = dO V^T
        grad_scores = torch.bmm(grad_out[:, start:end].to(wide), v_wide_t[:, :, :keys]).mul_(p)
        row_sums = grad_scores.sum(-1, keepdim=True)
        if grad_sink_rows is not None:
            grad_sink_rows[:, start:end] = -sink_probs[:, start:end] * row_sums.squeeze(-1)
        grad_scores = grad_scores.addcmul_(p, row_sums, value=-1).to(q.dtype)
        grad_q[:, start:end] = torch.bmm(grad_scores, k[:, :keys])
        grad_k[:, :keys] += torch.bmm(grad_scores.transpose(1, 2), q[:, start:end])
    grad_q = grad_q.mul_(ctx.scale).view(batch, heads, q_len, head_dim)
    grad_k = grad_k.mul_(ctx.scale).to(k.dtype).view(batch, heads, k_len, head_dim)
    grad_sinks = None
    if grad_sink_rows is not None:
        grad_sinks = grad_sink_rows.view(batch, heads, q_len).sum((0, 2)).to(ctx.sinks_dtype)
    return grad_q, grad_k, grad_v.to(v.dtype).view(batch, heads, k_len, head_dim), None, None, grad_sinks, None


_attention.register_autograd(_backward, setup_context=_save)


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                        causal: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v for q (B, H, Tq, D), k and v (B, H, Tk, D) with the same heads;
    causal aligns the queries with the last Tq keys. sinks (H,): a logit per head in each row's denominator."""
    return blockwise_attention_max(q, k, v, scale=scale, causal=causal, sinks=sinks, record_max=False)[0]


def blockwise_attention_max(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                            sinks: torch.Tensor | None = None, record_max: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`blockwise_attention`'s output and each head's largest logit q·k·scale over the batch and the keys each
    query sees, (H,) in at least fp32 (record_max; else empty), without gradient."""
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"blockwise causal attention needs at least as many keys as queries, got {k.shape[2]} "
                         f"keys for {q.shape[2]} queries")
    out, max_logit, *_ = _attention(q, k, v, scale, causal, sinks, record_max)
    return out, max_logit.view(q.shape[0], q.shape[1]).amax(0) if record_max else max_logit
