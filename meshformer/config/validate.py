"""`validate`: every cross-field check of a config tree, before any work starts; each message names the key
and the fix. Family-dependent checks ask the family's spec (model/families/); nothing here names a family.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from meshformer.config.migrate import get_dotted
from meshformer.config.parse import parse_size
from meshformer.config.sections import CheckpointConfig, Config, DataConfig
from meshformer.errors import ConfigError
from meshformer.model.components import CHANNEL_MIXERS, TOKEN_MIXERS
from meshformer.model.components.base import Component
from meshformer.model.config import ModelConfig
from meshformer.model.families import get_family_spec
from meshformer.optim import OPTIMIZERS


def validate(cfg: Config) -> None:
    """Check cross-field consistency; every message names the key and the fix."""
    m, d, t = cfg.model, cfg.data, cfg.train
    _finite(cfg)
    _not_empty(cfg, ["logging.run_dir", "data.corpus", "data.tokenizer", "data.text_field", "train.device"])
    _positive(cfg, ["model.vocab_size", "model.d_model", "model.attention.n_heads", "model.ffn.d_ff",
                    "model.max_seq_len",
                    "data.seq_len", "data.batch_size", "train.steps", "train.grad_accum", "optim.lr",
                    "logging.log_interval", "model.norm.eps", "model.rope.theta", "model.init.std",
                    "data.span_mean_length", "parallel.timeout_s"])
    if m.attention.head_dim is not None and m.attention.head_dim <= 0:
        raise ConfigError(f"model.attention.head_dim={m.attention.head_dim} must be positive "
                          "(or omitted: d_model / n_heads)")
    if m.attention.head_dim is not None and m.attention.head_dim > m.d_model and _reads_head_dim(m):
        raise ConfigError(f"model.attention.head_dim={m.attention.head_dim} is wider than model.d_model={m.d_model}",
                          "a head's queries, keys and values are projections of the d_model-wide residual stream and "
                          "span at most d_model directions; use head_dim <= d_model (Gemma 2 9B: 256 at d_model=3584)")
    if m.attention.head_dim is None and m.d_model % m.attention.n_heads and _reads_head_dim(m):
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.attention.n_heads="
                          f"{m.attention.n_heads}; "
                          "choose n_heads that divides d_model, or set model.attention.head_dim")
    a = m.attention
    if a.n_kv_heads is not None and (a.n_kv_heads <= 0 or a.n_heads % a.n_kv_heads):
        raise ConfigError(f"model.attention.n_heads={a.n_heads} is not divisible by model.attention.n_kv_heads="
                          f"{a.n_kv_heads}; "
                          "n_kv_heads must divide n_heads (1 = multi-query)")
    if m.position == "rope" and m.attention_head_dim % 2 and _reads_head_dim(m):  # other widths: the kind's check
        raise ConfigError(f"RoPE needs an even head dimension, got {m.attention_head_dim}; set "
                          "model.attention.head_dim "
                          "(or d_model / n_heads) even")
    rotated = int(m.attention_head_dim * m.rope.partial_factor)
    if not 0 < m.rope.partial_factor <= 1 or (m.position == "rope" and _reads_head_dim(m)
                                               and (rotated < 2 or rotated % 2)):
        raise ConfigError(f"model.rope.partial_factor={m.rope.partial_factor} must rotate an even number of each "
                          f"head's {m.attention_head_dim} dimensions (it gives {rotated})",
                          "choose a factor in (0, 1] with int(head_dim x factor) even, e.g. 0.25 or 0.5")
    _check_rope_scaling(cfg)
    _check_layer_options(cfg)
    if m.position == "t5_relative" and (a.relative_buckets < 4 or a.relative_max_distance <= a.relative_buckets // 2):
        raise ConfigError(f"model.attention.relative_buckets={a.relative_buckets} / "
                          f"model.attention.relative_max_distance={a.relative_max_distance}: t5_relative needs at "
                          "least 4 buckets and a max distance above "
                          "relative_buckets / 2 (the exactly bucketed range); T5 uses 32 and 128")
    _check_family(cfg)
    _check_moe(cfg)
    _check_mtp(cfg)
    _check_residual(cfg)
    if m.attention.window is not None:
        if m.attention.window <= 0:
            raise ConfigError("model.attention.window must be positive (or omitted for full attention)")
        if m.attention.window > d.seq_len:
            raise ConfigError(f"model.attention.window={m.attention.window} is larger than data.seq_len="
                              f"{d.seq_len}; use a smaller window or remove it for full attention")
    if m.cross_downsample < 1:
        raise ConfigError("model.cross_downsample must be >= 1 (1 disables pooling)")
    if not 0 <= m.dropout < 1 or not 0 <= m.attention.dropout < 1:
        raise ConfigError("model.dropout and model.attention.dropout must lie in [0, 1)")
    if not 0 <= t.label_smoothing < 1:
        raise ConfigError("train.label_smoothing must lie in [0, 1)")
    if not 0 < d.mlm_probability < 1 or not 0 < d.span_noise_density < 1:
        raise ConfigError("data.mlm_probability and data.span_noise_density must lie in (0, 1)")
    _check_training_ranges(cfg)
    if cfg.schedule.name == "noam" and cfg.schedule.warmup_steps == 0:
        raise ConfigError("schedule.name='noam' needs schedule.warmup_steps > 0")
    if cfg.profile.start_step < 0 or cfg.profile.steps <= 0:
        raise ConfigError(f"profile.start_step={cfg.profile.start_step} and profile.steps={cfg.profile.steps}: "
                          "start_step must be >= 0 (0: off) and steps positive, e.g. profile.start_step=10 "
                          "profile.steps=3")
    _check_device(t.device)
    if t.dtype == "bf16" and not t.device.startswith(("auto", "cpu", "cuda")):
        raise ConfigError(f"train.dtype='bf16' is not supported on device {t.device!r}; use fp32")
    _check_shard_size(cfg.checkpoint.max_shard_size)
    if cfg.checkpoint.init_from and not cfg.checkpoint.init_from.startswith("hf:"):
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from!r} is not a source meshformer starts from",
                          "write hf:PATH for a Hugging Face model folder (config.json + safetensors)")
    _check_fault_tolerance(cfg)


def validate_model(model: ModelConfig, source: str) -> None:
    """The trainer's own checks of a model that comes from elsewhere (an imported Hugging Face folder): `validate`
    on the config of a run started from `source` (checkpoint.init_from), at the model's full context."""
    data = DataConfig(seq_len=model.max_seq_len, target_len=min(DataConfig.target_len, model.max_seq_len))
    validate(Config(model=model, data=data, checkpoint=CheckpointConfig(init_from=source)))


