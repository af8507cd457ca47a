"""Fused kernels: SDPA backends, apex fused norms (only when importable), per-block torch.compile, and a
report of what is in use for the run log.

NVIDIA apex is not installable from the package registry, so it is strictly optional: its FusedLayerNorm /
FusedRMSNorm replace torch's norms on CUDA when `import apex` works, torch's own kernels are used otherwise.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from meshformer.model import Transformer
from meshformer.model.blockwise_attention import picks_blockwise
from meshformer.model.components import TokenMixer, model_kinds
from meshformer.model.families import get_family_spec
from meshformer.model.moe import moe_layers
from meshformer.model.positions import BIASED_POSITIONS
from meshformer.parallel.fsdp import blocks_of


def apex_available() -> bool:
    try:
        importlib.import_module("apex")
    except ImportError:
        return False
    return True


def use_apex_norms(model: nn.Module, device: torch.device) -> int:
    """Swap nn.LayerNorm / nn.RMSNorm for apex's fused versions (CUDA + apex only); returns how many.

    Parameter names (`weight`, `bias`) and values are kept, so checkpoints are unaffected. Not used with
    tensor parallel: apex kernels do not take DTensors.
    """
    if device.type != "cuda" or not apex_available():
        return 0
    normalization = importlib.import_module("apex.normalization")
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = _apex_norm(normalization, child)
            if replacement is not None:
                setattr(parent, name, replacement)
                count += 1
    return count


def _apex_norm(normalization: Any, norm: nn.Module) -> nn.Module | None:
    if type(norm) is nn.LayerNorm and norm.elementwise_affine:
        if norm.bias is None:
            return None  # apex's LayerNorm always has a bias; keep torch's
        fused = normalization.FusedLayerNorm(norm.normalized_shape, eps=norm.eps)
    elif type(norm) is nn.RMSNorm and norm.elementwise_affine and hasattr(normalization, "FusedRMSNorm"):
        fused = normalization.FusedRMSNorm(norm.normalized_shape, eps=norm.eps or 1e-6)
    else:
        return None
    fused.load_state_dict(norm.state_dict())
    return fused.to(norm.weight.device)


def compile_kwargs(mode: str) -> dict[str, Any]:
    """torch.compile arguments for train.compile_mode ("default": inductor's defaults)."""
    return {} if mode == "default" else {"mode": mode}


def trace_routed_sizes(model: nn.Module) -> None:
    """Before torch.compile of a model with MoE layers: sizes read from routed counts on the host (the expert-parallel
    splits, the padded experts' longest) are traced as symbolic sizes, not graph breaks. A process-wide dynamo
    setting (torchtitan sets it too); a graph break inside a recomputed block would run the block eagerly."""
    if any(True for _ in moe_layers(model)):
        torch._dynamo.config.capture_scalar_outputs = True
        torch._dynamo.config.capture_dynamic_output_shape_ops = True  # the rows kept for capacity (a mask)


def compile_blocks(model: Transformer, mode: str = "default") -> int:
    """torch.compile each block in place (`Module.compile`): names keep no `_orig_mod.` prefix."""
    trace_routed_sizes(model)
    blocks = blocks_of(model)
    for block in blocks:
        block.compile(**compile_kwargs(mode))
    return len(blocks)


def _blockwise_capable(m) -> bool:
    """Whether every token mixer of the model can run the blockwise kernel (model/components/)."""
    return all(kind.blockwise_kernel for kind in model_kinds(m) if isinstance(kind, TokenMixer))


def runs_blockwise_attention(cfg, device_type: str, compiled: bool) -> bool:
    """Whether `Attention` picks the blockwise CPU kernel for this run's unpadded batches (it decides per call:
    an explicit mask, a position bias, dropout or torch.compile send a call to SDPA)."""
    m = cfg.model
    if not _blockwise_capable(m):
        return False
    plain = m.attention.dropout == 0 and m.attention.window is None and not m.attention.document_mask \
        and m.position not in BIASED_POSITIONS and not compiled and m.attention.softcap is None
    longest = max(cfg.data.seq_len, cfg.data.target_len if get_family_spec(m.family).seq2seq else 0)
    return picks_blockwise(m.attention.backend, device_type, longest, m.attention_head_dim, plain,
                           recording=bool(cfg.optim.qk_clip_threshold))


def attention_kernels(cfg, device: torch.device, compiled: bool) -> str:
    backend = cfg.model.attention.backend
    if backend == "blockwise" and not _blockwise_capable(cfg.model):  # those token mixers run SDPA instead
        backend = "sdpa"
    if backend == "math":
        return "math (explicit softmax; returns attention weights)"
    if cfg.model.attention.softcap is not None:
        return "math (soft-capped scores: explicit softmax)"
    recording = bool(cfg.optim.qk_clip_threshold)  # MuonClip: only blockwise and math see each head's scores
    if runs_blockwise_attention(cfg, device.type, compiled):
        if recording:
            return "blockwise (records each head's largest logit for MuonClip; padded batches go to math)"
        return ("blockwise (meshformer's CPU kernel; padded batches go to SDPA)" if device.type == "cpu"
                else "blockwise (meshformer's kernel, as configured)")
    if recording:
        return "math (records each head's largest logit for MuonClip)"
    if backend not in ("sdpa", "auto"):
        return f"SDPA, {backend} kernel first (torch's order after it)"
    if device.type == "cuda":
        enabled = [name for name, on in (("flash", torch.backends.cuda.flash_sdp_enabled()),
                                         ("mem-efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
                                         ("cudnn", torch.backends.cuda.cudnn_sdp_enabled()),
                                         ("math", torch.backends.cuda.math_sdp_enabled())) if on]
        return "SDPA (" + " > ".join(enabled) + ", chosen per call by shape/dtype/mask)"
    return "SDPA (CPU flash kernel)"


def compile_mode_note(mode: str) -> str:
    return "" if mode == "default" else f", mode {mode}"


def kernel_report(cfg, device: torch.device, *, apex_norms: int, compiled: int, recompute: int) -> dict[str, str]:
    """What runs where, for the run log."""
    norm = f"apex fused ({apex_norms} modules)" if apex_norms else "torch"
    return {
        "attention": attention_kernels(cfg, device, compiled=compiled > 0),
        "norms": norm,
        "compile": (f"per-block torch.compile ({compiled} blocks{compile_mode_note(cfg.train.compile_mode)})"
                    if compiled else "eager"),
        "recompute": f"{cfg.parallel.recompute} ({recompute} blocks)" if recompute else "none",
        "apex": "importable" if apex_available() else "not installed (torch kernels)",
    }
