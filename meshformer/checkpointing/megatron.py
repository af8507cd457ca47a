"""Megatron-Core `torch_dist` checkpoints of GPT models <-> meshformer weights, without importing megatron.

A torch_dist checkpoint is a DCP folder (.metadata, __R_T.distcp) plus common.pt and metadata.json. Its GPT
tensors are global (any TP/PP layout that saved them): per-layer weights are stacked on a leading layer
axis; linear_qkv packs, for each query group, that group's query heads, then its key head, then its value
head; the local spec names the pre-attention and pre-MLP norms linear_qkv.layer_norm_* and
linear_fc1.layer_norm_*; SwiGLU's linear_fc1 is [gate; up]. Megatron's RoPE rotates halves (not pairs), as
ours does. Vocabulary rows beyond the model's vocabulary are Megatron's padding.

What maps: decoder-only, pre-norm with a final norm, LayerNorm or RMSNorm, GELU / tanh-GELU / ReLU / SwiGLU,
learned absolute positions or RoPE, MHA/GQA/MQA, tied or untied output, with or without linear biases
(`model.bias` covers q/k/v/o and MLP biases together, so Megatron's add_qkv_bias must equal add_bias_linear).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from meshformer.checkpointing.dcp_io import read_box, read_metadata, save_tensors_streamed, tensor_entries
from meshformer.checkpointing.errors import ConversionError
from meshformer.checkpointing.safetensors_io import LazyState
from meshformer.config import Activation, ModelConfig
from meshformer.model.families import FAMILIES
from meshformer.model.families.naming import MegatronNames

LAYER = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm."
OUTPUT = "output_layer.weight"
QKV, PROJ = LAYER + "self_attention.linear_qkv.", LAYER + "self_attention.linear_proj."
FC1, FC2 = LAYER + "mlp.linear_fc1.", LAYER + "mlp.linear_fc2."
_EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
BACKEND_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                    "common_backend_version": 1}
GPT = "GPTModel"  # the Megatron-Core model this module reads and writes
_ITER_DIR = re.compile(r"^iter_(\d+)$")
SAVED_CONFIG = "meshformer_model_config.json"  # written by export_megatron beside the iter_* folders
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's pointer to the newest iter_* folder
# import_megatron's options, by the command-line flag that sets them
_OPTIONS = {"n_heads": "--heads", "vocab_size": "--vocab-size", "activation": "--activation",
            "norm_eps": "--norm-eps", "rope_theta": "--rope-theta", "max_seq_len": "--max-seq-len"}
# what the tensors themselves determine, to check a saved config against
_FROM_TENSORS = ("d_model", "n_layers", "d_ff", "kv_heads", "norm", "position", "bias", "tie_embeddings")


# ----------------------------------------------------------------------------- compatibility


def megatron_incompatibilities(cfg: ModelConfig) -> list[str]:
    gpt_families = sorted(name for name, spec in FAMILIES.items() if spec.megatron and spec.megatron.model == GPT)
    checks = [
        (cfg.family in gpt_families, f"family={cfg.family!r} (needs one of {gpt_families}: Megatron {GPT})"),
        (cfg.norm_position == "pre" and cfg.use_final_norm,
         "post-norm, post-sublayer or sandwich norms or no final norm (needs pre-norm + final)"),
        (cfg.position in ("learned", "rope"), f"position={cfg.position!r} (needs 'learned' or 'rope')"),
        (cfg.activation in ("gelu", "gelu_tanh", "relu", "swiglu"), f"activation={cfg.activation!r}"),
        (cfg.attention_scale is None, "a custom attention_scale (Megatron uses 1/sqrt(head_dim))"),
        (not cfg.scale_embeddings and not cfg.embedding_norm, "scale_embeddings / embedding_norm"),
        (not cfg.head_transform and not cfg.output_bias and not cfg.scale_output, "a BERT/T5-style output head"),
        (cfg.attention_window is None, "attention_window (sliding window)"),
        # options whose Megatron-Core counterparts (MoE layer, qk_layernorm, kv_channels, add_qkv_bias, rope
        # scaling) have no name mapping here yet: refused rather than written without them
        (cfg.n_experts == 0, "mixture-of-experts blocks (n_experts > 0)"),
        (not cfg.qk_norm, "qk_norm"),
        (cfg.attention_head_dim == cfg.d_model // cfg.n_heads, f"head_dim={cfg.head_dim} (not d_model / n_heads)"),
        (cfg.use_qkv_bias == cfg.bias, "qkv_bias different from bias"),
        (cfg.rope_scaling == "none", f"rope_scaling={cfg.rope_scaling!r}"),
        (cfg.norm_weight_offset == 0, f"norm_weight_offset={cfg.norm_weight_offset} (RMSNorm by offset + weight)"),
        (cfg.attention_softcap is None and cfg.logit_softcap is None, "attention_softcap / logit_softcap"),
    ]
    return [problem for ok, problem in checks if not ok]


def check_megatron_compatible(cfg: ModelConfig) -> MegatronNames:
    """Our names for the Megatron-Core GPT tensors (from the family spec), or a ConversionError saying why not."""
    problems = megatron_incompatibilities(cfg)
    if problems:
        raise ConversionError("this model cannot be written as a Megatron-Core GPT checkpoint: " + ", ".join(problems),
                              "export it to Hugging Face instead (`meshformer convert export-hf`)")
    names = FAMILIES[cfg.family].megatron
    assert names is not None  # megatron_incompatibilities refused families without Megatron names
    return names


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
    """Megatron's stacked keys -> how to make layer `layer` of each from our tensors (read when called)."""
    ours = check_megatron_compatible(cfg)
    prefix = f"{ours.layers}.{layer}."
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for p in ("weight", "bias") if cfg.norm == "layernorm" else ("weight",):
        out[QKV + f"layer_norm_{p}"] = functools.partial(_norm_param, state, prefix + ours.attn_norm, p)
        out[FC1 + f"layer_norm_{p}"] = functools.partial(_norm_param, state, prefix + ours.ffn_norm, p)
    for p in ("weight", "bias") if cfg.bias else ("weight",):
        out[QKV + p] = functools.partial(_packed_qkv, state, [f"{prefix}{name}.{p}" for name in ours.qkv], cfg)
        out[PROJ + p] = functools.partial(state.__getitem__, f"{prefix}{ours.attn_out}.{p}")
        gate, up = f"{prefix}{ours.gate}.{p}", f"{prefix}{ours.up}.{p}"
        out[FC1 + p] = functools.partial(_concatenated, state, [gate, up] if cfg.activation == "swiglu" else [up])
        out[FC2 + p] = functools.partial(state.__getitem__, f"{prefix}{ours.down}.{p}")
    return out


