"""The values of a Hugging Face config.json, checked before transformers or meshformer builds anything from them.

Keys that mean the same in every architecture are checked from one typed table (`VALUES`): a count given as a
string, a negative RoPE base, a dtype torch does not have or a scaling factor of "eight" is refused in one line
naming the key, instead of failing deep inside transformers or computing something else. Each architecture's sizes
(`HFAdapter.size_keys`) must be positive integers and its layer counts no deeper than the checkpoint has tensors;
`layer_types` must hold layer types its adapter builds (`HFAdapter.hf_layer_types`), as transformers reads them.

Where config.json gives a RoPE value twice (at the top level and in rope_parameters, or rope_parameters beside the
older rope_scaling), the value transformers uses is the one imported, and a note says which.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from meshformer.checkpointing.hf_adapter import HFAdapter, find_adapter

Check = tuple[Callable[[Any], bool], str]  # (accepts the value, what a value must be)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


POSITIVE_INT: Check = (lambda v: _integer(v) and v > 0, "a positive integer")
COUNT: Check = (lambda v: _integer(v) and v >= 0, "a whole number >= 0")
POSITIVE: Check = (lambda v: _number(v) and v > 0, "a positive number")
NON_NEGATIVE: Check = (lambda v: _number(v) and v >= 0, "a number >= 0")
NUMBER: Check = (_number, "a finite number")
AT_LEAST_ONE: Check = (lambda v: _number(v) and v >= 1, "a number >= 1")
FRACTION: Check = (lambda v: _number(v) and 0 < v <= 1, "a fraction in (0, 1] (of each head's width)")
PROBABILITY: Check = (lambda v: _number(v) and 0 <= v < 1, "a probability in [0, 1)")
BOOL: Check = (lambda v: isinstance(v, bool), "true or false")
TEXT: Check = (lambda v: isinstance(v, str), "a string")

# config.json keys with one meaning across architectures (None is always accepted: the key is unset)
VALUES: dict[str, Check] = {
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "n_shared_experts",
                     "first_k_dense_replace", "num_nextn_predict_layers", "max_window_layers",
                     "shared_expert_intermediate_size"), COUNT),
    **dict.fromkeys(("num_experts_per_tok", "moe_intermediate_size", "head_dim", "sliding_window", "kv_lora_rank",
                     "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
                     "decoder_sparse_step", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "relative_attention_num_buckets",
                     "relative_attention_max_distance", "n_inner"), POSITIVE_INT),
    **dict.fromkeys(("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "routed_scaling_factor",
                     "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
                     "swiglu_limit"), POSITIVE),
    **dict.fromkeys(("initializer_range", "router_aux_loss_coef", "router_z_loss_coef"), NON_NEGATIVE),
    **dict.fromkeys(("attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
                     "dropout_rate", "resid_pdrop", "embd_pdrop", "attn_pdrop"), PROBABILITY),
    "partial_rotary_factor": FRACTION,
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_qk_norm", "norm_topk_prob",
                     "use_sliding_window"), BOOL),
    **dict.fromkeys(("hidden_act", "hidden_activation"), TEXT),
}
# the keys of one rope_parameters (or rope_scaling) table
ROPE_VALUES: dict[str, Check] = {
    "rope_type": TEXT, "type": TEXT, "rope_theta": POSITIVE, "factor": AT_LEAST_ONE,
    "original_max_position_embeddings": POSITIVE_INT, "partial_rotary_factor": FRACTION, "truncate": BOOL,
    **dict.fromkeys(("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"), POSITIVE),
    **dict.fromkeys(("mscale", "mscale_all_dim"), NUMBER),
}
ROPE_TABLES = ("rope_parameters", "rope_scaling")
DTYPE_KEYS = ("torch_dtype", "dtype")
# RoPE values config.json may give at its top level too; transformers keeps rope_parameters' own where both are
TOP_LEVEL_ROPE = ("rope_theta", "partial_rotary_factor")

_noted: set[str] = set()  # notes this process printed already (a folder is opened more than once per command)


def check_values(raw: Mapping[str, Any], n_tensors: int) -> list[str]:
    """Raise ValueError naming the first value of `raw` (a config.json) that cannot be right; else the notes on which
    of two given values transformers uses."""
    adapter = find_adapter(raw.get("model_type"))
    if adapter is not None:
        _check_sizes(raw, adapter, n_tensors)
    for key, value in raw.items():
        if key in VALUES and value is not None:
            _check(key, value, VALUES[key])
    for key in DTYPE_KEYS:
        if raw.get(key) is not None:
            _check_dtype(key, raw[key])
    notes = _check_rope(raw)
    if isinstance(raw.get("text_config"), Mapping):  # a multimodal folder: its language model's own config
        notes += check_values(raw["text_config"], n_tensors)
    return notes


def _check(key: str, value: Any, check: Check) -> None:
    accepts, what = check
    if not accepts(value):
        raise ValueError(f"{key}={value!r} is not {what}")


def _check_sizes(raw: Mapping[str, Any], adapter: HFAdapter, n_tensors: int) -> None:
    """The architecture's sizes are positive integers, and no stack is deeper than the checkpoint has tensors (every
    layer holds some), so an absurd depth is refused instead of building that many layers."""
    for key in adapter.size_keys:
        if raw.get(key) is not None:
            _check(key, raw[key], POSITIVE_INT)
    for key in adapter.layer_keys:
        if (raw.get(key) or 0) > n_tensors:
            raise ValueError(f"{key}={raw[key]} layers, but the checkpoint holds only {n_tensors} tensors")
    width, heads = adapter.width_and_heads or ("", "")
    if width in raw and heads in raw and raw[width] % raw[heads]:
        raise ValueError(f"{width}={raw[width]} is not divisible by {heads}={raw[heads]}")


def _check_dtype(key: str, value: Any) -> None:
    import torch

    if not (isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)
            and getattr(torch, value).is_floating_point):
        raise ValueError(f"{key}={value!r} is not a torch floating-point dtype (e.g. 'bfloat16', 'float16', "
                         "'float32')")


def _rope_tables(raw: Mapping[str, Any], key: str) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, table) of config.json's `key`: one table, or one per layer type (Gemma 3, OLMo 3)."""
    table = raw.get(key)
    if table is None:
        return []
    if not isinstance(table, Mapping):
        raise ValueError(f"{key}={table!r} is not a table of RoPE parameters")
    if table and all(isinstance(v, Mapping) for v in table.values()):
        return [(f"{key}.{kind}", inner) for kind, inner in table.items()]
    return [(key, table)]


