"""Parity harness: every parallel layout against one process on the same init and data (CPU, gloo).

One launch of N spawned processes runs a whole list of scenarios (process-group start-up dominates the cost
on 2 cores). Each scenario trains 2 optimizer steps of 2 accumulated micro-batches with padding, label
smoothing and z-loss, and reports, relative to the single-process reference:
- loss_rel: |loss - ref| / |ref| for both steps (step 1 checks the sharded optimizer update and clipping)
  and for an evaluation pass after them;
- grad_rel: max over parameters of max|g - g_ref| / max|g_ref| (the scale floored at 1e-4 of the model's
  largest), step-0 gradients gathered with full_tensor();
- norm_rel: the clip_grad_norm global norm against torch's on the full model;
- mtp_rel: each multi-token prediction module's mean loss (mtp/loss_<k>) at both steps; mtp_without_grad: the
  modules' parameters whose step-0 gradient is all zero;
- missing: reference parameters no rank checked (a layout that silently drops a parameter fails).

Run by hand: python tests/helpers/parallel.py --world 2 decoder/fsdp decoder/tp
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests"):  # also run as a script: the checkout's meshformer, and helpers/
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from helpers.common import free_port  # noqa: E402
from meshformer.batch import IGNORE_INDEX  # noqa: E402
from meshformer.config import Config, OptimConfig, ScheduleConfig, config_from_dict  # noqa: E402
from meshformer.loss.cross_entropy import plain_loss_fn  # noqa: E402
from meshformer.model import Transformer  # noqa: E402
from meshformer.model.moe import moe_layers  # noqa: E402
from meshformer.optim import AdamWConfig, MuonConfig, NorMuonConfig  # noqa: E402
from meshformer.optim.muon import is_muon_parameter  # noqa: E402
from meshformer.parallel.parallel_model import ParallelModel  # noqa: E402
from meshformer.parallel_dims import ParallelDims  # noqa: E402
from meshformer.train.loss_choice import resolve_loss  # noqa: E402
from meshformer.train.step import TrainStep  # noqa: E402

BATCH, SEQ, TARGET, VOCAB = 8, 16, 8, 64
MAX_NORM = 0.05  # small enough that clipping is active in both steps
QK_CLIP_THRESHOLD = 0.05  # "qkclip" rows: the tiny models' largest logits are 0.04-0.08: some heads clip, some not

FAMILIES: dict[str, dict[str, Any]] = {
    # Llama-like: RMSNorm, SwiGLU, RoPE, GQA, tied embeddings
    "decoder": dict(family="decoder", n_layers=4, position="rope", bias=False, attention=dict(n_kv_heads=2),
                    ffn=dict(activation="swiglu"), norm=dict(kind="rmsnorm")),
    # Qwen3-like attention on Llama 3.1's scaled RoPE: head_dim != d_model / n_heads, QK-norm (its weights replicated
    # across the head shards), biases on Q/K/V only
    "decoder_qwen": dict(family="decoder", n_layers=2, position="rope", bias=False,
                         attention=dict(n_kv_heads=2, head_dim=12, qk_norm=True, qkv_bias=True),
                         ffn=dict(activation="swiglu"),
                         rope=dict(scaling="llama3", factor=4.0, original_max_seq_len=16), norm=dict(kind="rmsnorm")),
    # Gemma-like: sandwich (1 + weight) RMSNorms, GeGLU, scaled embeddings, per-head QK-norm, every 2nd block global
    # (RoPE base 1M, linear scaling) and the others windowed (base 10k), attention and final-logit soft-capping
    "decoder_gemma": dict(family="decoder", n_layers=4, position="rope", bias=False, scale_embeddings=True,
                          logit_softcap=30.0, layer_types=["sliding_attention", "full_attention"],
                          attention=dict(n_kv_heads=2, qk_norm=True, window=5, softcap=20.0),
                          ffn=dict(activation="geglu"),
                          rope=dict(theta=1e6, scaling="linear", factor=2.0, local_theta=1e4),
                          norm=dict(kind="rmsnorm", position="sandwich", weight_offset=1.0)),
    # OLMo-2-like: each sub-layer's output normalised before the residual add, QK-norm over the whole projections
    "decoder_olmo2": dict(family="decoder", n_layers=2, position="rope", bias=False,
                          attention=dict(n_kv_heads=2, qk_norm=True, qk_norm_scope="projection"),
                          ffn=dict(activation="swiglu"), norm=dict(kind="rmsnorm", position="post_sublayer")),
    # OLMo-3-like: OLMo 2's blocks with every 2nd block global (yarn-scaled RoPE) and the others windowed (their own
    # unscaled base); under pp=2 each stage holds one windowed and one global block
    "olmo3": dict(family="decoder", n_layers=4, position="rope", bias=False,
                  layer_types=["sliding_attention", "full_attention"],
                  attention=dict(n_kv_heads=2, qk_norm=True, qk_norm_scope="projection", window=5),
                  ffn=dict(activation="swiglu"), norm=dict(kind="rmsnorm", position="post_sublayer"),
                  rope=dict(theta=500.0, local_theta=1e4, scaling="yarn", factor=4.0, original_max_seq_len=8)),
    # GPT-2-like with ALiBi (per-head slopes must follow tensor-parallel head sharding) and biases
    "decoder_alibi": dict(family="decoder", n_layers=4, position="alibi", bias=True, tie_embeddings=False,
                          output_bias=True, ffn=dict(activation="gelu")),
    # GPT-2-like: learned absolute positions, LayerNorm, GELU; T5-style relative buckets in a decoder-only model
    # (context parallel checks both follow each token's place in the sequence)
    "gpt": dict(family="decoder", n_layers=2, position="learned", bias=True, ffn=dict(activation="gelu"),
                norm=dict(kind="layernorm")),
    "decoder_t5": dict(family="decoder", n_layers=2, position="t5_relative", bias=False, attention=dict(n_kv_heads=2)),
    "decoder_window": dict(family="decoder", n_layers=2, bias=False, layer_types=["sliding_attention"],
                           attention=dict(window=5, n_kv_heads=2)),
    # packed documents: causal attention within each (the batches carry doc_ids)
    "decoder_docs": dict(family="decoder", n_layers=2, position="rope", bias=False,
                         attention=dict(n_kv_heads=2, document_mask=True)),
    # Llama-like mixture of experts: the first block dense, then MoE blocks of 4 experts (top-2) and a shared expert,
    # aux and z balance losses in the objective; per-sequence balance loss; DeepSeek-V3's sigmoid, group-limited
    # routing with the bias balancing that updates after each step
    "moe": dict(family="decoder", n_layers=4, position="rope", bias=False, mlp_types=["dense", "moe", "moe", "moe"],
                attention=dict(n_kv_heads=2), ffn=dict(activation="swiglu"), norm=dict(kind="rmsnorm"),
                moe=dict(n_experts=4, experts_per_token=2, d_ff=24, n_shared_experts=1, aux_loss=0.01,
                         router_z_loss=1e-3)),
    "moe_seq": dict(family="decoder", n_layers=2, position="rope", bias=False, ffn=dict(activation="gelu"),
                    norm=dict(kind="rmsnorm"),
                    moe=dict(n_experts=4, experts_per_token=1, d_ff=24, aux_loss=0.05, aux_per_sequence=True)),
    "moe_bias": dict(family="decoder", n_layers=2, position="rope", bias=False, ffn=dict(activation="swiglu"),
                     norm=dict(kind="rmsnorm"),
                     moe=dict(n_experts=8, experts_per_token=2, d_ff=16, router_score="sigmoid", router_groups=4,
                              router_groups_per_token=2, router_bias_update_rate=0.05)),
    # the original Transformer with MoE feed-forwards in both stacks (cross-attention over the encoder's output)
    "moe_encdec": dict(family="encoder_decoder", n_encoder_layers=2, n_decoder_layers=2, position="sinusoidal",
                       ffn=dict(activation="relu"), moe=dict(n_experts=4, experts_per_token=2, d_ff=24, aux_loss=0.01)),
    # every token chooses experts 0 and 1 (a fixed selection bias): under ep=2 rank 1's experts receive nothing
    "moe_skew": dict(family="decoder", n_layers=2, position="rope", bias=False, ffn=dict(activation="swiglu"),
                     norm=dict(kind="rmsnorm"), moe=dict(n_experts=4, experts_per_token=2, d_ff=24, aux_loss=0.01)),
    # the first block dense, the second MoE: under pp=2 the first stage holds no MoE layer
    "moe_late": dict(family="decoder", n_layers=2, position="rope", bias=False, mlp_types=["dense", "moe"],
                     ffn=dict(activation="swiglu"), norm=dict(kind="rmsnorm"),
                     moe=dict(n_experts=4, experts_per_token=2, d_ff=24, aux_loss=0.01)),
    # gpt-oss-like: attention sinks (split with the heads under TP), alternating sliding/full blocks, YaRN without
    # truncation, MoE with a biased router and biased experts (split with the experts under EP), clamped SwiGLU
    "gptoss": dict(family="decoder", n_layers=2, position="rope", bias=True,
                   layer_types=["sliding_attention", "full_attention"], norm=dict(kind="rmsnorm"),
                   ffn=dict(activation="swiglu_clamped"), attention=dict(n_kv_heads=2, sinks=True, window=5),
                   rope=dict(scaling="yarn", factor=4.0, original_max_seq_len=8, truncate=False),
                   moe=dict(n_experts=4, experts_per_token=2, d_ff=24, router_bias=True, expert_linear_bias=True,
                            aux_loss=0.01)),
    # DeepSeek-V3-like: multi-head latent attention in every block (low-rank queries, interleaved RoPE with YaRN and
    # its mscale; under cp the ranks exchange the compressed latents), the first block dense, then MoE blocks of 8
    # experts in 4 groups (2 kept per token), top-2 sigmoid weights scaled by 2.5, a shared expert, bias balancing
    "deepseek": dict(family="decoder", n_layers=3, position="rope", bias=False, layer_types=["mla"],
                     mlp_types=["dense", "moe", "moe"], ffn=dict(activation="swiglu"), norm=dict(kind="rmsnorm"),
                     mla=dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                              mscale_all_dim=1.0),
                     rope=dict(scaling="yarn", factor=4.0, original_max_seq_len=8),
                     moe=dict(n_experts=8, experts_per_token=2, d_ff=16, n_shared_experts=1, router_score="sigmoid",
                              router_groups=4, router_groups_per_token=2, router_scale=2.5,
                              router_bias_update_rate=0.05)),
    # the same with one multi-token prediction module (an MoE block beside the shared embedding and head)
    "deepseek_mtp": dict(family="decoder", n_layers=3, position="rope", bias=False, layer_types=["mla"],
                         mlp_types=["dense", "moe", "moe"], ffn=dict(activation="swiglu"), norm=dict(kind="rmsnorm"),
                         mla=dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                  v_head_dim=6),
                         moe=dict(n_experts=8, experts_per_token=2, d_ff=16, n_shared_experts=1,
                                  router_score="sigmoid", router_groups=4, router_groups_per_token=2,
                                  router_bias_update_rate=0.05),
                         mtp=dict(depth=1, loss_weight=0.5)),
    # Qwen3-Next-like: a Gated DeltaNet block (state and convolution reset per packed document) then a gated
    # attention block with partial RoPE, (1 + weight) norms, MoE with a gated shared expert
    "qwen3next": dict(family="decoder", n_layers=2, position="rope", bias=False,
                      layer_types=["linear_attention", "full_attention"],
                      norm=dict(kind="rmsnorm", weight_offset=1.0), ffn=dict(activation="swiglu"),
                      attention=dict(n_kv_heads=2, qk_norm=True, output_gate=True, document_mask=True),
                      rope=dict(partial_factor=0.5),
                      linear_attention=dict(n_heads=4, n_key_heads=2, key_head_dim=8, value_head_dim=8, chunk_size=8),
                      moe=dict(n_experts=4, experts_per_token=2, d_ff=24, n_shared_experts=1, shared_expert_gate=True,
                               aux_loss=0.01)),
    # Qwen3.5-like dense: the same blocks with the split projections (in_proj_qkv ordered [all q | all k | all v])
    # and dense SwiGLU feed-forwards
    "qwen35": dict(family="decoder", n_layers=2, position="rope", bias=False,
                   layer_types=["linear_attention", "full_attention"],
                   norm=dict(kind="rmsnorm", weight_offset=1.0), ffn=dict(activation="swiglu"),
                   attention=dict(n_kv_heads=2, qk_norm=True, output_gate=True, document_mask=True),
                   rope=dict(partial_factor=0.5),
                   linear_attention=dict(n_heads=4, n_key_heads=2, key_head_dim=8, value_head_dim=6, chunk_size=8,
                                         projections="split")),
    # OLMo hybrid-like: Gated DeltaNet with separate q/k/v/z/b/a projections and q/k/v taps, beta doubled, pre-norm,
    # beside a post-sub-layer attention block (model.norm.by_kind)
    "olmohybrid": dict(family="decoder", n_layers=2, position="rope", bias=False,
                       layer_types=["linear_attention", "full_attention"],
                       norm=dict(kind="rmsnorm", position="post_sublayer", by_kind={"linear_attention": "pre"}),
                       ffn=dict(activation="swiglu"),
                       attention=dict(n_kv_heads=2, qk_norm=True, qk_norm_scope="projection"),
                       linear_attention=dict(n_heads=4, n_key_heads=2, key_head_dim=8, value_head_dim=6,
                                             chunk_size=8, projections="separate", allow_neg_eigval=True,
                                             norm_eps=1e-5)),
    # Kimi Linear-like: a KDA block (a forget gate per key channel; state and convolutions reset per packed
    # document) then latent attention without RoPE; block 0 dense, then sigmoid-routed experts beside a shared one
    "kimi": dict(family="decoder", n_layers=2, position="none", bias=False, layer_types=["kda", "mla"],
                 mlp_types=["dense", "moe"], ffn=dict(activation="swiglu"), norm=dict(kind="rmsnorm"),
                 attention=dict(document_mask=True),
                 mla=dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
                 linear_attention=dict(n_heads=4, key_head_dim=8, value_head_dim=8, chunk_size=8),
                 moe=dict(n_experts=4, experts_per_token=2, d_ff=16, n_shared_experts=1, router_score="sigmoid")),
    # BERT-like: learned positions, embedding norm, prediction-head transform, post-norm
    "encoder": dict(family="encoder", n_layers=4, position="learned", head_transform=True, ffn=dict(activation="gelu"),
                    norm=dict(embedding=True, position="post")),
    # original-Transformer-like: shared + tied embeddings, sinusoidal, cross-attention over pooled memory
    "encdec": dict(family="encoder_decoder", n_encoder_layers=2, n_decoder_layers=2, position="sinusoidal",
                   cross_downsample=2, ffn=dict(activation="relu")),
}
# Four blocks of the DeepSeek-V3-like and Qwen3-Next-like models, so that the V and interleaved schedules have two
# stages per rank to place
FAMILIES["deepseek4"] = dict(FAMILIES["deepseek"], n_layers=4, mlp_types=["dense", "moe", "moe", "moe"])
FAMILIES["deepseek_mtp4"] = dict(FAMILIES["deepseek_mtp"], n_layers=4, mlp_types=["dense", "moe", "moe", "moe"])
# DeepSeek-V3.2-like: the DeepSeek-V3-like model with DeepSeek Sparse Attention in every block (each query attends to
# the 5 of up to 16 keys its lightning indexer scores highest; the indexer's loss joins the objective, its keys travel
# with the latents under cp, its scores' gradient is summed over the tp ranks); and its dense warm-up, where only
# the indexers train
FAMILIES["dsa"] = dict(FAMILIES["deepseek"], layer_types=["dsa"], dsa=dict(n_heads=4, head_dim=8, topk=5))
FAMILIES["dsa_warmup"] = dict(FAMILIES["dsa"], dsa=dict(n_heads=4, head_dim=8, topk=5, stage="warmup"))
# GLM-5's shared selection: block 1 attends to block 0's keys (block 2 selects its own, after it in the forward)
FAMILIES["dsa_shared"] = dict(FAMILIES["dsa"], layer_types=["dsa", "dsa_shared", "dsa"])
# Nemotron-H-like: a Mamba-2 block (grouped B and C; state and convolution reset per packed document) then an
# attention block without positions, dense feed-forwards
FAMILIES["mamba"] = dict(family="decoder", n_layers=2, position="none", bias=False,
                         layer_types=["mamba2", "full_attention"], norm=dict(kind="rmsnorm"),
                         attention=dict(n_kv_heads=2, document_mask=True),
                         mamba=dict(n_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8))
# Nemotron-H-like layers, one mixer each (the other sub-layer "none"): Mamba-2, sigmoid group-routed squared-ReLU
# experts beside a shared MLP, attention without positions, a squared-ReLU MLP
FAMILIES["nemotron"] = dict(FAMILIES["mamba"], n_layers=4, layer_types=["mamba2", "none", "full_attention", "none"],
                            mlp_types=["none", "moe", "none", "dense"], ffn=dict(activation="relu2"),
                            moe=dict(n_experts=4, experts_per_token=2, d_ff=16, n_shared_experts=2,
                                     router_score="sigmoid", router_groups=2, router_scale=2.5))
# DeepSeek-V4's residual on the DeepSeek-V3-like model: two mHC streams, their mixing weights replicated (FSDP shards,
# tp replicates them), each token's mix its own (cp pieces and sequence-parallel slices need nothing exchanged)
FAMILIES["deepseek_mhc"] = dict(FAMILIES["deepseek"], residual=dict(kind="mhc", streams=2, sinkhorn_iters=5))
# DeepSeek-V4-like (tiny-v4's pieces at the harness's sizes): a sliding, a csa (the indexer keeps 3 of up to 8
# entries of 2 tokens over 4), an hca (entries of 4) and a csa block, one shared key/value head, sinks, the output
# through 2 groups; mHC's 2 streams; hash-routed experts in blocks 0 and 2 (each pipeline stage of two holds one, so
# the token ids must reach both), sqrt-softplus routing with a shared expert in 1 and 3. Under cp the 4-token pieces
# each compress their own windows (a CSA entry reads the previous piece's last window), the ranks all-gather the
# key/value head, the entries and the indexer's keys, and the window reaches back across pieces
FAMILIES["v4"] = dict(family="decoder", n_layers=4, position="none", bias=False,
                      layer_types=["sliding_mqa", "csa", "hca", "csa"],
                      mlp_types=["hash_moe", "moe", "hash_moe", "moe"],
                      attention=dict(head_dim=8), norm=dict(kind="rmsnorm"), ffn=dict(activation="swiglu"),
                      compressed_attention=dict(q_rank=16, rope_dim=4, window=4, o_groups=2, o_rank=8, hca_rate=4,
                                                csa_rate=2, index_heads=2, index_dim=8, index_topk=3),
                      moe=dict(n_experts=4, experts_per_token=2, d_ff=16, n_shared_experts=1,
                               router_score="sqrt_softplus", router_scale=1.5, router_bias_update_rate=0.05),
                      residual=dict(kind="mhc", streams=2, sinkhorn_iters=5))
# The V4-like model with one multi-token prediction module of the published kinds (a sliding-window block with a
# learned router): it reads the main stack's 2 streams before their merge and merges its own
FAMILIES["v4mtp"] = dict(FAMILIES["v4"], mtp=dict(depth=1, loss_weight=0.5, layer_type="sliding_mqa", mlp_type="moe"))
FAMILIES["qwen3next4"] = dict(FAMILIES["qwen3next"], n_layers=4, layer_types=["linear_attention", "full_attention"] * 2)


def make_config(family: str, parallel: dict[str, Any] | None = None, model_keys: dict[str, Any] | None = None,
                **train: Any) -> Config:
    """model_keys: [model.*] tables added to the family's (a layout's model options)."""
    model: dict[str, Any] = dict(vocab_size=VOCAB, d_model=32, max_seq_len=32, dropout=0.0,
                                 attention=dict(n_heads=4), ffn=dict(d_ff=64))
    for key, value in [*FAMILIES[family].items(), *(model_keys or {}).items()]:  # each adds to the tables before
        model[key] = {**model.get(key, {}), **value} if isinstance(value, dict) else value
    raw = {
        "model": model,
        "data": {"seq_len": SEQ, "target_len": TARGET, "batch_size": BATCH},
        "train": {"label_smoothing": 0.1, "z_loss": 1e-3, "seed": 0, "device": "cpu", **train},
        "parallel": parallel or {},
    }
    return config_from_dict(raw)  # validated


def make_batches(cfg: Config, n: int, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    """Deterministic batches for the family's objective, with padding and ignored labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=g)
        real = torch.arange(SEQ)[None, :] < lengths[:, None]
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        if cfg.objective == "causal":
            labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).masked_fill(~real, IGNORE_INDEX)
            out.append({"input_ids": ids, "labels": labels})
            if cfg.model.attention.document_mask:  # documents end at random places (the last token of each: its EOS)
                ends = (torch.rand(BATCH, SEQ, generator=g) < 0.2).long()
                out[-1]["doc_ids"] = ends.cumsum(1) - ends
        elif cfg.objective == "mlm":
            chosen = (torch.rand(BATCH, SEQ, generator=g) < 0.3) & real
            out.append({"input_ids": ids, "attention_mask": real,
                        "labels": torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))})
        else:
            t_len = torch.randint(TARGET // 2, TARGET + 1, (BATCH,), generator=g)
            t_real = torch.arange(TARGET)[None, :] < t_len[:, None]
            target = torch.randint(0, VOCAB, (BATCH, TARGET + 1), generator=g)
            out.append({"input_ids": ids, "attention_mask": real, "decoder_input_ids": target[:, :-1],
                        "decoder_attention_mask": t_real,
                        "labels": target[:, 1:].masked_fill(~t_real, IGNORE_INDEX)})
    return out


# Families whose routers start with a fixed selection bias (the harness sets it on both the reference and the layout)
SELECTION_BIAS = {"moe_skew": [10.0, 10.0, -10.0, -10.0]}


def new_model(cfg: Config, family: str = "") -> Transformer:
    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model)
    if family in SELECTION_BIAS:
        for _, layer in moe_layers(model):
            layer.router.expert_bias.copy_(torch.tensor(SELECTION_BIAS[family]))
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def build_cpu_plan(cfg: Config, model: Transformer | None = None) -> ParallelModel:
    """`parallelize` on CPU for this world, with the loss the trainer resolves from `cfg`."""
    from meshformer.parallel import parallelize

    world = dist.get_world_size() if dist.is_initialized() else 1
    loss = resolve_loss(cfg, ParallelDims.from_config(cfg.parallel, world), "cpu")
    return parallelize(model if model is not None else new_model(cfg), cfg, torch.device("cpu"), loss)