def _packed_qkv(state: Mapping[str, torch.Tensor], names: list[str], cfg: ModelConfig) -> torch.Tensor:
    q, k, v = (state[name] for name in names)
    return pack_qkv(q, k, v, cfg.n_heads, cfg.kv_heads)


def _concatenated(state: Mapping[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([state[name] for name in names]) if len(names) > 1 else state[names[0]]


def megatron_global_sources(state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int | None
                            ) -> dict[str, Callable[[], torch.Tensor]]:
    """Megatron's unstacked keys (embeddings, final norm, output layer) -> how to make each from our tensors."""
    ours = check_megatron_compatible(cfg)
    out: dict[str, Callable[[], torch.Tensor]] = {EMBEDDING: lambda: _pad_rows(state[ours.embedding], padded_vocab)}
    if cfg.position == "learned":
        out[POSITIONS] = lambda: state[ours.positions].contiguous()
    for p in ("weight", "bias") if cfg.norm == "layernorm" else ("weight",):
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


def export_megatron(state: Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: Path, *, iteration: int = 0,
                    pad_vocab_multiple: int = 1) -> Path:
    """Write `out_dir/iter_<N>/` (torch_dist) and `latest_checkpointed_iteration.txt`; returns the iter folder.

    Streamed, as Megatron itself saves: each stacked tensor is written one chunk per layer, each chunk made from
    our tensors when the writer comes to it, so at most one layer's tensor is in memory."""
    padded = -(-cfg.vocab_size // pad_vocab_multiple) * pad_vocab_multiple
    singles = megatron_global_sources(state, cfg, padded)
    layers = [megatron_layer_sources(state, cfg, i) for i in range(cfg.n_layers)]
    shapes = _MetaState(state)  # templates: the same recipes on meta tensors
    templates: dict[str, object] = {key: make() for key, make in megatron_global_sources(shapes, cfg, padded).items()}
    for key, make in megatron_layer_sources(shapes, cfg, 0).items():
        row = make()
        templates[key] = row.new_empty(cfg.n_layers, *row.shape)
    for module in _EXTRA_STATE_MODULES:  # local-spec linears carry an empty extra state per layer
        for i in range(cfg.n_layers):  # Megatron stores each sharded object as a one-item list
            templates[f"{LAYER}{module}._extra_state/shard_{i}_{cfg.n_layers}"] = [None]
    folder = Path(out_dir) / f"iter_{iteration:07d}"
    save_tensors_streamed(templates, lambda key: singles[key](), folder,
                          read_row={key: functools.partial(_layer_tensor, layers, key) for key in layers[0]})
    torch.save({}, folder / "common.pt")  # GPTModel has no non-sharded state; Megatron-LM adds its args here
    (folder / "metadata.json").write_text(json.dumps(BACKEND_METADATA))
    (Path(out_dir) / TRACKER).write_text(str(iteration))
    (Path(out_dir) / SAVED_CONFIG).write_text(json.dumps(asdict(cfg), indent=2))
    return folder


def _layer_tensor(layers: list[dict[str, Callable[[], torch.Tensor]]], key: str, layer: int) -> torch.Tensor:
    return layers[layer][key]()


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


def infer_config(folder: Path, *, n_heads: int, vocab_size: int | None = None, activation: Activation | None = None,
                 norm_eps: float = 1e-5, rope_theta: float = 10000.0, max_seq_len: int | None = None) -> ModelConfig:
    """A ModelConfig from tensor shapes; only the head count (and the true vocabulary) cannot be read off them."""
    shapes = {k: tuple(v.size) for k, v in tensor_entries(read_metadata(folder)).items()}
    if QKV + "weight" not in shapes or EMBEDDING not in shapes:
        raise ConversionError(f"{folder} holds no Megatron GPT tensors ({QKV}weight, {EMBEDDING}); the TE spec "
                              "and other models are not supported")
    n_layers, qkv_rows, d_model = shapes[QKV + "weight"]
    d_ff = shapes[FC2 + "weight"][2]
    glu = shapes[FC1 + "weight"][1] == 2 * d_ff
    head_dim = shapes[PROJ + "weight"][2] // n_heads
    if head_dim * n_heads != shapes[PROJ + "weight"][2]:
        raise ConversionError(f"n_heads={n_heads} does not divide the attention width {shapes[PROJ + 'weight'][2]}")
    n_groups = (qkv_rows // head_dim - n_heads) // 2
    if n_groups <= 0 or n_heads % n_groups or (n_heads + 2 * n_groups) * head_dim != qkv_rows:
        raise ConversionError(f"linear_qkv has {qkv_rows} rows, which does not fit n_heads={n_heads}; pass the "
                              "model's true number of attention heads")
    has_bias = PROJ + "bias" in shapes
    if has_bias != (QKV + "bias" in shapes):
        raise ConversionError("the checkpoint has biases on linear_qkv xor the other linears (add_qkv_bias != "
                              "add_bias_linear); meshformer's model.bias covers both")
    learned = POSITIONS in shapes
    padded_vocab = shapes[EMBEDDING][0]
    if vocab_size is not None and vocab_size > padded_vocab:
        raise ConversionError(f"vocabulary {vocab_size} is larger than the checkpoint's {padded_vocab} embedding rows "
                              "— pass the model's true --vocab-size (at most the padded size)")
    if glu and activation not in (None, "swiglu"):
        raise ConversionError(f"linear_fc1 is gated (2 x d_ff rows) but activation={activation!r} was asked")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size or padded_vocab, d_model=d_model, n_heads=n_heads,
        n_kv_heads=None if n_groups == n_heads else n_groups, n_layers=n_layers, d_ff=d_ff,
        activation="swiglu" if glu else (activation or "gelu"),
        norm="layernorm" if QKV + "layer_norm_bias" in shapes else "rmsnorm", norm_eps=norm_eps,
        norm_position="pre", final_norm=True, position="learned" if learned else "rope", rope_theta=rope_theta,
        max_seq_len=shapes[POSITIONS][0] if learned else (max_seq_len or 4096),
        tie_embeddings=OUTPUT not in shapes, bias=has_bias, init="normal",
    )


def megatron_sources(cfg: ModelConfig, read: Callable[[str, int | None], torch.Tensor]
                     ) -> dict[str, Callable[[], torch.Tensor]]:
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
    norm_params = ("weight", "bias") if cfg.norm == "layernorm" and cfg.bias else ("weight",)
    for p in norm_params:
        out[f"{ours.final_norm}.{p}"] = functools.partial(read, FINAL_NORM + p, None)
    linear_params = ("weight", "bias") if cfg.bias else ("weight",)

    def part(key: str, layer: int, pick: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: pick(read(key, layer)).contiguous()

    def qkv_part(j: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: unpack_qkv(t, cfg.n_heads, cfg.kv_heads)[j]

    for i in range(cfg.n_layers):
        o = f"{ours.layers}.{i}."
        for p in norm_params:
            out[f"{o}{ours.attn_norm}.{p}"] = part(QKV + f"layer_norm_{p}", i, _same)
            out[f"{o}{ours.ffn_norm}.{p}"] = part(FC1 + f"layer_norm_{p}", i, _same)
        for p in linear_params:
            for j, name in enumerate(ours.qkv):
                out[f"{o}{name}.{p}"] = part(QKV + p, i, qkv_part(j))
            out[f"{o}{ours.attn_out}.{p}"] = part(PROJ + p, i, _same)
            if cfg.activation == "swiglu":  # linear_fc1 is [gate; up]
                out[f"{o}{ours.gate}.{p}"] = part(FC1 + p, i, lambda t: t.chunk(2, dim=0)[0])
                out[f"{o}{ours.up}.{p}"] = part(FC1 + p, i, lambda t: t.chunk(2, dim=0)[1])
            else:
                out[f"{o}{ours.up}.{p}"] = part(FC1 + p, i, _same)
            out[f"{o}{ours.down}.{p}"] = part(FC2 + p, i, _same)
    return out


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def check_norm_biases(cfg: ModelConfig, read: Callable[[str, int | None], torch.Tensor]) -> None:
    """Megatron's LayerNorm always has a bias; without linear biases ours has none, so it must be zero."""
    if cfg.norm != "layernorm" or cfg.bias:
        return
    for key in (QKV + "layer_norm_bias", FC1 + "layer_norm_bias", FINAL_NORM + "bias"):  # small: L x d at most
        if read(key, None).abs().max() > 0:
            raise ConversionError(f"{key}: Megatron's norm bias is non-zero but the linears have no biases; "
                                  "meshformer's model.bias covers norms and linears together, so this model "
                                  "cannot be represented exactly")


def read_saved_config(folder: Path) -> tuple[Path, ModelConfig] | None:
    """The model config that export_megatron wrote beside (or in) the torch_dist folder, if any."""
    from meshformer.config import ConfigError, build_section

    for file in (folder.parent / SAVED_CONFIG, folder / SAVED_CONFIG):
        if file.is_file():
            try:
                return file, build_section(ModelConfig, json.loads(file.read_text()), "model")
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
    inferred = infer_config(folder, **{**{k: getattr(cfg, k) for k in _OPTIONS}, **given})
    contradictions = [f"{_OPTIONS[k]} {v!r} contradicts {k}={getattr(cfg, k)!r}" for k, v in given.items()
                      if v != getattr(cfg, k)]
    contradictions += [f"{k}={getattr(cfg, k)!r} in the file but {k}={getattr(inferred, k)!r} in the tensors"
                       for k in _FROM_TENSORS if getattr(cfg, k) != getattr(inferred, k)]
    if contradictions:
        raise ConversionError(f"{file} and the checkpoint disagree: {'; '.join(contradictions)} — drop the "
                              "options that contradict it (the saved config is used), or remove a stale file")
    return cfg


def import_megatron(path: Path, *, n_heads: int | None = None, vocab_size: int | None = None,
                    activation: Activation | None = None, norm_eps: float | None = None,
                    rope_theta: float | None = None, max_seq_len: int | None = None) -> tuple[ModelConfig, LazyState]:
    """(our config, our tensors read on access) from a Megatron-Core GPT torch_dist checkpoint. Options left None
    come from the model config that export_megatron writes beside the checkpoint; without one, n_heads is required.

    Streamed: each of our tensors is read when asked for, from one layer of Megatron's stacked tensor (only the
    saved chunks that hold that layer; the last two layer reads are kept, so q/k/v and gate/up read once)."""
    from meshformer.model import Transformer

    folder = resolve_megatron_dir(path)
    metadata = read_metadata(folder)
    cfg = resolve_import_config(folder, {"n_heads": n_heads, "vocab_size": vocab_size, "activation": activation,
                                         "norm_eps": norm_eps, "rope_theta": rope_theta, "max_seq_len": max_seq_len})
    entries = tensor_entries(metadata)

    @functools.lru_cache(maxsize=2)
    def read(key: str, layer: int | None) -> torch.Tensor:
        size = tuple(entries[key].size)
        if layer is None:
            return read_box(folder, key, (0,) * len(size), size)
        return read_box(folder, key, (layer,) + (0,) * (len(size) - 1), (1, *size[1:]))[0]

    check_norm_biases(cfg, read)
    sources = megatron_sources(cfg, read)
    dtype = entries[EMBEDDING].properties.dtype
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    return cfg, LazyState(list(sources), lambda name: sources[name](),
                          lambda name: torch.empty(shapes[name], dtype=dtype, device="meta"))
