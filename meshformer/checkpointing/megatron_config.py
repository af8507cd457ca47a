"""Which meshformer models are Megatron-Core GPT models, and the config of each side read from the other.

`megatron_incompatibilities` lists what a model has that GPTModel cannot express (refused by name, never
dropped); `megatron_model_config` is the Megatron side of a model (TransformerConfig and GPTModel arguments,
written beside an export as JSON); `infer_config` reads a config back off a checkpoint's tensor shapes, with
the options tensors cannot record (head count, top-k, router score) passed in or taken from the meshformer
config that export writes beside the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from meshformer.checkpointing.checkpoint_errors import ConversionError
from meshformer.checkpointing.dcp_io import read_metadata, tensor_entries
from meshformer.config import ModelConfig
from meshformer.config.migrate import get_flat, model_from_dict, model_from_flat
from meshformer.model.families import FAMILIES
from meshformer.model.families.naming import MegatronNames
from meshformer.model.moe import is_moe_block

GPT = "GPTModel"  # the Megatron-Core model this module reads and writes
SAVED_CONFIG = "meshformer_model_config.json"  # written by export_megatron beside the iter_* folders
MEGATRON_CONFIG = "megatron_model_config.json"  # ... and the Megatron side: TransformerConfig + GPTModel arguments
LAYER = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
# Per-layer names, after "decoder.layers." (stacked on a leading layer axis) or "decoder.layers.<i>." (each layer
# its own tensor: Megatron's layout when dense and MoE layers mix)
QKV, PROJ = "self_attention.linear_qkv.", "self_attention.linear_proj."
Q_NORM, K_NORM = "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"
FC1, FC2 = "mlp.linear_fc1.", "mlp.linear_fc2."
ROUTER, EXPERT_BIAS = "mlp.router.weight", "mlp.router.expert_bias"
EXPERTS_FC1, EXPERTS_FC2 = "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"
SHARED_FC1, SHARED_FC2 = "mlp.shared_experts.linear_fc1.", "mlp.shared_experts.linear_fc2."
MEGATRON_BIAS_UPDATE_RATE = 1e-3  # Megatron's default moe_router_bias_update_rate
ACTIVATION_FUNC = {"swiglu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh", "relu": "relu"}  # Megatron's
# import_megatron's options, by the command-line flag that sets them
OPTIONS = {"n_heads": "--heads", "vocab_size": "--vocab-size", "activation": "--activation", "norm_eps": "--norm-eps",
           "rope_theta": "--rope-theta", "max_seq_len": "--max-seq-len", "experts_per_token": "--experts-per-token",
           "router_score": "--router-score", "router_groups": "--router-groups",
           "router_groups_per_token": "--router-groups-per-token"}
# what the tensors themselves determine, to check a saved config against
_FROM_TENSORS = ("d_model", "n_layers", "kv_heads", "attention_head_dim", "norm", "position", "bias", "use_qkv_bias",
                 "qk_norm", "tie_embeddings", "n_experts", "n_shared_experts")


# ----------------------------------------------------------------------------- compatibility


def megatron_incompatibilities(cfg: ModelConfig) -> list[str]:
    gpt_families = sorted(name for name, spec in FAMILIES.items() if spec.megatron and spec.megatron.model == GPT)
    checks = [
        (cfg.family in gpt_families, f"family={cfg.family!r} (needs one of {gpt_families}: Megatron {GPT})"),
        (cfg.norm.position == "pre" and cfg.use_final_norm,
         "post-norm, post-sublayer or sandwich norms or no final norm (needs pre-norm + final)"),
        (cfg.position in ("learned", "rope"), f"position={cfg.position!r} (needs 'learned' or 'rope')"),
        (cfg.ffn.activation in ACTIVATION_FUNC, f"activation={cfg.ffn.activation!r}"),
        (cfg.attention.scale is None, "a custom attention_scale (Megatron uses 1/sqrt(head_dim))"),
        (not cfg.scale_embeddings and not cfg.norm.embedding, "scale_embeddings / embedding_norm"),
        (not cfg.head_transform and not cfg.output_bias and not cfg.scale_output, "a BERT/T5-style output head"),
        (cfg.attention.window is None, "attention_window (sliding window)"),
        # Megatron's linear_qkv has a bias whenever the other linears do (add_bias_linear)
        (cfg.use_qkv_bias or not cfg.bias, "linear biases without Q/K/V biases"),
        # Megatron's q/k layernorm is the model's norm type; ours is RMSNorm
        (not cfg.attention.qk_norm or cfg.norm.kind == "rmsnorm",
         "qk_norm with LayerNorm blocks (Megatron would use LayerNorm)"),
        (cfg.rope.scaling == "none", f"rope_scaling={cfg.rope.scaling!r} (no Megatron-Core mapping here)"),
        (cfg.attention.qk_norm_scope == "head" or not cfg.attention.qk_norm,
         "qk_norm_scope='projection' (Megatron normalises per head)"),
        (cfg.norm.weight_offset == 0, f"norm_weight_offset={cfg.norm.weight_offset} (RMSNorm by offset + weight)"),
        (cfg.attention.softcap is None and cfg.logit_softcap is None, "attention_softcap / logit_softcap"),
        (not cfg.attention.sinks, "attention_sinks (no Megatron-Core mapping here)"),
        (not cfg.uses_mla, "mla blocks (no Megatron-Core mapping here)"),
        (cfg.moe.router_scale == 1.0 or not cfg.moe.n_experts, "moe.router_scale (no Megatron-Core mapping here)"),
        (not {"linear_attention", "kda"} & set(cfg.layer_types) and not cfg.attention.output_gate
         and cfg.rope.partial_factor == 1 and not cfg.moe.shared_expert_gate,
         "linear_attention / kda blocks / attention output_gate / rope partial_factor / shared_expert_gate "
         "(no Megatron-Core mapping here)"),
    ]
    return [problem for ok, problem in checks if not ok] + (_router_incompatibilities(cfg) if cfg.moe.n_experts else [])


def _router_incompatibilities(cfg: ModelConfig) -> list[str]:
    """Megatron's routers: softmax either over the top-k logits (= ours renormalised) or before the top-k (= ours
    not renormalised); sigmoid always renormalised when k > 1; a group scored by its best k/groups_per_token."""
    k, problems = cfg.moe.experts_per_token, []
    if cfg.bias:
        problems.append("mixture-of-experts with model.bias (Megatron's experts would carry biases, ours have none)")
    if cfg.moe.router_bias or cfg.moe.expert_linear_bias:
        problems.append("router_bias / expert_linear_bias (no Megatron-Core mapping here)")
    if cfg.moe.router_score == "sigmoid" and cfg.moe.router_renormalize != (k > 1):
        problems.append(f"router_score='sigmoid' with router_renormalize={cfg.moe.router_renormalize} at "
                        f"experts_per_token={k} (Megatron renormalises sigmoid weights exactly when k > 1)")
    if cfg.moe.router_groups > 1:
        if cfg.moe.router_score == "softmax" and cfg.moe.router_renormalize:
            problems.append("group-limited softmax routing with router_renormalize (Megatron then scores groups "
                            "by logits)")
        best = 1 if cfg.moe.router_group_score == "max" else min(2, cfg.moe.n_experts // cfg.moe.router_groups)
        if k % cfg.moe.router_groups_per_token or k // cfg.moe.router_groups_per_token != best:
            problems.append(f"router_groups_per_token={cfg.moe.router_groups_per_token} with experts_per_token={k} "
                            "(Megatron scores a group by its best experts_per_token / router_groups_per_token "
                            f"experts, ours by its best {best})")
    if cfg.moe.router_bias_update_rate > 0 and cfg.moe.router_score != "sigmoid":
        problems.append("bias balancing (router_bias_update_rate) with a softmax router (Megatron: sigmoid only)")
    return problems


def check_megatron_compatible(cfg: ModelConfig) -> MegatronNames:
    """Our names for the Megatron-Core GPT tensors (from the family spec), or a ConversionError saying why not."""
    problems = megatron_incompatibilities(cfg)
    if problems:
        fix = ("train it with model.bias=false (Hugging Face's MoE architectures have no linear biases either)"
               if cfg.moe.n_experts and cfg.bias
               else "export it to Hugging Face instead (`meshformer convert export-hf`)")
        raise ConversionError("this model cannot be written as a Megatron-Core GPT checkpoint: " + ", ".join(problems),
                              fix)
    names = FAMILIES[cfg.family].megatron
    assert names is not None  # megatron_incompatibilities refused families without Megatron names
    return names


def stacked_layers(cfg: ModelConfig) -> bool:
    """Megatron stacks a per-layer tensor on a leading layer axis when every layer is alike (all dense or all MoE);
    when they mix, each layer's tensors are saved under "decoder.layers.<i>."."""
    return len({is_moe_block(cfg, i) for i in range(cfg.n_layers)}) == 1