def _check_device(spec: str) -> None:
    """train.device names a device torch knows ("auto": the local rank's GPU, else the CPU)."""
    if spec == "auto":
        return
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type == "meta":  # meta tensors hold no values: nothing would train
        raise ConfigError(f"train.device={spec!r} is not a device", "use 'auto', 'cpu', 'cuda' or 'cuda:N'")


def _check_family(cfg: Config) -> None:
    """What the family's spec asks of the config: a registered name, its objectives, positive stack depths,
    the target stream of a source/target family, and the family's own checks (`FamilySpec.check`)."""
    m, d = cfg.model, cfg.data
    spec = get_family_spec(m.family)
    if cfg.objective not in spec.objectives:
        raise ConfigError(f"train.objective={cfg.objective!r} does not fit model.family={m.family!r}; "
                          f"use one of {sorted(spec.objectives)} or 'auto'")
    for stack in spec.stacks:
        if (depth := stack.count(m)) <= 0:
            raise ConfigError(f"{stack.depth_key} must be positive, got {depth} ({stack.name} stack of "
                              f"family {m.family!r})")
    lengths = [("data.seq_len", d.seq_len)]
    if spec.seq2seq:
        if d.target_len <= 0:
            raise ConfigError(f"data.target_len must be positive for a source/target family ({m.family!r}), "
                              f"got {d.target_len}")
        lengths.append(("data.target_len", d.target_len))
    elif m.cross_downsample > 1:
        raise ConfigError(f"model.cross_downsample only applies to a family whose decoder cross-attends an "
                          f"encoder (not {m.family!r}); leave it at 1")
    if m.attention.document_mask and cfg.objective != "causal":
        raise ConfigError(f"model.attention.document_mask needs the causal objective (packed documents, each "
                          "sample's doc_ids), "
                          f"not {cfg.objective!r}; leave it false for model.family={m.family!r}")
    key, longest = max(lengths, key=lambda item: item[1])
    if m.position in ("learned", "sinusoidal", "rope") and longest > m.max_seq_len:
        raise ConfigError(f"{key}={longest} exceeds model.max_seq_len={m.max_seq_len}; "
                          "raise model.max_seq_len or shorten data.seq_len")
    if spec.check is not None:
        spec.check(m)