def harness_step(plan: ParallelModel, steps: int, nonfinite_limit: int = 0, optimizer: str = "adamw",
                 qk_clip: float | None = None) -> TrainStep:
    """The trainer's update (fused AdamW: clip factor and skip flag in the kernel; or Muon for the blocks' matrices)
    at a constant rate; `qk_clip`: MuonClip's threshold."""
    optim = OptimConfig(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, grad_clip=MAX_NORM,
                        adamw=AdamWConfig(implementation="fused"), max_nonfinite_in_a_row=nonfinite_limit,
                        name=optimizer, muon=MuonConfig(lr=1e-2, weight_decay=0.1),
                        normuon=NorMuonConfig(lr=1e-2, weight_decay=0.1), qk_clip_threshold=qk_clip)
    return TrainStep(plan, optim, ScheduleConfig(name="constant", warmup_steps=0), steps, d_model=1)


def train_steps(plan: ParallelModel, steps: list[list[dict[str, torch.Tensor]]], dp_rank: int, dp_size: int,
                optimizer: str = "adamw", qk_clip: float | None = None):
    """Two optimizer steps; returns (global losses, step-0 grads by canonical name, pre-clip norms, counts), the
    counts with the updated weights by canonical name under Muon ("weights") and QK-clip's log of each
    step ("qk_clip": heads clipped, largest logit)."""
    training = harness_step(plan, len(steps), optimizer=optimizer, qk_clip=qk_clip)
    qk_clip_log: list[tuple[float, float]] = []
    losses, norms, grads0, replica_all_reduces = [], [], {}, []
    mtp_losses: list[dict[str, float]] = []
    float8_amax_reduces: list[int] = []  # per step: torchao's per-weight amax all-reduces (float8 FSDP all-gather)
    FLOAT8_AMAX_REDUCES[0] = 0
    forward_backward, grad_norm = plan.forward_backward, plan.grad_norm

    def counted_forward_backward(*args, **kwargs):
        with counted_replica_all_reduces(plan) as count:
            out = forward_backward(*args, **kwargs)
        replica_all_reduces.append(count[0])
        return out

    def first_grads_kept():  # the step's gradients are complete when the step asks for their norm
        if not grads0:
            grads0.update(gathered_grads(plan))
        return grad_norm()

    index_losses: list[dict[str, tuple[float, float]]] = []
    plan.forward_backward, plan.grad_norm = counted_forward_backward, first_grads_kept  # type: ignore[method-assign]
    try:
        for micro in steps:
            local = [{k: v.chunk(dp_size)[dp_rank] for k, v in b.items()} for b in micro]
            with summed_index_losses(plan) as index_loss:
                stats = training.step(local)
            index_losses.append(index_loss)
            if training.qk_clip is not None:
                scalars = training.qk_clip.scalars()
                qk_clip_log.append((scalars["optim/qk_clip_heads"], scalars["optim/max_attention_logit"]))
            norms.append(float(stats.grad_norm))
            float8_amax_reduces.append(FLOAT8_AMAX_REDUCES[0] - sum(float8_amax_reduces))
            total = plan.reduce_for_logging(stats.loss_sum) if dist.is_initialized() else float(stats.loss_sum)
            losses.append(total / float(stats.global_tokens))
            mtp_losses.append(plan.mtp_scalars())  # mtp/loss_<k>: a collective under data parallel
    finally:
        plan.forward_backward, plan.grad_norm = forward_backward, grad_norm  # type: ignore[method-assign]
    # Evaluation (no gradients) on the first step's batches with the updated weights.
    with torch.no_grad():
        evals = [plan.evaluate({k: v.chunk(dp_size)[dp_rank] for k, v in b.items()}) for b in steps[0]]
    losses.append(float(sum(e[0] for e in evals)) / float(sum(e[1] for e in evals)))
    weights = gathered_tensors(plan, "weights") if optimizer in ("muon", "normuon") else {}
    return losses, grads0, norms, {"replica_all_reduces": replica_all_reduces, "float8_amax_all_reduces":
                                   float8_amax_reduces, "weights": weights, "qk_clip": qk_clip_log,
                                   "index_losses": index_losses, "mtp_losses": mtp_losses}