def layer_key(cfg: ModelConfig, name: str, layer: int) -> tuple[str, int | None]:
    """(Megatron's key, the row of it) that holds per-layer tensor `name` of layer `layer`."""
    return (LAYER + name, layer) if stacked_layers(cfg) else (f"{LAYER}{layer}.{name}", None)


def expert_bias_kept(cfg: ModelConfig) -> bool:
    """Megatron keeps a router bias only with bias balancing (sigmoid routers); otherwise ours must be zero."""
    return cfg.moe.router_bias_update_rate > 0


def megatron_model_config(cfg: ModelConfig, padded_vocab: int) -> dict[str, dict[str, Any]]:
    """The Megatron-Core side of `cfg`: TransformerConfig and GPTModel keyword arguments (activation_func by name)."""
    check_megatron_compatible(cfg)
    transformer: dict[str, Any] = dict(
        num_layers=cfg.n_layers, hidden_size=cfg.d_model, num_attention_heads=cfg.attention.n_heads,
        num_query_groups=cfg.kv_heads, kv_channels=cfg.attention_head_dim, ffn_hidden_size=cfg.ffn.d_ff,
        normalization="RMSNorm" if cfg.norm.kind == "rmsnorm" else "LayerNorm", layernorm_epsilon=cfg.norm.eps,
        gated_linear_unit=cfg.ffn.activation == "swiglu", activation_func=ACTIVATION_FUNC[cfg.ffn.activation],
        add_bias_linear=cfg.bias, add_qkv_bias=cfg.use_qkv_bias, qk_layernorm=cfg.attention.qk_norm)
    if cfg.moe.n_experts:
        balance = "seq_aux_loss" if cfg.moe.aux_per_sequence else "aux_loss"
        transformer.update(
            num_moe_experts=cfg.moe.n_experts, moe_router_topk=cfg.moe.experts_per_token,
            moe_ffn_hidden_size=cfg.expert_d_ff,
            moe_shared_expert_intermediate_size=cfg.moe.n_shared_experts * cfg.expert_d_ff or None,
            # a list makes Megatron save each layer apart, so one only where layers mix (as stacked_layers says)
            moe_layer_freq=1 if stacked_layers(cfg) else [int(is_moe_block(cfg, i)) for i in range(cfg.n_layers)],
            moe_router_score_function=cfg.moe.router_score,
            moe_router_pre_softmax=cfg.moe.router_score == "softmax" and not cfg.moe.router_renormalize,
            moe_router_num_groups=cfg.moe.router_groups if cfg.moe.router_groups > 1 else None,
            moe_router_group_topk=cfg.moe.router_groups_per_token if cfg.moe.router_groups > 1 else None,
            moe_router_enable_expert_bias=expert_bias_kept(cfg),
            moe_router_bias_update_rate=cfg.moe.router_bias_update_rate or MEGATRON_BIAS_UPDATE_RATE,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type=balance if cfg.moe.aux_loss else "none",
            moe_aux_loss_coeff=cfg.moe.aux_loss, moe_z_loss_coeff=cfg.moe.router_z_loss or None,
            moe_expert_capacity_factor=cfg.moe.capacity_factor or None,
            moe_token_drop_policy="position")  # ours keeps each expert's earliest tokens
    gpt = dict(vocab_size=padded_vocab, max_sequence_length=cfg.max_seq_len,
               position_embedding_type="rope" if cfg.position == "rope" else "learned_absolute",
               rotary_base=cfg.rope.theta, share_embeddings_and_output_weights=cfg.tie_embeddings)
    return {"transformer_config": transformer, "gpt_model": gpt}