def _check_moe(cfg: Config) -> None:
    """The mixture-of-experts keys (model/moe.py); none matters while model.moe.n_experts = 0."""
    m = cfg.model
    if m.moe.n_experts < 0:
        raise ConfigError(f"model.moe.n_experts={m.moe.n_experts} is negative",
                          "use 0 (dense) or the number of experts")
    if m.moe.shared_expert_gate and m.moe.n_shared_experts == 0:
        raise ConfigError("model.moe.shared_expert_gate=true gates the shared experts, but model.moe.n_shared_experts "
                          "= 0", "set model.moe.n_shared_experts (e.g. 1), or drop shared_expert_gate")
    if m.moe.n_experts == 0:
        for key in ("router_bias", "expert_linear_bias"):
            if getattr(m.moe, key):
                raise ConfigError(f"model.moe.{key}=true needs experts, but model.moe.n_experts=0",
                                  f"set model.moe.n_experts, or drop model.moe.{key}")
        return
    if not 1 <= m.moe.experts_per_token <= m.moe.n_experts:
        raise ConfigError(f"model.moe.experts_per_token={m.moe.experts_per_token} must lie in [1, model.moe.n_experts="
                          f"{m.moe.n_experts}]", "choose how many experts each token uses, e.g. 2")
    for key in ("d_ff", "n_shared_experts", "capacity_factor", "aux_loss", "router_z_loss",
                "router_bias_update_rate"):
        if getattr(m.moe, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(m.moe, key)} is negative", "use a value >= 0 (0: the default)")
    if not m.moe.router_scale > 0:
        raise ConfigError(f"model.moe.router_scale={m.moe.router_scale} must be positive",
                          "use 1.0 (weights as routed) or DeepSeek-V3's 2.5")
    stacks = get_family_spec(m.family).stacks
    # a model from an HF folder (init_from) is what the folder holds, a Qwen3-MoE with every block dense included
    if not cfg.checkpoint.init_from and not any(m.is_moe(i) for stack in stacks for i in range(stack.count(m))):
        depths = " / ".join(f"{stack.count(m)}-layer {stack.name}" for stack in stacks)
        raise ConfigError(f"model.moe.n_experts={m.moe.n_experts}, but no block of the {depths} stack is MoE "
                          f"(model.mlp_types={m.mlp_types}): the model would train dense",
                          'make some entries of model.mlp_types "moe", or set model.moe.n_experts=0 for a dense model')
    groups = m.moe.router_groups
    if groups < 1 or m.moe.n_experts % groups:
        raise ConfigError(f"model.moe.router_groups={groups} does not divide model.moe.n_experts={m.moe.n_experts}",
                          "use a divisor of n_experts (1: no group-limited routing)")
    if not 1 <= m.moe.router_groups_per_token <= groups:
        raise ConfigError(f"model.moe.router_groups_per_token={m.moe.router_groups_per_token} must lie in [1, "
                          f"model.moe.router_groups={groups}]", "choose how many expert groups a token may use")
    if m.moe.router_groups_per_token * (m.moe.n_experts // groups) < m.moe.experts_per_token:
        raise ConfigError(f"model.moe.router_groups_per_token={m.moe.router_groups_per_token} groups of "
                          f"{m.moe.n_experts // groups} experts hold fewer than model.moe.experts_per_token="
                          f"{m.moe.experts_per_token}", "raise router_groups_per_token or lower experts_per_token")


def _check_mtp(cfg: Config) -> None:
    """[model.mtp]: module k predicts the token k + 1 ahead (labels shifted by k, model/mtp.py), so within a sequence
    of data.seq_len targets only modules k < seq_len ever see one; the modules follow a causal decoder-only stack."""
    m = cfg.model
    depth, spec = m.mtp.depth, get_family_spec(m.family)
    if depth < 0:
        raise ConfigError(f"model.mtp.depth={depth} is negative", "use 0 (no multi-token prediction) or the number "
                          "of extra tokens to predict, e.g. 1 (DeepSeek-V3)")
    if m.mtp.loss_weight < 0:
        raise ConfigError(f"model.mtp.loss_weight={m.mtp.loss_weight} is negative (it would push the predictions "
                          "away from their targets)", "use a weight >= 0, e.g. the default 0.3")
    if depth == 0:
        return
    if not spec.has_decoder or spec.seq2seq:
        raise ConfigError(f"model.mtp.depth={depth}: multi-token prediction follows a decoder-only stack, but "
                          f"model.family={m.family!r}", "set model.mtp.depth=0, or use family='decoder'")
    for key, kind, registry in (("layer_type", m.mtp.layer_type, TOKEN_MIXERS),
                                ("mlp_type", m.mtp.mlp_type, CHANNEL_MIXERS)):
        kinds = [name for name, k in registry.items() if k.selectable]
        if kind and kind not in kinds:
            raise ConfigError(f"model.mtp.{key}={kind!r} is not a kind meshformer builds",
                              f"use one of {' / '.join(repr(k) for k in kinds)}, or \"\" for the last block's")
        if kind:
            registry[kind].check(m)
    if depth >= cfg.data.seq_len:
        raise ConfigError(f"model.mtp.depth={depth}: module k predicts the token k + 1 ahead, so with data.seq_len="
                          f"{cfg.data.seq_len} modules past {cfg.data.seq_len - 1} would never see a target",
                          f"use model.mtp.depth < data.seq_len (at most {cfg.data.seq_len - 1}; DeepSeek-V3 uses 1)")


def _check_residual(cfg: Config) -> None:
    """[model.residual]: mHC's streams and Sinkhorn iterations."""
    m, r = cfg.model, cfg.model.residual
    if r.kind != "mhc":
        return
    if r.streams < 1:
        raise ConfigError(f"model.residual.streams={r.streams} must be at least 1", "use 4 (DeepSeek-V4)")
    if r.sinkhorn_iters < 1:
        raise ConfigError(f"model.residual.sinkhorn_iters={r.sinkhorn_iters} must be at least 1",
                          "use 20 (DeepSeek-V4)")
    if not r.eps > 0:
        raise ConfigError(f"model.residual.eps={r.eps} must be positive", "use 1e-6 (DeepSeek-V4)")
    if m.norm.position not in ("pre", "sandwich"):
        raise ConfigError(f"model.norm.position={m.norm.position!r} with model.residual.kind='mhc': each branch reads "
                          "a normed mix of the streams, so its norm comes before the branch",
                          "use model.norm.position='pre' (DeepSeek-V4) or 'sandwich'")


def _check_rope_scaling(cfg: Config) -> None:
    """The rope_* keys of a scaled RoPE, with the ranges Hugging Face accepts."""
    m = cfg.model
    if m.rope.scaling == "none":
        return
    if m.position != "rope":
        raise ConfigError(f"model.rope.scaling={m.rope.scaling!r} rescales RoPE but model.position={m.position!r}; "
                          "set model.position='rope' or model.rope.scaling='none'")
    if not m.rope.factor >= 1:
        raise ConfigError(f"model.rope.factor={m.rope.factor} must be >= 1 (e.g. 8 for Llama 3.1)")
    if m.rope.scaling == "linear":
        return
    if m.rope.original_max_seq_len is None or m.rope.original_max_seq_len <= 0:
        raise ConfigError(f"model.rope.scaling={m.rope.scaling!r} needs model.rope.original_max_seq_len, the "
                          "pretraining context length (original_max_position_embeddings; 8192 for Llama 3.1)")
    if m.rope.scaling == "llama3" and not 0 < m.rope.low_freq_factor < m.rope.high_freq_factor:
        raise ConfigError(f"model.rope.low_freq_factor={m.rope.low_freq_factor} and model.rope.high_freq_factor="
                          f"{m.rope.high_freq_factor}: need 0 < low < high (Llama 3.1: 1 and 4)")
    if m.rope.scaling == "yarn":
        if not 0 < m.rope.beta_slow <= m.rope.beta_fast:  # equal: a one-dimension ramp (Kimi K2: 1 and 1)
            raise ConfigError(f"model.rope.beta_slow={m.rope.beta_slow} and model.rope.beta_fast={m.rope.beta_fast}: "
                              "need 0 < beta_slow <= beta_fast (YaRN: 1 and 32)")
        if m.rope.attention_factor is not None and m.rope.attention_factor <= 0:
            raise ConfigError(f"model.rope.attention_factor={m.rope.attention_factor} must be positive (or omitted: "
                              "0.1 * ln(factor) + 1)")


def _check_layer_options(cfg: Config) -> None:
    """The per-layer attention pattern, soft-capping and norm options (Gemma, OLMo 2)."""
    m = cfg.model
    _check_block_types(cfg)
    sliding = _any_block_windowed(m)
    if m.rope.local_theta is not None and (m.position != "rope" or not sliding or m.rope.local_theta <= 0):
        raise ConfigError(f"model.rope.local_theta={m.rope.local_theta} is the sliding_attention blocks' RoPE base, "
                          "but "
                          "needs model.position='rope', sliding_attention blocks (model.layer_types) and a positive "
                          "value", "set them (Gemma 3: rope.local_theta=10000) or drop it")
    for key, value in (("attention.softcap", m.attention.softcap), ("logit_softcap", m.logit_softcap)):
        if value is not None and not value > 0:
            raise ConfigError(f"model.{key}={value} must be positive", "give a cap such as 30.0, or drop it for none")
    if m.norm.weight_offset and m.norm.kind != "rmsnorm":
        raise ConfigError(f"model.norm.weight_offset={m.norm.weight_offset} scales RMSNorm by (offset + weight), but "
                          f"model.norm.kind={m.norm.kind!r}", "set model.norm.kind='rmsnorm' or leave the offset at 0")
    if m.norm.by_kind:
        kinds = set(m.layer_types or ["full_attention"])
        if unused := sorted(set(m.norm.by_kind) - kinds):
            raise ConfigError(f"model.norm.by_kind names {unused[0]!r}, which no block of model.layer_types="
                              f"{sorted(kinds)} is", "name the token-mixer kinds of model.layer_types, or drop it")
        if m.norm.position == "sandwich":
            raise ConfigError("model.norm.by_kind cannot mix the sandwich position (two norms per sub-layer) with "
                              "others", "use pre, post or post_sublayer in model.norm.position")
    if m.ffn.activation == "swiglu_clamped" and not (m.ffn.swiglu_limit > 0 and m.ffn.swiglu_alpha > 0):
        raise ConfigError(f"model.ffn.swiglu_limit={m.ffn.swiglu_limit} and model.ffn.swiglu_alpha="
                          f"{m.ffn.swiglu_alpha} must be positive", "gpt-oss: swiglu_limit=7.0, swiglu_alpha=1.702")
    if m.ffn.activation == "swiglu_limited" and not m.ffn.swiglu_limit > 0:
        raise ConfigError(f"model.ffn.swiglu_limit={m.ffn.swiglu_limit} must be positive",
                          "DeepSeek-V4: swiglu_limit=10.0")
    if m.attention.qk_norm_scope != "head" and not m.attention.qk_norm:
        raise ConfigError(f"model.attention.qk_norm_scope={m.attention.qk_norm_scope!r} has no QK-norm to place",
                          "set model.attention.qk_norm=true, or drop qk_norm_scope")


def _check_block_types(cfg: Config) -> None:
    """model.layer_types / model.mlp_types: registered kinds (model/components/), one per block or a pattern no longer
    than a stack, and the keys each kind named needs (its `check`: a window for sliding_attention, experts for moe)."""
    m = cfg.model
    deepest = max(stack.count(m) for stack in get_family_spec(m.family).stacks)
    registries: tuple[tuple[str, list[str], Mapping[str, Component]], ...] = (
        ("layer_types", m.layer_types, TOKEN_MIXERS), ("mlp_types", m.mlp_types, CHANNEL_MIXERS))
    for key, values, registry in registries:
        kinds = [name for name, kind in registry.items() if kind.selectable]
        if wrong := [v for v in values if v not in kinds]:
            raise ConfigError(f"model.{key} holds {wrong[0]!r}, not a kind meshformer builds",
                              f"use {' / '.join(repr(k) for k in kinds)} per block (or a shorter repeated pattern)")
        if len(values) > deepest:
            raise ConfigError(f"model.{key} has {len(values)} entries but the deepest stack has {deepest} blocks",
                              "give one entry per block, or a shorter pattern that repeats over the stack")
    for _, values, registry in registries:
        for name in dict.fromkeys(values):
            registry[name].check(m)
    if m.attention.window is not None and not _any_block_windowed(m):  # no block's kind reads the window
        raise ConfigError(f"model.attention.window={m.attention.window} is the sliding_attention blocks' window, but "
                          "model.layer_types has none", 'set model.layer_types = ["sliding_attention"] (every block) '
                          'or a pattern such as ["sliding_attention", "full_attention"], or drop the window')


def _any_block_windowed(m: ModelConfig) -> bool:
    """Whether a block of some stack attends within a sliding window. Looks at the layer types a stack uses (a pattern
    repeats), not at each block: a config of absurd depth is refused later in one line, not after a loop over it."""
    used: set[str] = set()
    for stack in get_family_spec(m.family).stacks:
        used.update(m.layer_types[:stack.count(m)] if m.layer_types else ["full_attention"])
    return any(TOKEN_MIXERS[name].window(m) is not None for name in used)


def _reads_head_dim(m: ModelConfig) -> bool:
    """Whether a block's token mixer takes its widths from [model.attention] (n_heads, head_dim): every kind but
    those with their own table (mla: [model.mla]); an unknown name is left to _check_block_types."""
    kinds = [TOKEN_MIXERS.get(name) for name in m.layer_types or ["full_attention"]]
    return any(kind is None or kind.section == "attention" for kind in kinds)


def _check_shard_size(size: str) -> None:
    """checkpoint.max_shard_size is read when the final weights are written: check it now, not after training."""
    try:
        n = parse_size(size)
    except ValueError as err:
        raise ConfigError(f"checkpoint.max_shard_size: {err}") from None
    if n <= 0:
        raise ConfigError(f"checkpoint.max_shard_size={size!r} must be positive, e.g. 5GB")


def _check_training_ranges(cfg: Config) -> None:
    """Values that would otherwise train silently wrong (negative rates, no clipping) or fail late (data loading)."""
    sched, optim, t, m = cfg.schedule, cfg.optim, cfg.train, cfg.model
    if sched.warmup_steps < 0:
        raise ConfigError("schedule.warmup_steps must be >= 0")
    if not 0 <= sched.min_lr_ratio <= 1:
        raise ConfigError(f"schedule.min_lr_ratio={sched.min_lr_ratio} must lie in [0, 1] (a fraction of optim.lr)")
    if not 0 <= sched.decay_fraction <= 1:
        raise ConfigError(f"schedule.decay_fraction={sched.decay_fraction} must lie in [0, 1]")
    if sched.name == "wsd" and int(t.steps * (1 - sched.decay_fraction)) < sched.warmup_steps:
        raise ConfigError(f"schedule.name='wsd' would start decaying (step {int(t.steps * (1 - sched.decay_fraction))})"
                          f" before warmup ends (step {sched.warmup_steps}); lower schedule.decay_fraction or "
                          "schedule.warmup_steps")
    if not all(0 <= beta < 1 for beta in optim.betas):
        raise ConfigError(f"optim.betas={list(optim.betas)} must each lie in [0, 1), e.g. [0.9, 0.95]")
    if optim.grad_clip < 0 or optim.weight_decay < 0 or optim.eps <= 0:
        raise ConfigError("optim.grad_clip and optim.weight_decay must be >= 0 (grad_clip = 0 disables clipping) "
                          "and optim.eps > 0")
    for name, spec in OPTIMIZERS.items():
        spec.check(getattr(optim, name))
    if optim.qk_clip_threshold:
        if unclipped := [name for name in dict.fromkeys(m.layer_types) if not TOKEN_MIXERS[name].qk_clip]:
            raise ConfigError(f"optim.qk_clip_threshold is set, but {unclipped[0]} blocks do not use it (they have no "
                              "attention logits for MuonClip to bound)",
                              "drop optim.qk_clip_threshold or use attention or mla blocks")
        if optim.qk_clip_threshold < 0:
            raise ConfigError(f"optim.qk_clip_threshold={optim.qk_clip_threshold} must be > 0",
                              "use e.g. 100 (Kimi K2's), or 0 to turn QK-clip off")
        if m.attention.backend not in ("auto", "blockwise", "math"):
            raise ConfigError(f"optim.qk_clip_threshold needs each head's largest attention logit, which "
                              f"model.attention.backend={m.attention.backend!r} (an SDPA kernel) never computes",
                              "set model.attention.backend to 'auto', 'blockwise' or 'math'")
        if m.attention.qk_norm:
            raise ConfigError("optim.qk_clip_threshold with model.attention.qk_norm=true: QK-norm fixes the queries' "
                              "and keys' scale, so scaling their projections cannot lower a logit",
                              "drop optim.qk_clip_threshold (QK-norm already bounds the logits) or "
                              "model.attention.qk_norm")
    if optim.max_nonfinite_in_a_row < 0:
        raise ConfigError(f"optim.max_nonfinite_in_a_row={optim.max_nonfinite_in_a_row} must be >= 0 (0: stop at the "
                          "first step with an inf/nan gradient norm)")
    if t.z_loss < 0:
        raise ConfigError(f"train.z_loss={t.z_loss} must be >= 0 (0 disables it)")
    if t.eval_interval > 0 and t.eval_batches <= 0:
        raise ConfigError("train.eval_batches must be positive when train.eval_interval > 0 (0 disables evaluation)")
    for key in ("train.eval_interval", "train.sample_interval", "checkpoint.interval", "checkpoint.keep_last",
                "checkpoint.keep_every"):
        if (value := getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])) < 0:
            raise ConfigError(f"{key}={value} is negative", "use a value >= 0 (0 turns it off; keep_last=0 keeps all)")
    if cfg.checkpoint.preempt_check_interval < 1 or not cfg.checkpoint.stop_grace_s >= 0:
        raise ConfigError(f"checkpoint.preempt_check_interval={cfg.checkpoint.preempt_check_interval}, "
                          f"checkpoint.stop_grace_s={cfg.checkpoint.stop_grace_s}: out of range",
                          "use preempt_check_interval >= 1 (steps) and stop_grace_s >= 0 seconds (0: sized to the "
                          "checkpoint)")
    d = cfg.data
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers={d.num_workers} must be >= 0 (0 loads in the training process)")
    if d.shuffle_shards < 1:
        raise ConfigError(f"data.shuffle_shards={d.shuffle_shards} must be >= 1 (shards mixed per shuffle group)")
    if not 0 <= d.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must lie in [0, 1)")
    if d.sources and d.shards:
        raise ConfigError("set either data.shards (one dataset) or [[data.sources]] (a mixture), not both")
    for i, src in enumerate(d.sources):  # (weights are checked with the mixture: data/mixture.py)
        if not src.shards:
            raise ConfigError(f"data.sources[{i}] names no shards", "set shards = <prepared folder or its "
                              "manifest.json> in every [[data.sources]] table")