@contextmanager
def summed_index_losses(plan: ParallelModel) -> Iterator[dict[str, tuple[float, float]]]:
    """This rank's csa indexer losses per layer over the training forwards in the block (every micro-batch and
    pipeline microbatch; a forward recomputed in the backward not again): (summed KL, counted queries)."""
    from meshformer.model.compressed_attention import CompressedAttention

    sums: dict[str, tuple[float, float]] = {}

    def kept(name: str) -> Any:
        def hook(layer: CompressedAttention, _args: Any, _output: Any) -> None:
            if (torch._C._current_graph_task_id() != -1 or layer._loss_sum is None or layer._loss_count is None
                    or _in_shape_inference()):
                return  # recomputed inside the backward, the term off, or a pipeline stage's shape inference
            kl, count = sums.get(name, (0.0, 0.0))
            sums[name] = (kl + float(layer._loss_sum), count + float(layer._loss_count))
        return hook

    handles = [layer.register_forward_hook(kept(name)) for name, layer in plan.named_dsa_layers
               if isinstance(layer, CompressedAttention)]
    try:
        yield sums
    finally:
        for handle in handles:
            handle.remove()


def _in_shape_inference() -> bool:
    """Whether a pipeline stage's shape inference runs this: a forward on the first step whose output no backward
    reads (meshformer/parallel/pipeline/model.py `_shape_inference_uncounted`)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("_forward_metadata_inference", "_shape_inference"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def index_loss_rel(ours: list[list[dict[str, tuple[float, float]]]], ref: list[dict[str, tuple[float, float]]]
                   ) -> tuple[float | None, list[float]]:
    """The csa indexer losses (mean KL per counted query, per layer and optimizer step) of a layout against one
    process: `ours` holds, per tensor-parallel rank, each step's (summed KL, counted queries) per layer, summed over
    the ranks of other tokens and stages (each tp rank's own sum: every one must equal one process's). (max relative
    difference, the reference's means by step, then layer); None without any."""
    names = sorted({n for step in ref for n in step})

    def means(steps: list[dict[str, tuple[float, float]]]) -> list[float]:
        return [step[n][0] / max(step[n][1], 1.0) if n in step else math.inf for step in steps for n in names]

    expected = means(ref)
    if not expected:
        return None, []
    worst = max(abs(a - b) / abs(b) for tp_rank in ours for a, b in zip(means(tp_rank), expected, strict=True))
    return worst, expected


@contextmanager
def counted_orthogonalised_matrices() -> Iterator[list[int]]:
    """Counts the matrices Muon's Newton–Schulz orthogonalises in the block (a stacked expert weight: each expert)."""
    from meshformer.optim import muon

    count, original = [0], muon.newton_schulz

    def counting(g: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        count[0] += g.shape[0] if g.ndim == 3 else 1
        return original(g, *args, **kwargs)

    muon.newton_schulz = counting
    try:
        yield count
    finally:
        muon.newton_schulz = original


@contextmanager
def counted_replica_all_reduces(plan: ParallelModel) -> Iterator[list[int]]:
    """Counts the all-reduces over the data-replicate ranks (HSDP's gradient sum across replicas) in the block."""
    count = [0]
    meshes = getattr(plan, "meshes", None)
    if meshes is None or not meshes.dims.hsdp:
        yield count
        return
    replicas = dist.get_process_group_ranks(meshes.world["dp_replicate"].get_group())
    original = dist.all_reduce

    def counting(*args, **kwargs):
        group = kwargs.get("group")
        if group is not None and dist.get_process_group_ranks(group) == replicas:
            count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield count
    finally:
        dist.all_reduce = original


def gathered_grads(plan: ParallelModel) -> dict[str, torch.Tensor]:
    return gathered_tensors(plan, "grads")


def gathered_tensors(plan: ParallelModel, what: str) -> dict[str, torch.Tensor]:
    """Whole gradients (`what="grads"`) or weights by canonical name."""
    out: dict[str, torch.Tensor] = {}
    for part in plan.model_parts:
        seen: set[int] = set()
        for name, param in part.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            tensor = param.grad if what == "grads" else param
            if tensor is None:
                continue
            tensor = full(tensor).detach().clone()  # a collective for DTensors: same order on every rank
            out[part.canonical_name(name) if isinstance(part, Transformer) else name] = tensor
    return out


def reference(cfg: Config, steps, family: str = "") -> tuple[list[float], dict[str, torch.Tensor], list[float],
                                                          dict[str, torch.Tensor]]:
    model = new_model(cfg, family)
    if cfg.train.fp8 != "off":
        from meshformer.parallel.float8 import apply_float8

        apply_float8(model, cfg.train.fp8, emulate=True)
        if cfg.train.fp8 == "tensorwise":
            steps = [[piece for batch in micro for piece in rank_pieces(cfg, batch)] for micro in steps]
    if cfg.model.moe.n_experts and cfg.parallel.pp > 1:  # MoE balance statistics are per pipeline microbatch
        steps = [[piece for batch in micro for piece in pipeline_pieces(cfg, batch)] for micro in steps]
    plan = ParallelModel(model, plain_loss_fn(cfg.train.label_smoothing, cfg.train.z_loss), torch.device("cpu"))
    losses, grads, norms, counts = train_steps(plan, steps, 0, 1, cfg.optim.name, cfg.optim.qk_clip_threshold)
    return losses, grads, norms, counts


def rank_pieces(cfg: Config, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The pieces of a micro-batch that data-parallel ranks and pipeline microbatches run separately.

    Tensorwise FP8 scales each activation by its amax over the tensor at hand, so a layout that splits the batch
    (data or pipeline parallel) quantises differently from one process on the whole batch; a reference running
    the same pieces one by one (their losses and gradients add up) quantises exactly as the layout does.
    """
    from meshformer.parallel_dims import n_microbatches

    p = cfg.parallel
    dp = p.dp_replicate * p.dp_shard
    n_mb = n_microbatches(cfg) if p.pp > 1 else 1
    shards = [{k: v.chunk(dp)[r] for k, v in batch.items()} for r in range(dp)]
    return [{k: v.tensor_split(n_mb)[m] for k, v in shard.items()} for shard in shards for m in range(n_mb)]


def pipeline_pieces(cfg: Config, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The pipeline microbatches of a micro-batch as the layout runs them: microbatch j of every data-parallel shard
    together (their MoE statistics are summed over the data-parallel ranks)."""
    from meshformer.parallel_dims import n_microbatches

    p = cfg.parallel
    shards = [{k: v.chunk(p.dp_replicate * p.dp_shard)[r] for k, v in batch.items()}
              for r in range(p.dp_replicate * p.dp_shard)]
    n_mb = n_microbatches(cfg)
    return [{k: torch.cat([s[k].tensor_split(n_mb)[m] for s in shards]) for k in batch} for m in range(n_mb)]


def compare(cfg: Config, steps, result, family: str = "", weights: dict[str, torch.Tensor] | None = None,
            index_losses: list[list[dict[str, tuple[float, float]]]] | None = None,
            mtp_losses: list[dict[str, float]] | None = None) -> dict[str, Any]:
    ref_losses, ref_grads, ref_norms, ref_counts = reference(cfg, steps, family)
    index_rel, index_ref = index_loss_rel(index_losses or [], ref_counts["index_losses"])  # type: ignore[arg-type]
    ref_weights = ref_counts["weights"]
    losses, grads, norms = result
    grad_rel, checked, worst = 0.0, set(), ""
    # Floor the scale: a key-projection bias has an exactly-zero true gradient (softmax ignores a per-query
    # shift), so its reference is pure rounding noise; compare it against the model's gradient scale instead.
    floor = 1e-4 * max(g.abs().max().item() for g in ref_grads.values())
    for name, grad in grads.items():
        ref = ref_grads[name]
        scale = max(ref.abs().max().item(), floor)
        rel = (grad - ref).abs().max().item() / scale
        if rel > grad_rel:
            grad_rel, worst = rel, name
        checked.add(name)
    # Muon rows: the matrices Muon updated, after both steps: max over them of max|w - w_ref| / max|w_ref|. The rest
    # steps with AdamW, checked as in every AdamW row: AdamW divides each element by its own gradient's RMS, so
    # elements with a near-zero gradient take rounding noise as full-size steps (up to 1.4e-4 apart after two steps
    # in decoder/fsdp), while Newton-Schulz, a smooth function of the whole matrix, keeps them ~5e-6 apart.
    weight_rel, weight_worst = max([(((w - ref_weights[n]).abs().max() / ref_weights[n].abs().max()).item(), n)
                                    for n, w in (weights or {}).items() if is_muon_parameter(n, w)],
                                   default=(None, ""))
    # each multi-token prediction module's mean loss per step (mtp/loss_<k>), and its parameters the layout left
    # without gradient (a module cut off from the objective would still leave the main loss equal)
    ref_mtp = ref_counts["mtp_losses"]
    mtp_rel = [abs(ours.get(key, float("inf")) - value) / abs(value)
               for ours, ref in zip(mtp_losses or ref_mtp, ref_mtp, strict=True) for key, value in ref.items()]
    return {
        "mtp_rel": mtp_rel,
        "mtp_losses": ref_counts["mtp_losses"],
        "mtp_without_grad": sorted(n for n, g in grads.items() if n.startswith("mtp_layers.") and not g.any()),
        "weight_rel": weight_rel,
        "weight_worst": weight_worst,
        "loss_rel": [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)],
        "grad_rel": grad_rel,
        "worst": worst,
        "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
        "checked": sorted(checked),
        "reference_params": sorted(ref_grads),
        "losses": losses,
        "qk_clip_reference": ref_counts["qk_clip"],
        # the csa indexer losses (per step and layer) and their largest difference from one process's; the largest
        # gradient of an indexer's parameter in one process (the term reaches them)
        "index_loss_rel": index_rel,
        "index_loss_reference": index_ref,
        "indexer_grad_max": max((g.abs().max().item() for n, g in ref_grads.items() if ".indexer." in n),
                                default=0.0),
    }


# ----------------------------------------------------------------------------- scenarios

def scenario(name: str) -> tuple[Config, list]:
    """'family/layout' -> config; the layout names the parallel dimensions and the schedule."""
    family, layout = name.split("/")
    parallel: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    model_keys: dict[str, Any] = {}
    for part in layout.split("-"):
        key, _, value = part.partition("=")
        if key in ("fsdp", "dp"):
            parallel["dp_shard"] = int(value or 2)
        elif key == "hsdp":
            parallel["dp_replicate"], parallel["dp_shard"] = 2, 2
        elif key == "tp":
            parallel["tp"] = int(value or 2)
        elif key == "cp":
            parallel["cp"] = int(value or 2)
        elif key == "ulysses":  # parallel.cp_method: all-to-all from sequence shards to head shards and back
            parallel["cp_method"] = "ulysses"
        elif key == "pp":
            parallel["pp"] = int(value or 2)
        elif key == "ep":
            parallel["ep"] = int(value or 2)
        elif key == "sched":
            parallel["pp_schedule"] = value
        elif key == "spr":
            parallel["pp_stages_per_rank"] = int(value)
        elif key == "mb":
            parallel["pp_microbatches"] = int(value)
        elif key == "split":
            parallel["pp_split_points"] = [int(v) for v in value.split(",")]
        elif key == "recompute":
            parallel["recompute"] = value
        elif key == "bf16":
            extra["dtype"] = "bf16"
        elif key == "noreshard":
            parallel["reshard_after_forward"] = False
        elif key == "wholestage":  # PP x FSDP the torch way: stage weights/gradients unsharded across microbatches
            parallel["pp_fsdp_unsharded_microbatches"] = True
        elif key == "mp":  # FSDP all-gathers bf16 parameters, reduces in fp32
            parallel["mixed_precision_param"] = "bf16"
        elif key == "fp8":  # train.fp8 through torchao's emulated float8 (the reference is converted alike)
            extra["fp8"] = value
        elif key == "loss":  # train.loss: the default (auto) is the chunked head loss, vocab-parallel under TP
            extra["loss"] = value
        elif key == "compile":  # per-block torch.compile (the reference runs eager)
            extra["compile"] = "blocks"
        elif key == "padded":  # decoder batches carry a key mask that hides earlier keys too (the first one kept)
            extra["_padded"] = True
        elif key == "rightpad":  # causal batches right-padded: an attention mask False on each sequence's tail
            extra["_right_padded"] = True
        elif key == "leftpad":  # causal batches left-padded: the right-padded rows' masks flipped, their labels too
            extra["_left_padded"] = True
        elif key == "packed":  # model.attention.document_mask: the batches carry packed documents (doc_ids)
            model_keys["attention"] = {"document_mask": True}
        elif key in ("muon", "normuon"):  # optim.name: Muon/NorMuon for the blocks' matrices (the reference alike)
            extra["_muon"] = key
        elif key == "qkclip":  # MuonClip at a threshold that clips some heads of the tiny models (and not others)
            extra["_qk_clip"] = float(value or QK_CLIP_THRESHOLD)
        elif key == "indexloss":  # the csa indexers' objective at this weight (1 by default)
            model_keys["compressed_attention"] = dict(index_loss_weight=float(value or 1.0))
        elif key == "indexwarmup":  # its dense warm-up: only the indexers train
            model_keys["compressed_attention"] = dict(index_loss_weight=1.0)
            model_keys["dsa"] = dict(stage="warmup")
        elif key == "single":
            pass
        else:
            raise ValueError(f"unknown layout part {part!r} in {name!r}")
    parallel.setdefault("dp_shard", 1)
    padded = extra.pop("_padded", False)
    right_padded = extra.pop("_right_padded", False)
    left_padded = extra.pop("_left_padded", False)
    muon = extra.pop("_muon", False)
    qk_clip = extra.pop("_qk_clip", None)
    cfg = make_config(family, parallel, model_keys, **extra)
    if muon:
        cfg.optim.name = muon
    cfg.optim.qk_clip_threshold = qk_clip
    batches = make_batches(cfg, 4)
    if padded:
        g = torch.Generator().manual_seed(5)
        keep = [torch.rand(b["input_ids"].shape, generator=g) > 0.3 for b in batches]
        batches = [{**b, "attention_mask": k.index_fill(1, torch.tensor([0]), True)} for b, k in zip(batches, keep)]
    if right_padded:  # the tail make_batches ignores in the labels is padding
        batches = [{**b, "attention_mask": b["labels"] != IGNORE_INDEX} for b in batches]
    if left_padded:  # as many pads, at each row's start
        masks = [(b["labels"] != IGNORE_INDEX).flip(1) for b in batches]
        batches = [{**b, "attention_mask": m, "labels": b["labels"].flip(1).masked_fill(~m, IGNORE_INDEX)}
                   for b, m in zip(batches, masks, strict=True)]
    return cfg, [batches[0:2], batches[2:4]]


def nan_step_check() -> dict[str, Any]:
    """One rank's NaN gradient under FSDP: the global norm carries it to every rank and every rank skips the update
    (then trains on at the next finite step)."""
    cfg, steps = scenario("decoder/fsdp")
    plan = build_cpu_plan(cfg)
    params = [p for part in plan.model_parts for p in part.parameters()]
    training = harness_step(plan, len(steps), nonfinite_limit=1)
    grad_norm, step_index = plan.grad_norm, [0]

    def one_nan_on_rank_1():
        if step_index[0] == 0 and dist.get_rank() == 1:
            params[-1].grad.to_local().view(-1)[0] = float("nan")  # one element of one shard on one rank
        return grad_norm()

    plan.grad_norm = one_nan_on_rank_1  # type: ignore[method-assign]
    changed = []
    for i, micro in enumerate(steps):
        step_index[0] = i
        before = [full(p).detach().clone() for p in params]
        training.step([{k: v.chunk(plan.dp_size)[plan.dp_rank] for k, v in micro[0].items()}])
        after = [full(p).detach() for p in params]
        changed.append(sum(not torch.equal(a, b) for a, b in zip(after, before)))
    finite = all(bool(torch.isfinite(full(p)).all()) for p in params)
    per_rank: list[Any] = [None] * dist.get_world_size()
    skipped = training.skipped_updates.check(len(steps))
    dist.all_gather_object(per_rank, {"changed": changed, "skipped": skipped, "finite": finite})
    return {"ranks": per_rank, "params": len(params)}


def group_counts() -> list[int]:
    """Process groups each rank created so far: new_group is collective and names groups by a per-rank counter, so
    a rank that created fewer (e.g. a pipeline stage without MoE layers) would hang the next group's rendezvous."""
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, dist.distributed_c10d._world.group_count)
    return counts


def vocab_parallel_loss_check() -> dict[str, Any]:
    """The vocab-parallel cross-entropy alone against cross_entropy_sum on full logits (world = tp)."""
    from meshformer.loss.cross_entropy import cross_entropy_sum
    from meshformer.loss.vocab_parallel import vocab_parallel_cross_entropy

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(6, 5, VOCAB, generator=g)).requires_grad_()
    labels = torch.randint(0, VOCAB, (6, 5), generator=g)
    labels[0, :2] = IGNORE_INDEX
    worst_loss = worst_grad = 0.0
    for smoothing, z_loss in ((0.0, 0.0), (0.1, 0.0), (0.2, 1e-3)):
        ref = cross_entropy_sum(logits, labels, label_smoothing=smoothing, z_loss=z_loss)
        (ref_grad,) = torch.autograd.grad(ref, logits)
        shard = VOCAB // world
        local = logits.detach()[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, labels, group=dist.group.WORLD, vocab_start=rank * shard,
                                            vocab_size=VOCAB, label_smoothing=smoothing, z_loss=z_loss)
        loss.backward()
        worst_loss = max(worst_loss, abs(loss.item() - ref.item()) / abs(ref.item()))
        expected = ref_grad[..., rank * shard:(rank + 1) * shard]
        worst_grad = max(worst_grad, ((local.grad - expected).abs().max() / expected.abs().max()).item())
    return {"loss_rel": [worst_loss], "grad_rel": worst_grad, "norm_rel": 0.0, "missing": [], "checked": 1,
            "group_counts": group_counts(), "mtp_rel": [], "mtp_without_grad": [],
            "worst": "logits", "kernels": {}}