def write_configs(cfg: ModelConfig, out_dir: Path, padded_vocab: int) -> None:
    (out_dir / SAVED_CONFIG).write_text(json.dumps(asdict(cfg), indent=2))
    (out_dir / MEGATRON_CONFIG).write_text(json.dumps(megatron_model_config(cfg, padded_vocab), indent=2))


# ----------------------------------------------------------------------------- config from a checkpoint


def layer_shapes(shapes: dict[str, tuple[int, ...]]) -> list[dict[str, tuple[int, ...]]]:
    """Each layer's tensor shapes by per-layer name, from either layout (stacked, or a key per layer)."""
    stacked = {k[len(LAYER):]: v for k, v in shapes.items() if k.startswith(LAYER) and not k[len(LAYER)].isdigit()}
    if stacked:
        n_layers = next(iter(stacked.values()))[0]
        return [{name: shape[1:] for name, shape in stacked.items()} for _ in range(n_layers)]
    layers: list[dict[str, tuple[int, ...]]] = []
    for key, shape in shapes.items():
        if key.startswith(LAYER):
            index, _, name = key[len(LAYER):].partition(".")
            while len(layers) <= int(index):
                layers.append({})
            layers[int(index)][name] = shape
    return layers


def moe_every_pattern(moe: list[bool]) -> tuple[int, int]:
    """(moe_first_dense, moe_every) that make exactly these layers MoE, or a ConversionError."""
    first = moe.index(True)
    for every in range(1, len(moe) + 1):
        if [i >= first and (i + 1) % every == 0 for i in range(len(moe))] == moe:
            return first, every
    raise ConversionError(f"the checkpoint's MoE layers {[i for i, m in enumerate(moe) if m]} follow no pattern of "
                          "dense first blocks, then every k-th block MoE")


