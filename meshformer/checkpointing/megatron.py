"""Megatron-Core `torch_dist` checkpoints of GPT models <-> meshformer weights, without importing megatron.

A torch_dist checkpoint is a DCP folder (.metadata, __R_T.distcp) plus common.pt and metadata.json. Its GPT
tensors are global (any TP/PP/EP layout that saved them): per-layer weights are stacked on a leading layer
axis when all layers are alike, else saved per layer ("decoder.layers.<i>.", dense and MoE layers mixed);
linear_qkv packs, for each query group, that group's query heads, then its key head, then its value head; the
local spec names the pre-attention and pre-MLP norms linear_qkv.layer_norm_* and linear_fc1.layer_norm_* (MoE
layers too); SwiGLU's linear_fc1 is [gate; up], each expert's too; experts are stacked on an expert axis after
the layer axis. Megatron's RoPE rotates halves (not pairs), as ours does. Vocabulary rows beyond the model's
vocabulary are Megatron's padding. megatron_config.py says which models map.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from meshformer.checkpointing.checkpoint_errors import ConversionError
from meshformer.checkpointing.dcp_io import read_box, read_metadata, save_tensors_streamed, tensor_entries
from meshformer.checkpointing.megatron_config import (
    EMBEDDING,
    EXPERT_BIAS,
    EXPERTS_FC1,
    EXPERTS_FC2,
    FC1,
    FC2,
    K_NORM,
    LAYER,
    MEGATRON_CONFIG,
    OUTPUT,
    POSITIONS,
    PROJ,
    Q_NORM,
    QKV,
    ROUTER,
    SAVED_CONFIG,
    SHARED_FC1,
    SHARED_FC2,
    check_megatron_compatible,
    expert_bias_kept,
    layer_key,
    resolve_import_config,
    stacked_layers,
    write_configs,
)
from meshformer.checkpointing.safetensors_io import LazyState
from meshformer.config import ModelConfig
from meshformer.model.families.naming import MegatronNames
from meshformer.model.moe import is_moe_block

FINAL_NORM = "decoder.final_layernorm."
BACKEND_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                    "common_backend_version": 1}
_ITER_DIR = re.compile(r"^iter_(\d+)$")
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's pointer to the newest iter_* folder
WRITTEN_BESIDE = (TRACKER, SAVED_CONFIG, MEGATRON_CONFIG)  # what export_megatron writes beside iter_*


# ----------------------------------------------------------------------------- qkv packing


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_groups: int) -> torch.Tensor:
    """Our separate q/k/v (rows = heads x head_dim) -> Megatron's per-group [q heads, k, v] rows."""
    head_dim = k.shape[0] // n_groups
    per_group = n_heads // n_groups
    tail = q.shape[1:]
    q = q.reshape(n_groups, per_group * head_dim, *tail)
    k, v = k.reshape(n_groups, head_dim, *tail), v.reshape(n_groups, head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def unpack_qkv(qkv: torch.Tensor, n_heads: int, n_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = n_heads // n_groups
    head_dim = qkv.shape[0] // (n_groups * (per_group + 2))
    tail = qkv.shape[1:]
    grouped = qkv.reshape(n_groups, (per_group + 2) * head_dim, *tail)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(), v.reshape(-1, *tail).contiguous())


# ----------------------------------------------------------------------------- export


def megatron_layer_sources(state: Mapping[str, torch.Tensor], cfg: ModelConfig, layer: int
                           ) -> dict[str, Callable[[], torch.Tensor]]:
    """Megatron's per-layer names (after "decoder.layers.") -> how to make layer `layer`'s from our tensors."""
    ours = check_megatron_compatible(cfg)
    prefix = f"{ours.layers}.{layer}."
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for p in ("weight", "bias") if cfg.norm.kind == "layernorm" else ("weight",):
        out[QKV + f"layer_norm_{p}"] = functools.partial(_norm_param, state, prefix + ours.attn_norm, p)
        out[FC1 + f"layer_norm_{p}"] = functools.partial(_norm_param, state, prefix + ours.ffn_norm, p)
    for p in ("weight", "bias") if cfg.use_qkv_bias else ("weight",):
        out[QKV + p] = functools.partial(_packed_qkv, state, [f"{prefix}{name}.{p}" for name in ours.qkv], cfg)
    if cfg.attention.qk_norm:
        out[Q_NORM] = functools.partial(state.__getitem__, f"{prefix}{ours.q_norm}.weight")
        out[K_NORM] = functools.partial(state.__getitem__, f"{prefix}{ours.k_norm}.weight")
    for p in ("weight", "bias") if cfg.bias else ("weight",):
        out[PROJ + p] = functools.partial(state.__getitem__, f"{prefix}{ours.attn_out}.{p}")
    if not is_moe_block(cfg, layer):
        out.update(_ffn_sources(state, cfg, prefix, ours.gate, ours.up, ours.down, FC1, FC2))
        return out
    moe = prefix + ours.moe
    out[ROUTER] = functools.partial(state.__getitem__, f"{moe}.router.weight")
    if expert_bias_kept(cfg):
        out[EXPERT_BIAS] = functools.partial(state.__getitem__, f"{moe}.router.expert_bias")
    # ours: (E, in, out) stacks applied as x @ w; Megatron's: one (out, in) linear per expert
    experts = [f"{moe}.experts.{w}_proj" for w in (("gate", "up") if cfg.ffn.activation == "swiglu" else ("up",))]
    out[EXPERTS_FC1] = lambda: torch.cat([state[name].transpose(1, 2) for name in experts], dim=1).contiguous()
    out[EXPERTS_FC2] = lambda: state[f"{moe}.experts.down_proj"].transpose(1, 2).contiguous()
    if cfg.moe.n_shared_experts:
        leaf = {name: f"shared_experts.{name.rpartition('.')[2]}" for name in (ours.gate, ours.up, ours.down)}
        out.update(_ffn_sources(state, cfg, f"{moe}.", leaf[ours.gate], leaf[ours.up], leaf[ours.down],
                                SHARED_FC1, SHARED_FC2))
    return out


def _ffn_sources(state: Mapping[str, torch.Tensor], cfg: ModelConfig, prefix: str, gate: str, up: str, down: str,
                 fc1: str, fc2: str) -> dict[str, Callable[[], torch.Tensor]]:
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for p in ("weight", "bias") if cfg.bias else ("weight",):
        ins = [f"{prefix}{gate}.{p}", f"{prefix}{up}.{p}"] if cfg.ffn.activation == "swiglu" else [f"{prefix}{up}.{p}"]
        out[fc1 + p] = functools.partial(_concatenated, state, ins)
        out[fc2 + p] = functools.partial(state.__getitem__, f"{prefix}{down}.{p}")
    return out


def _packed_qkv(state: Mapping[str, torch.Tensor], names: list[str], cfg: ModelConfig) -> torch.Tensor:
    q, k, v = (state[name] for name in names)
    return pack_qkv(q, k, v, cfg.attention.n_heads, cfg.kv_heads)


def _concatenated(state: Mapping[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([state[name] for name in names]) if len(names) > 1 else state[names[0]]


def megatron_global_sources(state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int | None
                            ) -> dict[str, Callable[[], torch.Tensor]]:
    """Megatron's unstacked keys (embeddings, final norm, output layer) -> how to make each from our tensors."""
    ours = check_megatron_compatible(cfg)
    out: dict[str, Callable[[], torch.Tensor]] = {EMBEDDING: lambda: _pad_rows(state[ours.embedding], padded_vocab)}
    if cfg.position == "learned":
        out[POSITIONS] = lambda: state[ours.positions].contiguous()
    for p in ("weight", "bias") if cfg.norm.kind == "layernorm" else ("weight",):
        out[FINAL_NORM + p] = functools.partial(_norm_param, state, ours.final_norm, p)
    if not cfg.tie_embeddings:
        out[OUTPUT] = lambda: _pad_rows(state[ours.output], padded_vocab)
    return out


def _norm_param(state: Mapping[str, torch.Tensor], module: str, param: str) -> torch.Tensor:
    key = f"{module}.{param}"
    if key in state:
        return state[key]
    # Megatron's LayerNorm always has a bias; our bias=False LayerNorm is the same function with a zero bias.
    return torch.zeros_like(state[f"{module}.weight"])


def _pad_rows(table: torch.Tensor, rows: int | None) -> torch.Tensor:
    if rows is None or rows == table.shape[0]:
        return table.contiguous()
    if rows < table.shape[0]:
        raise ConversionError(f"padded vocabulary {rows} is smaller than the model's {table.shape[0]}")
    return torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])])