FLOAT8_GATHERS = [0]  # float8 all-gathers of torchao tensors (tensor-parallel activations and gradients) so far
FLOAT8_AMAX_REDUCES = [0]  # all-reduces of one tensor's amax by torchao (dynamic float8 scaling) so far


def gather_float8_as_bytes() -> None:
    """gloo has no float8 type ("Invalid scalar type"); NCCL all-gathers float8 as bytes (torch maps it to
    ncclUint8). Make torchao's float8 all-gather (tensor-parallel activations and gradients) do the same here."""
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

    ops = torch.ops._c10d_functional
    gather = ops.all_gather_into_tensor.default
    original = FLOAT8_OPS_TABLE[gather]
    if getattr(original, "as_bytes", False):
        return

    def as_bytes(data: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        FLOAT8_GATHERS[0] += 1
        out = gather(data.view(torch.uint8), *args, **kwargs)
        return ops.wait_tensor.default(out).view(data.dtype)  # waited here; the later wait finds nothing pending

    def patched(aten_op, args, kwargs=None):
        return original(as_bytes, args, kwargs)

    patched.as_bytes = True  # type: ignore[attr-defined]
    FLOAT8_OPS_TABLE[gather] = patched

    from torchao.float8 import float8_utils

    reduce = float8_utils.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        FLOAT8_AMAX_REDUCES[0] += 1
        return reduce(*args, **kwargs)

    float8_utils.all_reduce = counted


def run_scenario(name: str) -> dict[str, Any]:
    if name == "loss/vocab_parallel":
        return vocab_parallel_loss_check()
    if name == "skip/nan":
        return nan_step_check()
    if name.startswith("materialize:"):
        from helpers.materialize import materialize_check

        return materialize_check(name.removeprefix("materialize:"))
    cfg, steps = scenario(name)
    if cfg.train.fp8 != "off":  # CPU: torchao's emulation stands in for FP8 tensor cores
        from meshformer.parallel import float8

        float8.fp8_supported = lambda device: True
        gather_float8_as_bytes()
    family = name.split("/")[0]
    if cfg.train.compile:  # compiled afresh: no sizes made dynamic by an earlier scenario's shapes
        torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plan = build_cpu_plan(cfg, new_model(cfg, family))
    gathers_before = FLOAT8_GATHERS[0]
    with counted_orthogonalised_matrices() as ns_matrices:
        *result, counts = train_steps(plan, steps, plan.dp_rank, plan.dp_size, cfg.optim.name,
                                      cfg.optim.qk_clip_threshold)
    float8_gathers = FLOAT8_GATHERS[0] - gathers_before
    # the csa indexer losses: each tensor-parallel rank's, summed over the ranks that hold other tokens or stages
    index_losses: list[Any] = [None] * dist.get_world_size()
    tp_rank = getattr(getattr(plan, "meshes", None), "tp_rank", 0)
    dist.all_gather_object(index_losses, (tp_rank, counts.pop("index_losses")))
    by_tp_rank: dict[int, list[dict[str, tuple[float, float]]]] = {}
    for rank_tp, per_step in index_losses:
        summed = by_tp_rank.setdefault(rank_tp, [{} for _ in per_step])
        for into, step in zip(summed, per_step, strict=True):
            for layer, (kl, count) in step.items():
                old = into.get(layer, (0.0, 0.0))
                into[layer] = (old[0] + kl, old[1] + count)
    with counted_orthogonalised_matrices() as ns_reference:
        report = compare(cfg, steps, result, family, counts.pop("weights"), list(by_tp_rank.values()),
                         counts.pop("mtp_losses"))
    # Muon: matrices this rank orthogonalised (each matrix once over all ranks), and one process's count
    report["ns_matrices"] = [None] * dist.get_world_size()
    dist.all_gather_object(report["ns_matrices"], ns_matrices[0])
    report["ns_matrices_reference"] = ns_reference[0]
    # Union of what every rank checked: each pipeline stage checks its own parameters.
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (report["grad_rel"], report["checked"], report["worst"], report["weight_rel"]))
    report["grad_rel"], _, report["worst"], _ = max(gathered, key=lambda g: g[0])
    # each pipeline stage compares its own weights (None: none compared, as for AdamW rows)
    report["weight_rel"] = max((g[3] for g in gathered if g[3] is not None), default=None)
    checked = set().union(*(set(c) for _, c, _, _ in gathered))
    without_grad: list[Any] = [None] * dist.get_world_size()  # each pipeline stage its own modules
    dist.all_gather_object(without_grad, report["mtp_without_grad"])
    report["mtp_without_grad"] = sorted(set().union(*without_grad))
    report["missing"] = sorted(set(report.pop("reference_params")) - checked)
    report["checked"] = len(checked)
    report["kernels"] = plan.report
    report["float8_gathers"] = float8_gathers
    report["group_counts"] = group_counts()
    # torch.compile's graph breaks by reason (a compiled block should be whole: a break inside a recomputed one sends
    # it back to eager)
    report["graph_breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
    if cfg.model.moe.n_experts:  # what the run log shows of the MoE layers: every layer, whichever stage holds it
        report["moe_scalars"] = sorted(plan.moe_scalars())
    if family in SELECTION_BIAS:  # the step loads (global: summed over every rank) of this rank's first MoE layer
        report["expert_loads"] = plan.moe_layers[0].tokens_this_step.tolist()
    report |= counts
    return report


def worker(rank: int, world: int, port: int, names: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    faulthandler.enable()  # a crash in native code names its Python stack (and the scenario printed below)
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("HARNESS_TIMEOUT", 90))))
    results: dict[str, Any] = {}
    for name in names:
        print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
        try:
            results[name] = run_scenario(name)
        except Exception as err:  # record and go on: one broken layout should not hide the others
            results[name] = {"error": f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}"}
            print(results[name]["error"], file=sys.stderr, flush=True)
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()  # gloo sometimes aborts at exit without it
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the work is done and written: skip interpreter teardown, where gloo has aborted before


