"""The gated delta rule through flash-linear-attention's Triton kernels (`fla.ops.gated_delta_rule` for Gated
DeltaNet, `fla.ops.kda` for KDA's decay per key channel), the optional GPU backend of the linear_attention and kda
blocks (`model.linear_attention.backend`; the extra `meshformer[fla]`).

It takes the arguments of model/gated_delta.py's `chunk_gated_delta_rule` and returns the same results. fla reads
the same (B, T, heads, width) layout, log-space decays g and post-sigmoid beta; it scales q by 1/sqrt(Dk) by
default and L2-normalises q and k inside the kernel (`use_qk_l2norm_in_kernel`). Query/key heads are repeated to
the value heads here (each serving a contiguous group of value heads, as in model/gated_delta.py), so fla's own
head grouping is never relied on. Packed documents become fla's variable-length form: the batch flattened to one
row and `cu_seqlens` the starts of every document of every row (the state restarts at each); an initial state
enters each row's first document and the final state is each row's last document's.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

from meshformer.errors import ConfigError

FLA_EXTRA = 'model.linear_attention.backend = "fla" needs flash-linear-attention: pip install "meshformer[fla]"'

Rule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def fla_importable() -> bool:
    """Whether the `fla` package is installed (it is not imported here)."""
    return importlib.util.find_spec("fla") is not None


def fla_rule(module_name: str = "fla.ops.gated_delta_rule", name: str = "chunk_gated_delta_rule") -> Rule:
    """fla's chunked gated delta rule (KDA's: "fla.ops.kda", "chunk_kda"); ImportError in one line naming the extra
    where it is missing."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"{FLA_EXTRA} ({err})") from err
    rule: Rule = getattr(module, name)
    return rule


def require_cuda(t: torch.Tensor, backend: str) -> None:
    """The optional kernels (fla's, mamba-ssm's) run on CUDA only: one line naming the fix for a tensor elsewhere."""
    if not t.is_cuda:
        raise ConfigError(f"{backend} runs its kernels on CUDA, but the model is on {t.device.type}",
                          'move the model to a GPU, or set the backend to "auto" or "torch"')


def document_starts(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of (B, T) document ids: `cu_seqlens` (N + 1,) of the N documents of the flattened batch (rows end documents
    too), each row's first document's index and each row's last's (B,)."""
    batch, seq = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    flat = starts.flatten().nonzero().squeeze(1)
    cu_seqlens = torch.cat([flat, flat.new_tensor([batch * seq])])
    per_row = starts.sum(dim=1)
    first = per_row.cumsum(0) - per_row
    return cu_seqlens, first, first + per_row - 1


def fla_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                         scale: float | None = None, initial_state: torch.Tensor | None = None,
                         output_final_state: bool = False, doc_ids: torch.Tensor | None = None,
                         use_qk_l2norm: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """model/gated_delta.py's `chunk_gated_delta_rule` (q, k (B, T, Hk, Dk), v (B, T, H, Dv), g and beta (B, T, H))
    computed by fla. Returns the output (B, T, H, Dv) and, with `output_final_state`, the state (B, H, Dk, Dv)."""
    return _through_fla(fla_rule(), q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, doc_ids=doc_ids, use_qk_l2norm=use_qk_l2norm)


def fla_kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                 scale: float | None = None, initial_state: torch.Tensor | None = None,
                 output_final_state: bool = False, doc_ids: torch.Tensor | None = None,
                 use_qk_l2norm: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same with KDA's decay per key channel (g (B, T, H, Dk), log space, computed outside the kernel:
    `use_gate_in_kernel` stays off) by fla's `chunk_kda`, which takes float32 states only."""
    require_cuda(q, 'model.linear_attention.backend = "fla"')
    if initial_state is not None and initial_state.dtype != torch.float64:  # float64: the CPU contract check
        initial_state = initial_state.float()
    return _through_fla(fla_rule("fla.ops.kda", "chunk_kda"), q, k, v, g, beta, scale=scale,
                        initial_state=initial_state, output_final_state=output_final_state, doc_ids=doc_ids,
                        use_qk_l2norm=use_qk_l2norm)


def _through_fla(rule: Rule, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 *, scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
                 doc_ids: torch.Tensor | None, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch, seq, heads, _ = v.shape
    if heads != k.shape[2]:
        q, k = (x.repeat_interleave(heads // k.shape[2], dim=2) for x in (q, k))
    options = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm)
    if doc_ids is None:
        return rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state, **options)
    cu_seqlens, first, last = document_starts(doc_ids)
    state = None
    if initial_state is not None:  # each row's first document starts from its row's state, the others from zeros
        state = initial_state.new_zeros((cu_seqlens.numel() - 1, *initial_state.shape[1:]))
        state = state.index_copy(0, first, initial_state)
    flat = [x.reshape(1, batch * seq, *x.shape[2:]) for x in (q, k, v, g, beta)]
    out, final = rule(*flat, initial_state=state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      **options)
    out = out.reshape(batch, seq, heads, -1)
    return out, (final[last] if output_final_state and final is not None else None)