def check_router_biases(state: Mapping[str, torch.Tensor], cfg: ModelConfig, ours: MegatronNames) -> None:
    """A router bias Megatron would not keep (no bias balancing) must be zero, or the export would route otherwise."""
    if not cfg.moe.n_experts or expert_bias_kept(cfg):
        return
    for i in (i for i in range(cfg.n_layers) if is_moe_block(cfg, i)):
        name = f"{ours.layers}.{i}.{ours.moe}.router.expert_bias"
        if state[name].abs().max() > 0:  # E floats a layer
            raise ConversionError(f"{name} is non-zero but Megatron keeps a router bias only with bias balancing "
                                  "(router_score = 'sigmoid', router_bias_update_rate > 0)",
                                  "export it to Hugging Face instead, or set those options in the model config")


def _extra_state_names(cfg: ModelConfig) -> list[str]:
    """The one-item objects Megatron's local-spec linears save per layer (and per expert): keys with the global
    offset and shape of each ("<key>/shard_<offset>_<shape>", dots between axes)."""
    stacked, names = stacked_layers(cfg), []
    for i in range(cfg.n_layers):
        modules = ["self_attention.linear_qkv", "self_attention.linear_proj"]
        moe = is_moe_block(cfg, i)
        modules += (["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"] if cfg.moe.n_shared_experts
                    else []) if moe else ["mlp.linear_fc1", "mlp.linear_fc2"]
        key = LAYER if stacked else f"{LAYER}{i}."
        axes = [(i, cfg.n_layers)] if stacked else [(0, 1)]
        for module in modules:
            names.append(_shard_name(f"{key}{module}._extra_state", axes))
        for module, e in ((m, e) for m in ("linear_fc1", "linear_fc2") for e in range(cfg.moe.n_experts if moe else 0)):
            expert_axes = ([(i, cfg.n_layers)] if stacked else []) + [(e, cfg.moe.n_experts)]
            names.append(_shard_name(f"{key}mlp.experts.experts.{module}._extra_state", expert_axes))
    return names