def _finite(cfg: Config) -> None:
    """No float key takes inf or nan: an inf learning rate trains every weight into nan without an error.
    Mixture weights (data.sources) are checked with the mixture."""
    def check(table: object, prefix: str) -> None:
        for key in dataclasses.fields(table):  # type: ignore[arg-type]
            value = getattr(table, key.name)
            if dataclasses.is_dataclass(value):
                check(value, f"{prefix}{key.name}.")
                continue
            numbers = value if isinstance(value, tuple) else (value,)
            if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
                default = key.default_factory() if callable(key.default_factory) else key.default
                shown, example = (list(x) if isinstance(x, tuple) else x for x in (value, default))
                raise ConfigError(f"{prefix}{key.name}={shown} is not a finite number",
                                  f"give a finite value, e.g. the default {prefix}{key.name}={example}")

    check(cfg, "")


def _not_empty(cfg: Config, keys: list[str]) -> None:
    """Keys where "" has no meaning (an empty logging.run_dir would write the run into the current folder)."""
    for key in keys:
        if not get_dotted(cfg, key).strip():
            raise ConfigError(f"{key} is empty", f"give it a value, e.g. the default {key}={_default(cfg, key)}")


def _positive(cfg: Config, keys: list[str]) -> None:
    for key in keys:
        if (value := get_dotted(cfg, key)) <= 0:
            raise ConfigError(f"{key} must be positive, got {value}", f"e.g. the default {key}={_default(cfg, key)}")