def infer_config(folder: Path, *, n_heads: int, vocab_size: int | None = None, activation: str | None = None,
                 norm_eps: float = 1e-5, rope_theta: float = 10000.0, max_seq_len: int | None = None,
                 experts_per_token: int | None = None, router_score: str | None = None,
                 router_groups: int | None = None, router_groups_per_token: int | None = None) -> ModelConfig:
    """A ModelConfig from tensor shapes; only the head count (and the true vocabulary, and an MoE router's top-k and
    group-limited routing) cannot be read off them."""
    shapes = {k: tuple(v.size) for k, v in tensor_entries(read_metadata(folder)).items()}
    layers = layer_shapes(shapes)
    if not layers or any(QKV + "weight" not in layer for layer in layers) or EMBEDDING not in shapes:
        raise ConversionError(f"{folder} holds no Megatron GPT tensors ({LAYER}{QKV}weight, {EMBEDDING}); the TE "
                              "spec and other models are not supported")
    first = layers[0]
    qkv_rows, d_model = first[QKV + "weight"]
    attention_width = first[PROJ + "weight"][1]
    head_dim = attention_width // n_heads
    if head_dim * n_heads != attention_width:
        raise ConversionError(f"n_heads={n_heads} does not divide the attention width {attention_width}")
    n_groups = (qkv_rows // head_dim - n_heads) // 2
    if n_groups <= 0 or n_heads % n_groups or (n_heads + 2 * n_groups) * head_dim != qkv_rows:
        raise ConversionError(f"linear_qkv has {qkv_rows} rows, which does not fit n_heads={n_heads}; pass the "
                              "model's true number of attention heads")
    moe = [ROUTER in layer for layer in layers]
    dense = [layer for layer in layers if ROUTER not in layer]
    expert_width = layers[moe.index(True)][EXPERTS_FC2][2] if any(moe) else 0
    d_ff = dense[0][FC2 + "weight"][1] if dense else expert_width
    fc1_rows = dense[0][FC1 + "weight"][0] if dense else layers[0][EXPERTS_FC1][1]
    glu = fc1_rows == 2 * d_ff
    has_bias = PROJ + "bias" in first
    if has_bias and QKV + "bias" not in first:
        raise ConversionError("the checkpoint has biases on linear_proj but not on linear_qkv, which Megatron-Core "
                              "cannot save; is this a GPT checkpoint?")
    learned = POSITIONS in shapes
    padded_vocab = shapes[EMBEDDING][0]
    if vocab_size is not None and vocab_size > padded_vocab:
        raise ConversionError(f"vocabulary {vocab_size} is larger than the checkpoint's {padded_vocab} embedding rows "
                              "— pass the model's true --vocab-size (at most the padded size)")
    if glu and activation not in (None, "swiglu"):
        raise ConversionError(f"linear_fc1 is gated (2 x d_ff rows) but activation={activation!r} was asked")
    moe_options: dict[str, Any] = {}
    if any(moe):
        if experts_per_token is None:
            raise ConversionError(f"{folder} holds mixture-of-experts layers whose top-k its tensors do not record "
                                  "— pass --experts-per-token (Megatron's --moe-router-topk)")
        first_dense, every = moe_every_pattern(moe)
        # Megatron keeps a router bias only with bias balancing: it steers the selection, so it is read (at
        # Megatron's default update rate, which the tensors do not record), never replaced by zeros
        balanced = EXPERT_BIAS in layers[moe.index(True)]
        score = router_score or ("sigmoid" if balanced else "softmax")
        shared = layers[moe.index(True)].get(SHARED_FC2 + "weight")
        moe_options = dict(
            n_experts=layers[moe.index(True)][ROUTER][0], experts_per_token=experts_per_token, moe_d_ff=expert_width,
            n_shared_experts=shared[1] // expert_width if shared else 0, moe_first_dense=first_dense,
            moe_every=every, router_score=score, router_renormalize=score == "softmax" or experts_per_token > 1,
            router_groups=router_groups or 1, router_groups_per_token=router_groups_per_token or 1,
            router_bias_update_rate=MEGATRON_BIAS_UPDATE_RATE if balanced else 0.0)
    return model_from_flat(
        family="decoder", vocab_size=vocab_size or padded_vocab, d_model=d_model, n_heads=n_heads,
        n_kv_heads=None if n_groups == n_heads else n_groups, n_layers=len(layers), d_ff=d_ff,
        head_dim=None if head_dim == d_model // n_heads else head_dim, qk_norm=Q_NORM in first,
        activation="swiglu" if glu else (activation or "gelu"),  # type: ignore[arg-type]
        norm="layernorm" if QKV + "layer_norm_bias" in first else "rmsnorm", norm_eps=norm_eps,
        norm_position="pre", final_norm=True, position="learned" if learned else "rope", rope_theta=rope_theta,
        max_seq_len=shapes[POSITIONS][0] if learned else (max_seq_len or 4096),
        tie_embeddings=OUTPUT not in shapes, bias=has_bias, qkv_bias=None if has_bias else QKV + "bias" in first,
        init="normal", **moe_options,
    )


def read_saved_config(folder: Path) -> tuple[Path, ModelConfig] | None:
    """The model config that export_megatron wrote beside (or in) the torch_dist folder, if any."""
    from meshformer.config import ConfigError

    for file in (folder.parent / SAVED_CONFIG, folder / SAVED_CONFIG):
        if file.is_file():
            try:
                return file, model_from_dict(json.loads(file.read_text()), str(file))
            except (ValueError, ConfigError) as err:
                raise ConversionError(f"{file} is not a readable model config ({err}) — remove it and pass --heads "
                                      "and the other options instead") from None
    return None


def resolve_import_config(folder: Path, options: dict[str, Any]) -> ModelConfig:
    """The config to import with: the saved config (checked against the tensors and against every option that
    was given), or without one the tensors plus the options, where --heads is required."""
    saved = read_saved_config(folder)
    given = {k: v for k, v in options.items() if v is not None}
    if saved is None:
        if "n_heads" not in given:
            raise ConversionError(f"{folder} has no {SAVED_CONFIG} beside it and its tensors do not record the head "
                                  "count — pass --heads with the model's number of attention heads")
        return infer_config(folder, **{"norm_eps": 1e-5, "rope_theta": 10000.0, **given})
    file, cfg = saved
    inferred = infer_config(folder, **{**{k: get_flat(cfg, k) for k in OPTIONS}, **given})
    contradictions = [f"{OPTIONS[k]} {v!r} contradicts {k}={get_flat(cfg, k)!r}" for k, v in given.items()
                      if v != get_flat(cfg, k)]
    moe = [is_moe_block(cfg, i) for i in range(cfg.n_layers)]
    widths = (("d_ff",) if not all(moe) else ()) + (("expert_d_ff",) if any(moe) else ())  # what tensors hold
    contradictions += [f"{k}={get_flat(cfg, k)!r} in the file but {k}={get_flat(inferred, k)!r} in the tensors"
                       for k in _FROM_TENSORS + widths if get_flat(cfg, k) != get_flat(inferred, k)]
    moe_layers = [[i for i in range(c.n_layers) if is_moe_block(c, i)] for c in (cfg, inferred)]
    if moe_layers[0] != moe_layers[1]:
        contradictions.append(f"MoE layers {moe_layers[0]} in the file but {moe_layers[1]} in the tensors")
    if contradictions:
        raise ConversionError(f"{file} and the checkpoint disagree: {'; '.join(contradictions)} — drop the "
                              "options that contradict it (the saved config is used), or remove a stale file")
    return cfg
