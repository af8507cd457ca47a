"""Activation recomputation applied from outside the model: none / full / selective / every k-th block.

Each chosen block's `forward` is replaced (on the instance) by a non-reentrant checkpoint of the original, so
parameter names stay exactly as in the plain model (no `_checkpoint_wrapped_module.` prefix) and checkpoints,
parity tests and FSDP wrapping see the same tree. Apply after tensor parallel (its hooks live inside the
block and are replayed on recompute) and before torch.compile and FSDP, as torchtitan does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshformer.model import Transformer

aten = torch.ops.aten


def _save_list() -> set:
    """Ops whose outputs selective recomputation keeps: matmuls, attention kernels, reduce-scatters.

    Matmuls dominate the FLOPs, so keeping them makes recompute cheap while the memory-heavy elementwise
    results (norms, activations, dropout masks, softmax inputs) are recomputed.
    """
    names = [
        (aten, "mm"), (aten, "addmm"), (aten, "bmm"), (aten, "baddbmm"),
        (aten, "_scaled_dot_product_flash_attention_for_cpu"), (aten, "_scaled_dot_product_flash_attention"),
        (aten, "_scaled_dot_product_efficient_attention"), (aten, "_scaled_dot_product_cudnn_attention"),
        (torch.ops.meshformer, "blockwise_attention"),  # our CPU kernel: its output, q/k/v rows, probabilities
        (torch.ops._c10d_functional, "reduce_scatter_tensor"),  # do not repeat tensor-parallel communication
    ]
    ops = set()
    for namespace, name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _selective_policy(save: set) -> Callable:
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_block(block: nn.Module, *, selective: bool = False) -> None:
    """Recompute `block`'s activations in backward (only its matmul outputs kept when `selective`)."""
    if getattr(block, "_meshformer_recompute", None) is not None:
        return  # already applied
    original = block.forward
    extra: dict = {}
    if selective:
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy(_save_list()))

    def forward(*args, **kwargs):
        return checkpoint(original, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward  # type: ignore[method-assign]  # the block's own forward, now recomputed
    # A marker read above; nn.Module's __setattr__ stub admits only tensors and modules.
    block._meshformer_recompute = "selective" if selective else "full"  # type: ignore[assignment]


def apply_recompute(model: Transformer, mode: str, every: int = 2) -> int:
    """Checkpoint blocks of `model` by `mode`; returns how many blocks recompute."""
    if mode == "none":
        return 0
    if mode not in ("full", "selective", "every_k"):
        raise ValueError(f"unknown recompute mode {mode!r}; use none, full, selective or every_k")
    count = 0
    for index, block in model.spec.blocks(model):  # global execution index, block
        if mode == "every_k" and index % every:
            continue
        checkpoint_block(block, selective=mode == "selective")
        count += 1
    if mode in ("full", "selective"):  # multi-token prediction's blocks recompute as the main blocks do
        for module in getattr(model, "mtp_layers", None) or ():
            checkpoint_block(module.block, selective=mode == "selective")
            count += 1
    return count