def _default(cfg: Config, key: str) -> object:
    table, _, name = key.rpartition(".")
    return next(f.default for f in dataclasses.fields(get_dotted(cfg, table)) if f.name == name)


def _check_fault_tolerance(cfg: Config) -> None:
    """[fault_tolerance]: counts and timeouts in range, and nothing that would let replica groups' weights drift
    apart (each group must reach bitwise-equal weights from the same averaged gradients)."""
    ft = cfg.fault_tolerance
    if ft.replica_groups < 1 or not 1 <= ft.min_replicas <= ft.replica_groups:
        raise ConfigError(f"fault_tolerance.replica_groups={ft.replica_groups}, fault_tolerance.min_replicas="
                          f"{ft.min_replicas}: out of range",
                          "use replica_groups >= 1 and min_replicas from 1 to replica_groups")
    timeouts = ("timeout_s", "quorum_timeout_s", "heartbeat_timeout_s", "join_timeout_s", "wait_s")
    if bad := [name for name in timeouts if not getattr(ft, name) > 0]:
        raise ConfigError(f"fault_tolerance.{bad[0]}={getattr(ft, bad[0])} must be positive (seconds)")
    if ft.lighthouse and not ft.lighthouse.startswith(("http://", "https://")):
        raise ConfigError(f"fault_tolerance.lighthouse={ft.lighthouse!r} is not an address torchft reaches",
                          "write it as http://HOST:PORT (what `meshformer lighthouse` prints)")
    if ft.sync_every < 1 or not ft.outer_lr > 0 or not 0 <= ft.outer_momentum < 1:
        raise ConfigError(f"fault_tolerance.sync_every={ft.sync_every}, outer_lr={ft.outer_lr}, outer_momentum="
                          f"{ft.outer_momentum}: out of range",
                          "use sync_every >= 1, outer_lr > 0 and outer_momentum in [0, 1)")
    if not ft.enabled:
        return
    # Both update weights from this group's own tokens after the averaged step: the groups would drift apart.
    if cfg.optim.qk_clip_threshold:
        raise ConfigError("optim.qk_clip_threshold with fault_tolerance.enabled: each replica group would clip by "
                          "its own batch's logits and the groups' weights would drift apart",
                          "drop optim.qk_clip_threshold, or fault_tolerance.enabled")
    if cfg.model.moe.router_bias_update_rate > 0:
        raise ConfigError("model.moe.router_bias_update_rate with fault_tolerance.enabled: each replica group would "
                          "update the router biases from its own tokens and the groups' weights would drift apart",
                          "set model.moe.router_bias_update_rate=0, or fault_tolerance.enabled=false")
