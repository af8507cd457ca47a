"""`validate`: every cross-field check of a config tree, before any work starts; each message names the key
and the fix. Family-dependent checks ask the family's spec (model/families/); nothing here names a family.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from meshformer.config.parse import parse_size
from meshformer.config.sections import CheckpointConfig, Config, DataConfig
from meshformer.errors import ConfigError
from meshformer.model.config import ModelConfig
from meshformer.model.families import get_family_spec
from meshformer.model.moe import is_moe_block


def validate(cfg: Config) -> None:
    """Check cross-field consistency; every message names the key and the fix."""
    m, d, t = cfg.model, cfg.data, cfg.train
    _finite(cfg)
    _not_empty(cfg, ["logging.run_dir", "data.corpus", "data.tokenizer", "data.text_field", "train.device"])
    _positive(cfg, ["model.vocab_size", "model.d_model", "model.n_heads", "model.d_ff", "model.max_seq_len",
                    "data.seq_len", "data.batch_size", "train.steps", "train.grad_accum", "optim.lr",
                    "logging.log_interval", "model.norm_eps", "model.rope_theta", "model.init_std",
                    "data.span_mean_length", "parallel.timeout_s"])
    if m.head_dim is not None and m.head_dim <= 0:
        raise ConfigError(f"model.head_dim={m.head_dim} must be positive (or omitted: d_model / n_heads)")
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
                          "choose n_heads that divides d_model, or set model.head_dim")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
                          "n_kv_heads must divide n_heads (1 = multi-query)")
    if m.position == "rope" and m.attention_head_dim % 2:
        raise ConfigError(f"RoPE needs an even head dimension, got {m.attention_head_dim}; set model.head_dim "
                          "(or d_model / n_heads) even")
    _check_rope_scaling(cfg)
    _check_layer_options(cfg)
    if m.position == "t5_relative" and (m.relative_buckets < 4 or m.relative_max_distance <= m.relative_buckets // 2):
        raise ConfigError(f"model.relative_buckets={m.relative_buckets} / model.relative_max_distance="
                          f"{m.relative_max_distance}: t5_relative needs at least 4 buckets and a max distance above "
                          "relative_buckets / 2 (the exactly bucketed range); T5 uses 32 and 128")
    _check_family(cfg)
    _check_moe(cfg)
    if m.attention_window is not None:
        if m.attention_window <= 0:
            raise ConfigError("model.attention_window must be positive (or omitted for full attention)")
        if m.attention_window > d.seq_len:
            raise ConfigError(f"model.attention_window={m.attention_window} is larger than data.seq_len="
                              f"{d.seq_len}; use a smaller window or remove it for full attention")
    if m.cross_downsample < 1:
        raise ConfigError("model.cross_downsample must be >= 1 (1 disables pooling)")
    if not 0 <= m.dropout < 1 or not 0 <= m.attention_dropout < 1:
        raise ConfigError("model.dropout and model.attention_dropout must lie in [0, 1)")
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
    if m.document_mask and cfg.objective != "causal":
        raise ConfigError(f"model.document_mask needs the causal objective (packed documents, each sample's doc_ids), "
                          f"not {cfg.objective!r}; leave it false for model.family={m.family!r}")
    key, longest = max(lengths, key=lambda item: item[1])
    if m.position in ("learned", "sinusoidal", "rope") and longest > m.max_seq_len:
        raise ConfigError(f"{key}={longest} exceeds model.max_seq_len={m.max_seq_len}; "
                          "raise model.max_seq_len or shorten data.seq_len")
    if spec.check is not None:
        spec.check(m)


def _check_moe(cfg: Config) -> None:
    """The mixture-of-experts keys (model/moe.py); none matters while model.n_experts = 0."""
    m = cfg.model
    if m.n_experts < 0:
        raise ConfigError(f"model.n_experts={m.n_experts} is negative", "use 0 (dense) or the number of experts")
    if m.n_experts == 0:
        return
    if not 1 <= m.experts_per_token <= m.n_experts:
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} must lie in [1, model.n_experts="
                          f"{m.n_experts}]", "choose how many experts each token uses, e.g. 2")
    for key in ("moe_d_ff", "n_shared_experts", "moe_first_dense", "capacity_factor", "moe_aux_loss",
                "router_z_loss", "router_bias_update_rate"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} is negative", "use a value >= 0 (0: the default)")
    if m.moe_every < 1:
        raise ConfigError(f"model.moe_every={m.moe_every} must be >= 1", "1: every block is MoE; k: every k-th")
    stacks = get_family_spec(m.family).stacks
    # a model from an HF folder (init_from) is what the folder holds, a Qwen3-MoE with every block dense included
    if not cfg.checkpoint.init_from and not any(is_moe_block(m, i) for stack in stacks for i in range(stack.count(m))):
        depths = " / ".join(f"{stack.count(m)}-layer {stack.name}" for stack in stacks)
        raise ConfigError(f"model.n_experts={m.n_experts}, but no block of the {depths} stack is MoE (model.moe_every="
                          f"{m.moe_every}, model.moe_first_dense={m.moe_first_dense}): the model would train dense",
                          "lower model.moe_first_dense or model.moe_every, or set model.n_experts=0 for a dense model")
    groups = m.router_groups
    if groups < 1 or m.n_experts % groups:
        raise ConfigError(f"model.router_groups={groups} does not divide model.n_experts={m.n_experts}",
                          "use a divisor of n_experts (1: no group-limited routing)")
    if not 1 <= m.router_groups_per_token <= groups:
        raise ConfigError(f"model.router_groups_per_token={m.router_groups_per_token} must lie in [1, "
                          f"model.router_groups={groups}]", "choose how many expert groups a token may use")
    if m.router_groups_per_token * (m.n_experts // groups) < m.experts_per_token:
        raise ConfigError(f"model.router_groups_per_token={m.router_groups_per_token} groups of "
                          f"{m.n_experts // groups} experts hold fewer than model.experts_per_token="
                          f"{m.experts_per_token}", "raise router_groups_per_token or lower experts_per_token")


def _check_rope_scaling(cfg: Config) -> None:
    """The rope_* keys of a scaled RoPE, with the ranges Hugging Face accepts."""
    m = cfg.model
    if m.rope_scaling == "none":
        return
    if m.position != "rope":
        raise ConfigError(f"model.rope_scaling={m.rope_scaling!r} rescales RoPE but model.position={m.position!r}; "
                          "set model.position='rope' or model.rope_scaling='none'")
    if not m.rope_scaling_factor >= 1:
        raise ConfigError(f"model.rope_scaling_factor={m.rope_scaling_factor} must be >= 1 (e.g. 8 for Llama 3.1)")
    if m.rope_scaling == "linear":
        return
    if m.rope_original_max_seq_len is None or m.rope_original_max_seq_len <= 0:
        raise ConfigError(f"model.rope_scaling={m.rope_scaling!r} needs model.rope_original_max_seq_len, the "
                          "pretraining context length (original_max_position_embeddings; 8192 for Llama 3.1)")
    if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        raise ConfigError(f"model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_factor="
                          f"{m.rope_high_freq_factor}: need 0 < low < high (Llama 3.1: 1 and 4)")
    if m.rope_scaling == "yarn":
        if not 0 < m.rope_beta_slow < m.rope_beta_fast:
            raise ConfigError(f"model.rope_beta_slow={m.rope_beta_slow} and model.rope_beta_fast={m.rope_beta_fast}: "
                              "need 0 < beta_slow < beta_fast (YaRN: 1 and 32)")
        if m.rope_attention_factor is not None and m.rope_attention_factor <= 0:
            raise ConfigError(f"model.rope_attention_factor={m.rope_attention_factor} must be positive (or omitted: "
                              "0.1 * ln(factor) + 1)")


def _check_layer_options(cfg: Config) -> None:
    """The per-layer attention pattern, soft-capping and norm options (Gemma, OLMo 2)."""
    m = cfg.model
    if m.full_attention_every is not None and (m.attention_window is None or m.full_attention_every < 1):
        raise ConfigError(f"model.full_attention_every={m.full_attention_every} picks the blocks that skip the sliding "
                          "window, but needs model.attention_window and a value >= 1",
                          "set both (Gemma 3: attention_window=512, full_attention_every=6) or drop it")
    if m.rope_local_theta is not None and (m.position != "rope" or m.attention_window is None
                                           or m.rope_local_theta <= 0):
        raise ConfigError(f"model.rope_local_theta={m.rope_local_theta} is the windowed blocks' RoPE base, but needs "
                          "model.position='rope', model.attention_window and a positive value",
                          "set them (Gemma 3: rope_local_theta=10000) or drop it")
    for key in ("attention_softcap", "logit_softcap"):
        value = getattr(m, key)
        if value is not None and not value > 0:
            raise ConfigError(f"model.{key}={value} must be positive", "give a cap such as 30.0, or drop it for none")
    if m.norm_weight_offset and m.norm != "rmsnorm":
        raise ConfigError(f"model.norm_weight_offset={m.norm_weight_offset} scales RMSNorm by (offset + weight), but "
                          f"model.norm={m.norm!r}", "set model.norm='rmsnorm' or leave the offset at 0")
    if m.qk_norm_scope != "head" and not m.qk_norm:
        raise ConfigError(f"model.qk_norm_scope={m.qk_norm_scope!r} has no QK-norm to place",
                          "set model.qk_norm=true, or drop qk_norm_scope")


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
    sched, optim, t = cfg.schedule, cfg.optim, cfg.train
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
    if optim.muon_lr <= 0 or optim.muon_weight_decay < 0 or not 0 <= optim.muon_momentum < 1 \
            or optim.muon_ns_steps < 1:
        raise ConfigError(f"optim.muon_lr={optim.muon_lr}, optim.muon_weight_decay={optim.muon_weight_decay}, "
                          f"optim.muon_momentum={optim.muon_momentum}, optim.muon_ns_steps={optim.muon_ns_steps} "
                          "out of range", "use muon_lr > 0, muon_weight_decay >= 0, muon_momentum in [0, 1), "
                          "muon_ns_steps >= 1 (e.g. 5)")
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
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(values):  # [[callbacks]]: a list of tables, their args the callback's own
            continue
        for key in dataclasses.fields(values):
            value = getattr(values, key.name)
            numbers = value if isinstance(value, tuple) else (value,)
            if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
                default = key.default_factory() if callable(key.default_factory) else key.default
                shown, example = (list(x) if isinstance(x, tuple) else x for x in (value, default))
                raise ConfigError(f"{section.name}.{key.name}={shown} is not a finite number",
                                  f"give a finite value, e.g. the default {section.name}.{key.name}={example}")


def _not_empty(cfg: Config, keys: list[str]) -> None:
    """Keys where "" has no meaning (an empty logging.run_dir would write the run into the current folder)."""
    for key in keys:
        section, name = key.split(".")
        if not getattr(getattr(cfg, section), name).strip():
            raise ConfigError(f"{key} is empty", f"give it a value, e.g. the default {key}={_default(cfg, key)}")


def _positive(cfg: Config, keys: list[str]) -> None:
    for key in keys:
        section, name = key.split(".")
        if (value := getattr(getattr(cfg, section), name)) <= 0:
            raise ConfigError(f"{key} must be positive, got {value}", f"e.g. the default {key}={_default(cfg, key)}")


def _default(cfg: Config, key: str) -> object:
    section, name = key.split(".")
    return next(f.default for f in dataclasses.fields(getattr(cfg, section)) if f.name == name)