# Scenarios per set of processes on 4 or more ranks. Each gloo group a scenario's meshes create keeps a TCP loop
# and two work threads until its process exits (destroying the groups breaks torch's cached meshes): 43 scenarios on
# 4 ranks piled up ~900 threads per rank, a load average near 400 on 2 cores.
SCENARIOS_PER_SPAWN = 12


def launch(world: int, names: list[str]) -> dict[str, Any]:
    """Run the scenarios on `world` spawned processes (fresh ones every SCENARIOS_PER_SPAWN from 4 ranks up);
    returns rank 0's report per scenario."""
    per_spawn = SCENARIOS_PER_SPAWN if world >= 4 else max(1, len(names))
    reports: dict[str, Any] = {}
    for start in range(0, len(names), per_spawn):
        reports |= _spawn(world, names[start:start + per_spawn])
    return reports


def _spawn(world: int, names: list[str]) -> dict[str, Any]:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Inductor compiles in each rank's own process, not with a worker pool per rank: ranks x pool processes on a
    # 2-core machine
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.start_processes(worker, args=(world, free_port(), names, out), nprocs=world, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("names", nargs="+")
    args = parser.parse_args()
    for name, report in launch(args.world, args.names).items():
        if "error" in report:
            print(f"{name}: ERROR {report['error']}")
        else:
            print(f"{name}: loss_rel={max(report['loss_rel']):.2e} "
                  f"mtp_rel={max(report['mtp_rel'], default=0.0):.2e} grad_rel={report['grad_rel']:.2e} "
                  f"weight_rel={report['weight_rel']} ({report.get('weight_worst')}) "
                  f"ns_matrices={report['ns_matrices']} of {report['ns_matrices_reference']} "
                  f"({report['worst']}) norm_rel={report['norm_rel']:.2e} checked={report['checked']} "
                  f"missing={report['missing']} group_counts={report['group_counts']} "
                  f"graph_breaks={sum(report['graph_breaks'].values())}"
                  + (f" index_loss_rel={report['index_loss_rel']:.2e} indexer_grad_max="
                     f"{report['indexer_grad_max']:.2e}" if report["index_loss_rel"] is not None else ""))


if __name__ == "__main__":
    main()