def _check_rope(raw: Mapping[str, Any]) -> list[str]:
    notes = []
    tables = {key: _rope_tables(raw, key) for key in ROPE_TABLES}
    for name, table in (t for found in tables.values() for t in found):
        for key, value in table.items():
            if key in ROPE_VALUES and value is not None:
                _check(f"{name}.{key}", value, ROPE_VALUES[key])
    # transformers: rope_scaling (the older name) replaces rope_parameters; inside the table used, its own
    # rope_theta and partial_rotary_factor win over the top-level ones
    used = tables["rope_scaling"] or tables["rope_parameters"]
    if tables["rope_scaling"] and tables["rope_parameters"] and raw["rope_scaling"] != raw["rope_parameters"]:
        notes.append(f"config.json gives both rope_scaling={raw['rope_scaling']} and rope_parameters="
                     f"{raw['rope_parameters']}; transformers uses rope_scaling, and so does this import")
    for key in TOP_LEVEL_ROPE:
        if raw.get(key) is None:
            continue
        for name, table in used:
            if table.get(key) is not None and table[key] != raw[key]:
                notes.append(f"config.json gives {key}={raw[key]} at its top level and {table[key]} in {name}; "
                             f"transformers uses the one in {name}, and so does this import")
    return notes


def check_layer_types(hf_config: Any, raw: Mapping[str, Any], adapter: HFAdapter) -> None:
    """`layer_types` as transformers read it (it renames some older values: "mamba" is "linear_attention") holds only
    layer types the adapter's blocks compute."""
    read: list[Any] = list(getattr(hf_config, "layer_types", None) or [])
    given = raw.get("layer_types")
    written: list[Any] = given if isinstance(given, list) else read
    for i, layer_type in enumerate(read):
        if layer_type not in adapter.hf_layer_types:
            was = written[i] if i < len(written) else layer_type
            how = f" (transformers reads it as {layer_type!r})" if was != layer_type else ""
            raise ValueError(f"layer_types[{i}]={was!r}{how} is not a layer type meshformer imports for "
                             f"{adapter.model_type}, which has {' / '.join(map(repr, adapter.hf_layer_types))}")


def note(notes: list[str]) -> None:
    """Each note on stderr once per process, from the first rank only."""
    if os.environ.get("RANK", "0") != "0":
        return
    for line in notes:
        if line not in _noted:
            _noted.add(line)
            print(f"note: {line}", file=sys.stderr)
