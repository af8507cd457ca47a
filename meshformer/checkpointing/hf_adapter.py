"""What one Hugging Face architecture declares (`HFAdapter`), and the registry that finds it by model_type.

Each architecture lives in its own package `meshformer/models/<model_type>/`, named as transformers' model_type;
its `__init__.py` calls `register` with the adapter its `hf.py` builds. The registry imports every such package on
the first lookup (pkgutil over meshformer.models), so adding an architecture is adding a folder: nothing here or in
the generic conversion code (hf.py, hf_folder.py, init_from.py, the CLI) names one.

What an export may write is declared: the shared tables below (`NEUTRAL`, `WRITTEN`, `CHECKED`), each block kind's
`exports` (model/components) and each adapter's `kinds` and `expresses`; an option nobody declares is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshformer.checkpointing.formats import MODELS_PACKAGE, hf_archs
from meshformer.config import ModelConfig
from meshformer.renamed import renamed_attribute

if TYPE_CHECKING:
    import torch

    from meshformer.model.components.base import Component
    from meshformer.model.families.naming import Rule

ANY = "any value"  # a requirement that every value meets

# What every architecture requires of the config facts (`features`) unless its adapter says otherwise: the
# plain Transformer block. A set: any of these values.
COMMON: dict[str, Any] = {
    "scale_embeddings": False, "attention_window": None, "attention_scale": "1/sqrt(head_dim)", "scale_output": False,
    "cross_downsample": 1, "embedding_norm": False, "head_transform": False, "output_bias": False,
    "grouped_query": False, "norm": "layernorm", "norm_position": "pre", "final_norm": True, "rope_scaling": "none",
    "head_dim": "d_model/n_heads", "qk_norm": False, "qkv_bias": "as bias", "moe": False, "n_shared_experts": 0,
    "router_score": "softmax", "router_renormalize": True, "router_groups": 1, "router_group_score": "top2_sum",
    "capacity_factor": 0.0,
    "moe_blocks": "every block", "qk_norm_scope": "head", "norm_weight_offset": 0.0, "full_attention_every": None,
    "rope_local_theta": None, "attention_softcap": None, "logit_softcap": None, "router_bias": False,
    "expert_linear_bias": False, "attention_sinks": False, "router_scale": 1.0,
    "attention_output_gate": False, "rope_partial_factor": 1.0, "shared_expert_gate": False,
    "norm_by_kind": (), "linear_allow_neg_eigval": False, "linear_norm_eps": "model.norm.eps"}

# What an export may write is declared, never assumed: every option of the config (a leaf of ModelConfig, dotted) whose
# value differs from its default must be declared by one of these, or by a kind the model uses
# (`_Component.exports`), or by the target's adapter (`HFAdapter.expresses`); anything else is refused
# (`undeclared_options`), so an option added later is refused by every export until someone declares it.
#
# options that leave the function a checkpoint computes unchanged (training, compute paths): no export writes them
NEUTRAL = frozenset({
    "dropout", "attention.dropout", "attention.backend", "attention.document_mask", "moe.aux_loss",
    "moe.aux_per_sequence", "moe.router_z_loss", "moe.router_bias_update_rate", "moe.backend",
    "linear_attention.chunk_size", "linear_attention.backend", "mamba.chunk_size", "mamba.backend", "init.method",
    "init.std", "dsa.stage", "dsa.loss_weight", "compressed_attention.index_loss_weight", "mtp.loss_weight",
    "mtp.depth"})  # transformers builds no MTP modules (an adapter that has them writes them; the others leave them)
# options every adapter writes into its config (sizes of the plain Transformer)
WRITTEN = frozenset({"vocab_size", "d_model", "n_layers", "max_seq_len", "attention.n_heads", "attention.n_kv_heads",
                     "ffn.d_ff", "norm.eps", "rope.theta", "layer_types", "mlp_types"})
# options whose values `features` reads: every adapter's `requirements` (COMMON's value unless it says otherwise)
# decide which of their values it can write
CHECKED = frozenset({
    "family", "position", "scale_embeddings", "tie_embeddings", "share_embeddings", "bias", "head_transform",
    "output_bias", "logit_softcap", "scale_output", "cross_downsample", "attention.head_dim", "attention.qk_norm",
    "attention.qk_norm_scope", "attention.qkv_bias", "attention.window", "attention.softcap", "attention.scale",
    "attention.sinks", "attention.output_gate", "ffn.activation", "rope.scaling", "rope.local_theta",
    "rope.partial_factor", "norm.kind", "norm.position", "norm.by_kind", "norm.final", "norm.weight_offset",
    "norm.embedding", "moe.n_experts", "moe.n_shared_experts", "moe.shared_expert_gate", "moe.router_bias",
    "moe.expert_linear_bias", "moe.router_score", "moe.router_renormalize", "moe.router_groups",
    "moe.router_group_score", "moe.capacity_factor", "moe.router_scale", "linear_attention.allow_neg_eigval",
    "linear_attention.norm_eps",
    # the parameters of a rope.scaling: an adapter that accepts the scaling writes them
    "rope.factor", "rope.original_max_seq_len", "rope.low_freq_factor", "rope.high_freq_factor", "rope.beta_fast",
    "rope.beta_slow", "rope.attention_factor", "rope.truncate"})
# the kinds (model.layer_types / model.mlp_types) an adapter's blocks hold unless it declares others
PLAIN_KINDS = ("full_attention", "sliding_attention", "dense", "moe")


def _full_attention_every(cfg: ModelConfig) -> int | str | None:
    """k when every k-th block attends globally and the others through the window (None: every block windowed;
    "other": another pattern of model.layer_types)."""
    types = [cfg.layer_type(i) for i in range(cfg.n_layers)]
    if "full_attention" not in types:
        return None
    every = types.index("full_attention") + 1
    return every if [(i + 1) % every == 0 for i in range(cfg.n_layers)] == [t == "full_attention" for t in types] \
        else "other"


def features(cfg: ModelConfig) -> dict[str, Any]:
    """The config facts an architecture constrains, normalised (e.g. default attention scale, GQA or not)."""
    default_scale = cfg.attention.scale is None or math.isclose(cfg.attention.scale, cfg.attention_head_dim**-0.5)
    default_head_dim = cfg.attention_head_dim * cfg.attention.n_heads == cfg.d_model
    moe = cfg.moe.n_experts > 0
    linear = "linear_attention" in cfg.layer_types
    return {
        # MoE: the router settings only matter where there are experts
        "moe": moe, "n_shared_experts": cfg.moe.n_shared_experts if moe else 0,
        "router_score": cfg.moe.router_score if moe else "softmax",
        "router_renormalize": cfg.moe.router_renormalize if moe else True,
        "router_groups": cfg.moe.router_groups if moe else 1,
        "router_group_score": cfg.moe.router_group_score if moe and cfg.moe.router_groups > 1 else "top2_sum",
        "capacity_factor": cfg.moe.capacity_factor if moe else 0.0,
        "router_bias": cfg.moe.router_bias and moe, "expert_linear_bias": cfg.moe.expert_linear_bias and moe,
        "attention_sinks": cfg.attention.sinks, "mla": cfg.uses_mla,
        "router_scale": cfg.moe.router_scale if moe else 1.0,
        "linear_attention": "linear_attention" in cfg.layer_types, "kda": "kda" in cfg.layer_types,
        "dsa": "dsa" in cfg.layer_types,
        "hash_routing": "hash_moe" in cfg.mlp_types,
        "compressed_attention": bool({"sliding_mqa", "hca", "csa"} & set(cfg.layer_types)),
        "attention_output_gate": cfg.attention.output_gate, "rope_partial_factor": cfg.rope.partial_factor,
        "shared_expert_gate": cfg.moe.shared_expert_gate and moe and cfg.moe.n_shared_experts > 0,
        "moe_blocks": "every block" if not moe or all(cfg.is_moe(i) for i in range(cfg.n_layers)) else "some",
        "family": cfg.family, "norm": cfg.norm.kind, "norm_position": cfg.norm.position,
        "final_norm": cfg.use_final_norm, "norm_by_kind": tuple(sorted(cfg.norm.by_kind.items())),
        "linear_allow_neg_eigval": linear and cfg.linear_attention.allow_neg_eigval,
        "linear_norm_eps": "model.norm.eps" if not linear or cfg.linear_attention.norm_eps is None
        else cfg.linear_attention.norm_eps,
        "embedding_norm": cfg.norm.embedding, "position": cfg.position, "scale_embeddings": cfg.scale_embeddings,
        "tie_embeddings": cfg.tie_embeddings, "share_embeddings": cfg.share_embeddings, "bias": cfg.bias,
        "head_transform": cfg.head_transform, "output_bias": cfg.output_bias, "activation": cfg.ffn.activation,
        "grouped_query": cfg.kv_heads != cfg.attention.n_heads, "attention_window": cfg.attention.window,
        "attention_scale": "1/sqrt(head_dim)" if default_scale else cfg.attention.scale,
        "scale_output": cfg.scale_output, "cross_downsample": cfg.cross_downsample,
        "rope_scaling": cfg.rope.scaling, "head_dim": "d_model/n_heads" if default_head_dim else cfg.attention.head_dim,
        "qk_norm": cfg.attention.qk_norm, "qkv_bias": "as bias" if cfg.use_qkv_bias == cfg.bias else cfg.use_qkv_bias,
        "qk_norm_scope": cfg.attention.qk_norm_scope if cfg.attention.qk_norm else "head",
        "norm_weight_offset": cfg.norm.weight_offset,
        "full_attention_every": _full_attention_every(cfg) if cfg.attention.window is not None else None,
        "rope_local_theta": cfg.rope.local_theta if cfg.attention.window is not None else None,
        "attention_softcap": cfg.attention.softcap, "logit_softcap": cfg.logit_softcap,
        # without their own base, windowed blocks rotate with the global (maybe scaled) RoPE
        "windowed_blocks_rope": "scaled (rope_scaling without rope_local_theta)" if cfg.attention.window is not None
        and cfg.rope.local_theta is None and cfg.rope.scaling != "none" else "unscaled",
    }


@dataclass(frozen=True)
class Derived:
    """A tensor of ours computed from several foreign ones, outside the one-to-one name rules (BERT's position table
    with token type 0 folded in)."""

    ours: str
    reads: tuple[str, ...]  # the foreign names it reads; `to_ours` gets those present
    to_ours: Callable[[Mapping[str, torch.Tensor]], torch.Tensor]
    to_theirs: Callable[[torch.Tensor, ModelConfig], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class HFAdapter:
    """One transformers architecture: its config both ways, its tensor names, what it refuses."""

    model_type: str  # transformers' config.model_type; also the package's folder name
    model_class: str  # the transformers class export builds and names in config.json's `architectures`
    config_from_hf: Callable[[Any], ModelConfig]  # refuses (`refuse`) what would compute another function
    config_to_hf: Callable[[ModelConfig], Any]  # a transformers config; `cfg` already passed `requirements`
    # config fact (`features`, plus `extra_features`) -> the value, or set of values, it must have
    requirements: Mapping[str, Any]
    rules: Callable[[ModelConfig], list[Rule]]  # tensor names both ways (checkpointing/mapping.py applies them)
    base_prefix: str = ""  # what base-model checkpoints (e.g. LlamaModel's) lack before every name
    size_keys: tuple[str, ...] = ()  # config.json's sizes: positive integers, checked before anything is built
    layer_keys: tuple[str, ...] = ()  # its layer counts: no deeper than the checkpoint has tensors
    width_and_heads: tuple[str, str] | None = None  # (width, heads) keys when the width must divide by the heads
    # the values config.json's layer_types may hold (as transformers reads them): those its blocks compute
    hf_layer_types: tuple[str, ...] = ("full_attention", "sliding_attention")
    extra_features: Callable[[ModelConfig], dict[str, Any]] | None = None  # config facts only it constrains
    derived: tuple[Derived, ...] = ()
    ignored: str | None = None  # a regex of foreign names that carry nothing we model (beside weightless buffers)
    old_names: Callable[[str], str] | None = None  # a checkpoint's older spelling of a name -> today's
    keep_prefix: tuple[str, ...] = ("lm_head.",)  # names outside the base model (no base_prefix added)
    # (a regex of foreign names, "what; fix"): a checkpoint holding such a name is refused with that message before
    # any name is matched (e.g. weights stored in a quantized layout the rules do not read)
    refused_names: tuple[tuple[str, str], ...] = ()
    # its routers hold our expert selection bias (router.expert_bias, named by a rule): export keeps a nonzero one
    holds_selection_bias: bool = False
    # the block kinds (model.layer_types, model.mlp_types) its config can express; a model using another is refused
    kinds: tuple[str, ...] = PLAIN_KINDS
    # options (dotted, e.g. "mla.query_scale_beta") its config_to_hf writes beyond what the shared declarations
    # (WRITTEN, CHECKED) and its kinds' `exports` cover
    expresses: tuple[str, ...] = ()


renamed_attribute(HFAdapter, "layer_kinds", "hf_layer_types")


def _options(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf option of a config (dataclasses nested as tables), by dotted name."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        inner = getattr(value, f.name)
        if dataclasses.is_dataclass(inner):
            out.update(_options(inner, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = inner
    return out


def undeclared_options(cfg: ModelConfig, adapter: HFAdapter) -> list[str]:
    """What `cfg` uses that no declaration lets `adapter`'s export write, one 'name=value' each: the kinds its blocks
    hold beyond `adapter.kinds`, and the options set away from their defaults that neither the shared declarations
    (NEUTRAL, WRITTEN, CHECKED), the kinds the model uses (`exports`) nor the adapter (`expresses`) declare."""
    from meshformer.model.components import CHANNEL_MIXERS, TOKEN_MIXERS, model_kinds

    def tables(kinds: Iterable[Component]) -> set[str]:
        return {t for kind in kinds for t in (kind.section, *(o.split(".")[0] for o in kind.exports))}

    kinds = list(model_kinds(cfg))
    problems = [f"kind {kind.name!r}" for kind in kinds if kind.name not in adapter.kinds]
    declared = NEUTRAL | WRITTEN | CHECKED | set(adapter.expresses)
    for kind in kinds:
        declared |= kind.exports
    # a kind's table that no block of this model reads changes nothing it computes
    unread = tables([*TOKEN_MIXERS.values(), *CHANNEL_MIXERS.values()]) - tables(kinds)
    defaults = _options(ModelConfig())
    problems += [f"{name}={value!r}" for name, value in _options(cfg).items()
                 if value != defaults[name] and name not in declared and name.split(".")[0] not in unread]
    return problems


def refuse(arch: str, setting: str, why: str) -> ValueError:
    """A config flag that would make the imported model compute a different function than the original."""
    return ValueError(f"{arch}: {setting} {why}, which meshformer cannot express — importing it would compute "
                      "different logits; only checkpoints without it can be converted")


_REGISTRY: dict[str, HFAdapter] = {}
_discovered = False


def register(adapter: HFAdapter) -> HFAdapter:
    """Called by a `meshformer/models/<model_type>/__init__.py` for the adapter its folder holds."""
    known = _REGISTRY.get(adapter.model_type)
    if known is not None and known is not adapter:
        raise RuntimeError(f"two Hugging Face adapters for model_type {adapter.model_type!r}")
    _REGISTRY[adapter.model_type] = adapter
    return adapter


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    package = importlib.import_module(MODELS_PACKAGE)  # by name: the packages above checkpointing import it
    for module in pkgutil.iter_modules(package.__path__):
        if module.ispkg:
            importlib.import_module(f"{MODELS_PACKAGE}.{module.name}")
    unregistered = set(hf_archs()) - set(_REGISTRY)
    if unregistered:  # `hf_archs` lists the folders without importing them: each must register its own name
        raise RuntimeError(f"{MODELS_PACKAGE} folders {sorted(unregistered)} register no adapter of that model_type")
    _discovered = True


def adapters() -> dict[str, HFAdapter]:
    """Every registered architecture, by model_type, in name order (the order `infer_arch` tries them)."""
    _discover()
    return dict(sorted(_REGISTRY.items()))


def find_adapter(model_type: Any) -> HFAdapter | None:
    _discover()
    return _REGISTRY.get(model_type) if isinstance(model_type, str) else None


def get_adapter(model_type: Any) -> HFAdapter:
    adapter = find_adapter(model_type)
    if adapter is None:
        raise ValueError(f"unsupported Hugging Face model_type {model_type!r}; supported: {list(adapters())}")
    return adapter


# Foreign names that carry no weights in any architecture: buffers of older checkpoints (position ids, rotary
# frequencies).
_BUFFERS = r"(position_ids|rotary_emb\.inv_freq)$"


def ignored_names(adapter: HFAdapter) -> re.Pattern[str]:
    """Foreign names an import may leave unread: weightless buffers, and what the adapter adds."""
    return re.compile(_BUFFERS + (f"|{adapter.ignored}" if adapter.ignored else ""))