def _shard_name(key: str, axes: list[tuple[int, int]]) -> str:
    return f"{key}/shard_{'.'.join(str(o) for o, _ in axes)}_{'.'.join(str(n) for _, n in axes)}"


def export_megatron(state: Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: Path, *, iteration: int = 0,
                    pad_vocab_multiple: int = 1) -> Path:
    """Write `out_dir/iter_<N>/` (torch_dist), `latest_checkpointed_iteration.txt` and both sides' configs;
    returns the iter folder.

    Streamed, as Megatron itself saves: each stacked tensor is written one chunk per layer, each chunk made from
    our tensors when the writer comes to it, so at most one layer's tensor is in memory."""
    check_router_biases(state, cfg, check_megatron_compatible(cfg))
    padded = -(-cfg.vocab_size // pad_vocab_multiple) * pad_vocab_multiple
    singles = megatron_global_sources(state, cfg, padded)
    layers = [megatron_layer_sources(state, cfg, i) for i in range(cfg.n_layers)]
    shapes = _MetaState(state)  # templates: the same recipes on meta tensors
    templates: dict[str, object] = {key: make() for key, make in megatron_global_sources(shapes, cfg, padded).items()}
    rows: dict[str, Callable[[int], torch.Tensor]] = {}
    for i in range(cfg.n_layers):
        for name, make in megatron_layer_sources(shapes, cfg, i).items():
            key, row = layer_key(cfg, name, i)
            if row is None:
                templates[key], singles[key] = make(), layers[i][name]
            elif row == 0:
                templates[key] = make().new_empty(cfg.n_layers, *make().shape)
                rows[key] = functools.partial(_layer_tensor, layers, name)
    templates.update({name: [None] for name in _extra_state_names(cfg)})  # Megatron saves each as a 1-item list
    folder = Path(out_dir) / f"iter_{iteration:07d}"
    save_tensors_streamed(templates, lambda key: singles[key](), folder, read_row=rows)
    torch.save({}, folder / "common.pt")  # GPTModel has no non-sharded state; Megatron-LM adds its args here
    (folder / "metadata.json").write_text(json.dumps(BACKEND_METADATA))
    (Path(out_dir) / TRACKER).write_text(str(iteration))
    write_configs(cfg, Path(out_dir), padded)
    return folder


def _layer_tensor(layers: list[dict[str, Callable[[], torch.Tensor]]], name: str, layer: int) -> torch.Tensor:
    return layers[layer][name]()


class _MetaState(Mapping[str, torch.Tensor]):
    """Meta tensors of the shapes and dtypes in `state`, without reading a lazily read state's data."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = state

    def __getitem__(self, name: str) -> torch.Tensor:
        meta = getattr(self._state, "meta", None)
        return meta(name) if callable(meta) else self._state[name].to("meta")

    def __contains__(self, name: object) -> bool:
        return name in self._state

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


# ----------------------------------------------------------------------------- import


def resolve_megatron_dir(path: Path) -> Path:
    """The torch_dist folder: `path` itself, or iter_<latest>/ under a Megatron-LM save directory."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        folder = path / ("release" if text == "release" else f"iter_{int(text):07d}")
        if (folder / ".metadata").is_file():
            return folder
    iters = sorted((int(m.group(1)), p) for p in path.glob("iter_*") if (m := _ITER_DIR.match(p.name)))
    if iters and (iters[-1][1] / ".metadata").is_file():
        return iters[-1][1]
    raise ConversionError(f"{path} is not a Megatron torch_dist checkpoint (no .metadata, no iter_* folder); "
                          "pass the iter_XXXXXXX folder or the save directory holding it")


Reader = Callable[[str, "int | None"], torch.Tensor]  # (key, row or None for the whole tensor) -> tensor


def megatron_sources(cfg: ModelConfig, read: Reader) -> dict[str, Callable[[], torch.Tensor]]:
    """Our tensor names -> how to make each from Megatron's: `read(key, None)` reads a whole tensor and
    `read(key, i)` layer i of a stacked one, so a conversion holds one layer's tensor at a time."""
    ours = check_megatron_compatible(cfg)
    out: dict[str, Callable[[], torch.Tensor]] = {
        ours.embedding: lambda: read(EMBEDDING, None)[: cfg.vocab_size].contiguous()}
    if cfg.position == "learned":
        out[ours.positions] = lambda: read(POSITIONS, None)
    if not cfg.tie_embeddings:
        out[ours.output] = lambda: read(OUTPUT, None)[: cfg.vocab_size].contiguous()
    else:
        out[ours.output] = out[ours.embedding]
    # A norm bias with model.bias=False is checked to be zero (check_norm_biases) and left out.
    norm_params = ("weight", "bias") if cfg.norm.kind == "layernorm" and cfg.bias else ("weight",)
    for p in norm_params:
        out[f"{ours.final_norm}.{p}"] = functools.partial(read, FINAL_NORM + p, None)
    for i in range(cfg.n_layers):
        out.update(_layer_sources_from(cfg, ours, read, i, norm_params))
    return out


def _layer_sources_from(cfg: ModelConfig, ours: MegatronNames, read: Reader, i: int, norm_params: tuple[str, ...]
                        ) -> dict[str, Callable[[], torch.Tensor]]:
    o = f"{ours.layers}.{i}."

    def part(name: str, pick: Callable[[torch.Tensor], torch.Tensor] = _same) -> Callable[[], torch.Tensor]:
        return lambda: pick(read(*layer_key(cfg, name, i))).contiguous()

    def qkv_part(j: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: unpack_qkv(t, cfg.attention.n_heads, cfg.kv_heads)[j]

    out: dict[str, Callable[[], torch.Tensor]] = {}
    for p in norm_params:
        out[f"{o}{ours.attn_norm}.{p}"] = part(QKV + f"layer_norm_{p}")
        out[f"{o}{ours.ffn_norm}.{p}"] = part(FC1 + f"layer_norm_{p}")
    for p in ("weight", "bias") if cfg.use_qkv_bias else ("weight",):
        for j, name in enumerate(ours.qkv):
            out[f"{o}{name}.{p}"] = part(QKV + p, qkv_part(j))
    if cfg.attention.qk_norm:
        out[f"{o}{ours.q_norm}.weight"], out[f"{o}{ours.k_norm}.weight"] = part(Q_NORM), part(K_NORM)
    for p in ("weight", "bias") if cfg.bias else ("weight",):
        out[f"{o}{ours.attn_out}.{p}"] = part(PROJ + p)
    if not is_moe_block(cfg, i):
        out.update(_ffn_from(cfg, part, o, ours.gate, ours.up, ours.down, FC1, FC2))
        return out
    moe = f"{o}{ours.moe}."
    out[moe + "router.weight"] = part(ROUTER)
    # Without bias balancing Megatron keeps no router bias: ours starts at zero, as a fresh model's does
    out[moe + "router.expert_bias"] = part(EXPERT_BIAS) if expert_bias_kept(cfg) else (
        lambda: torch.zeros(cfg.moe.n_experts))
    glu = cfg.ffn.activation == "swiglu"
    if glu:
        out[moe + "experts.gate_proj"] = part(EXPERTS_FC1, lambda t: t.chunk(2, dim=1)[0].transpose(1, 2))
    out[moe + "experts.up_proj"] = part(EXPERTS_FC1, lambda t: (t.chunk(2, dim=1)[1] if glu else t).transpose(1, 2))
    out[moe + "experts.down_proj"] = part(EXPERTS_FC2, lambda t: t.transpose(1, 2))
    if cfg.moe.n_shared_experts:
        leaf = {name: f"shared_experts.{name.rpartition('.')[2]}" for name in (ours.gate, ours.up, ours.down)}
        out.update(_ffn_from(cfg, part, moe, leaf[ours.gate], leaf[ours.up], leaf[ours.down], SHARED_FC1,
                             SHARED_FC2))
    return out


def _ffn_from(cfg: ModelConfig, part: Callable[..., Callable[[], torch.Tensor]], prefix: str, gate: str, up: str,
              down: str, fc1: str, fc2: str) -> dict[str, Callable[[], torch.Tensor]]:
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for p in ("weight", "bias") if cfg.bias else ("weight",):
        if cfg.ffn.activation == "swiglu":  # linear_fc1 is [gate; up]
            out[f"{prefix}{gate}.{p}"] = part(fc1 + p, lambda t: t.chunk(2, dim=0)[0])
            out[f"{prefix}{up}.{p}"] = part(fc1 + p, lambda t: t.chunk(2, dim=0)[1])
        else:
            out[f"{prefix}{up}.{p}"] = part(fc1 + p)
        out[f"{prefix}{down}.{p}"] = part(fc2 + p)
    return out


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def check_norm_biases(cfg: ModelConfig, read: Reader) -> None:
    """Megatron's LayerNorm always has a bias; without linear biases ours has none, so it must be zero."""
    if cfg.norm.kind != "layernorm" or cfg.bias:
        return
    keys = [layer_key(cfg, name, i) for name in (QKV + "layer_norm_bias", FC1 + "layer_norm_bias")
            for i in range(cfg.n_layers)] + [(FINAL_NORM + "bias", None)]
    for key, row in keys:  # small: d floats each
        if read(key, row).abs().max() > 0:
            raise ConversionError(f"{key}: Megatron's norm bias is non-zero but the linears have no biases; "
                                  "meshformer's model.bias covers norms and linears together, so this model "
                                  "cannot be represented exactly")


MEGATRON_OPTIMIZER = "optimizer."  # the key prefix of the optimizer state in a Megatron-LM training checkpoint


def _refuse_unread(folder: Path, cfg: ModelConfig, entries: Mapping[str, Any]) -> None:
    """Every tensor of the checkpoint has a place in ours (`megatron_sources` run on shapes alone, reading no
    data): one it lacks (a shared-expert gate, multi-token-prediction layers, ...) is refused, never dropped."""
    read: set[str] = set()

    def shape_of(key: str, layer: int | None) -> torch.Tensor:
        if key not in entries:
            raise ConversionError(f"{folder} has no tensor {key!r}, which a {cfg.family} model of its config needs "
                                  "(is it a Megatron-Core GPT checkpoint?)")
        read.add(key)
        size = tuple(entries[key].size)
        return torch.empty(size if layer is None else size[1:], device="meta")

    for make in megatron_sources(cfg, shape_of).values():
        make()
    if cfg.norm.kind == "layernorm" and not cfg.bias:  # read by check_norm_biases: zero, so nothing is lost
        read |= {key for key in entries if key.endswith("layer_norm_bias") or key == FINAL_NORM + "bias"}
    # Megatron-LM saves a training run's optimizer state into the same checkpoint ("optimizer.state.<name>.<key>",
    # "optimizer.distributed...."): not the model's, so neither imported nor a reason to refuse
    if unread := sorted(k for k in set(entries) - read if not k.startswith(MEGATRON_OPTIMIZER)):
        raise ConversionError(f"{folder} holds tensors with no meshformer counterpart, which importing would drop: "
                              f"{unread[:6]}{' ...' if len(unread) > 6 else ''}",
                              "only Megatron-Core GPT models that megatron_config.py maps can be imported")


def import_megatron(path: Path, *, n_heads: int | None = None, vocab_size: int | None = None,
                    activation: str | None = None, norm_eps: float | None = None, rope_theta: float | None = None,
                    max_seq_len: int | None = None, experts_per_token: int | None = None,
                    router_score: str | None = None, router_groups: int | None = None,
                    router_groups_per_token: int | None = None) -> tuple[ModelConfig, LazyState]:
    """(our config, our tensors read on access) from a Megatron-Core GPT torch_dist checkpoint. Options left None
    come from the model config that export_megatron writes beside the checkpoint; without one, n_heads is required
    (and experts_per_token for MoE layers).

    Streamed: each of our tensors is read when asked for, from one layer of Megatron's stacked tensor (only the
    saved chunks that hold that layer; the last two layer reads are kept, so q/k/v and gate/up read once)."""
    from meshformer.model import Transformer

    folder = resolve_megatron_dir(path)
    metadata = read_metadata(folder)
    cfg = resolve_import_config(folder, {"n_heads": n_heads, "vocab_size": vocab_size, "activation": activation,
                                         "norm_eps": norm_eps, "rope_theta": rope_theta, "max_seq_len": max_seq_len,
                                         "experts_per_token": experts_per_token, "router_score": router_score,
                                         "router_groups": router_groups,
                                         "router_groups_per_token": router_groups_per_token})
    entries = tensor_entries(metadata)

    @functools.lru_cache(maxsize=2)
    def read(key: str, layer: int | None) -> torch.Tensor:
        size = tuple(entries[key].size)
        if layer is None:
            return read_box(folder, key, (0,) * len(size), size)
        return read_box(folder, key, (layer,) + (0,) * (len(size) - 1), (1, *size[1:]))[0]

    check_norm_biases(cfg, read)
    sources = megatron_sources(cfg, read)
    _refuse_unread(folder, cfg, entries)
    dtype = entries[EMBEDDING].properties.dtype
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in Transformer(cfg).state_dict().items()}
    router_bias = {k for k in shapes if k.endswith(".router.expert_bias")}  # fp32 whatever the weights are
    return cfg, LazyState(list(sources), lambda name: sources[name](),
                          lambda name: torch.empty(shapes[name][0], dtype=torch.float32 if name in router_bias
                                                   else dtype, device="meta"))
