"""`checkpoint.init_from = "hf:PATH"`: continued pretraining from a Hugging Face model folder.

    cfg = resolve_init_from(cfg)                 # model config (and tokenizer) from the folder; idempotent
    ... after a resume found no checkpoint of this run:
    load_init_weights(parallel_model.model_parts, cfg)   # this rank's shards, read tensor by tensor

The model config comes from the folder's config.json (as `convert import-hf` reads it); a `[model]` key the
user set is kept only where it leaves the function alone (dropout, attention kernel, training-only MoE terms),
any other that differs is refused by name. The tokenizer is the folder's unless data.tokenizer names another.
Once this run holds a checkpoint, its model config comes from there and its weights from a resume: the HF
folder is never read again.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshformer.checkpointing import directory
from meshformer.checkpointing.checkpoint_errors import ConversionError
from meshformer.checkpointing.formats import ARCHS, Arch
from meshformer.checkpointing.manager import checkpoint_root
from meshformer.config import Config, DataConfig, ModelConfig, given_keys
from meshformer.config.migrate import dotted_values, get_dotted, model_from_dict, with_dotted
from meshformer.errors import ConfigError

PREFIX = "hf:"
# Beside the run's final weights: the architecture the run started from, which `convert export-hf` writes by default
# (a Mistral folder without a sliding window is also a Llama, for instance)
SOURCE_FILE = "hf_source.json"
# [model] keys that change how the model trains (or which kernel computes it), not the function it computes
FUNCTION_NEUTRAL = ("dropout", "attention.dropout", "attention.backend", "moe.backend", "attention.document_mask",
                    "init.method", "init.std", "moe.aux_loss", "moe.aux_per_sequence", "moe.router_z_loss",
                    "moe.router_bias_update_rate")


def hf_folder(cfg: Config) -> Path | None:
    """The folder checkpoint.init_from names (None: a run from scratch)."""
    source = cfg.checkpoint.init_from
    return Path(source.removeprefix(PREFIX)).expanduser() if source.startswith(PREFIX) else None


def resolve_init_from(cfg: Config) -> Config:
    """`cfg` with its model config from the HF folder (or, once this run has checkpoints, from the newest one) and
    data.tokenizer the folder's when left at its default; unchanged without checkpoint.init_from."""
    folder = hf_folder(cfg)
    if folder is None:
        return cfg
    from meshformer.config.validate import validate

    saved = _newest_saved_config(cfg)
    source_model = saved["model"] if saved is not None else _hf_model_config(folder)
    given = {key.removeprefix("model.") for key in given_keys(cfg) if key.startswith("model.")}
    model = _merge(source_model, cfg.model, f"{PREFIX}{folder}" if saved is None else "this run's checkpoints",
                   given, cfg.data)
    data = cfg.data
    if data.tokenizer == DataConfig.tokenizer:  # left at its default: the model's own tokenizer
        tokenizer = saved.get("data", {}).get("tokenizer", str(folder)) if saved is not None else str(folder)
        data = dataclasses.replace(data, tokenizer=tokenizer)
    resolved = dataclasses.replace(cfg, model=model, data=data)
    validate(resolved)
    return resolved


def _newest_saved_config(cfg: Config) -> dict[str, Any] | None:
    """The config this run's newest committed checkpoint was saved with (None: no checkpoint, or resume off)."""
    root = checkpoint_root(cfg)
    steps = directory.committed_steps(root)
    if not cfg.checkpoint.resume or not steps:
        return None
    state_file = root / directory.step_dir_name(steps[-1]) / directory.TRAINER_STATE
    try:
        return json.loads(state_file.read_text())["config"]
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"checkpoint.init_from: cannot read the model config of {state_file} ({err})",
                          "resume checks that checkpoint; move a damaged one out of checkpoint.dir") from None


def _hf_model_config(folder: Path) -> ModelConfig:
    """The folder's model config, once its tensors' names and shapes fit it (as `convert import-hf` checks them):
    a config.json that disagrees with its tensors is refused before any memory or disk is sized from it."""
    from meshformer.checkpointing.hf_folder import import_hf

    return import_hf(folder)[0]


def _merge(source: ModelConfig | dict[str, Any], user: ModelConfig, where: str,
           given: set[str] | frozenset[str] = frozenset(), data: DataConfig | None = None) -> ModelConfig:
    """The source's model config with the user's function-neutral keys; any other key the user set (wrote, in
    `given`, even at ModelConfig's default value; or differs from that default) and that differs from the source's
    is refused by name, all in one line (with a data.seq_len beyond the source's context)."""
    base = source if isinstance(source, ModelConfig) else model_from_dict(source, where)
    mine, theirs, default = (dotted_values(c) for c in (user, base, ModelConfig()))
    # .get: a table of free keys (norm.by_kind) holds keys that another config lacks
    changed = {key: value for key, value in mine.items()
               if (key in given or value != default.get(key)) and value != theirs.get(key)}
    if "moe.d_ff" in changed and with_dotted(base, {"moe.d_ff": user.moe.d_ff}).expert_d_ff == base.expert_d_ff:
        del changed["moe.d_ff"]  # the folder's expert width, named as moe.d_ff where it has 0 (= d_ff): same function
    refused = {key: value for key, value in changed.items() if key not in FUNCTION_NEUTRAL}
    too_long = (data is not None and base.position in ("learned", "sinusoidal", "rope")
                and data.seq_len > base.max_seq_len)
    if refused or too_long:
        listed = [f"model.{k}={v!r} (it has {theirs.get(k)!r})" for k, v in refused.items()]
        if too_long and data is not None:
            listed.append(f"data.seq_len={data.seq_len} (its context is {base.max_seq_len})")
        raise ConfigError(f"checkpoint.init_from: {', '.join(listed)} conflict with the model from {where}",
                          "remove those [model] keys (the model config comes from the folder; only "
                          f"{', '.join(FUNCTION_NEUTRAL)} may be set)"
                          + (f" and set data.seq_len <= {base.max_seq_len}" if too_long else ""))
    return with_dotted(base, changed)


class HFInitWeights:
    """An HF folder's tensors under our names, read the way `weights.load_into` reads a weights folder: a tensor
    that is only renamed is read by slices (this rank's shard alone), any other (transposed, split or stacked
    experts) whole, one at a time."""

    def __init__(self, folder: Path) -> None:
        from meshformer.checkpointing import hf
        from meshformer.checkpointing.hf_folder import import_hf, open_hf
        from meshformer.checkpointing.sharded_safetensors import SafetensorsFolder, has_safetensors

        self.cfg, self.state = import_hf(folder)  # names and shapes checked here, before any data is read
        _, arch, theirs = open_hf(folder)
        self.arch: str = arch
        original = hf._normalize_names({k: k for k in theirs}, arch)  # normalised name -> name in the files
        self.files = SafetensorsFolder(folder) if has_safetensors(folder) else None
        self.renamed = {rule.ours[0]: original[rule.theirs] for rule in hf.name_rules(self.cfg, arch)
                        if not rule.alias and len(rule.ours) == 1 and not rule.transpose and rule.expert is None
                        and rule.theirs_shape is None
                        and not (self.files and _quantized_in_files(self.files, original[rule.theirs]))}
        if self.cfg.tie_embeddings and "tok_embeddings.weight" in self.renamed:
            self.renamed["output.weight"] = self.renamed["tok_embeddings.weight"]

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def get(self, name: str) -> torch.Tensor:
        return self.state[name]

    def get_slice(self, name: str) -> Any:
        if self.files is not None and name in self.renamed:
            return self.files.get_slice(self.renamed[name])
        return self.state[name]


def _quantized_in_files(files: Any, name: str) -> bool:
    """Whether the files hold `name` quantized (an FP8 weight) or not at all (an MXFP4 tensor, stored as blocks and
    scales): such a tensor is read whole, dequantized, never by slices of the file."""
    return name not in files or files.meta(name).dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def load_init_weights(parts: list[torch.nn.Module], cfg: Config, between: Callable[[], None] | None = None) -> str:
    """Fill this rank's (sharded) model parts from checkpoint.init_from's folder (every rank calls it); returns
    the folder's architecture (its model_type). `between`: as for `weights.load_into`."""
    from meshformer.checkpointing.weights import load_into

    folder = hf_folder(cfg)
    assert folder is not None, "load_init_weights needs checkpoint.init_from"
    source = HFInitWeights(folder)
    if source.cfg != with_dotted(cfg.model, {k: get_dotted(source.cfg, k) for k in FUNCTION_NEUTRAL}):
        raise ConversionError(f"{folder} now holds another model than the one this run was configured from",
                              "point checkpoint.init_from at the folder the run started with")
    try:
        load_into(parts, source, between)
    except ConversionError as err:  # a tensor read whole (transposed, split or stacked) that holds NaN or inf
        raise ConversionError(f"checkpoint.init_from: {err.what}", err.fix) from None
    _refuse_nonfinite(parts, folder, source)
    return source.arch


def _refuse_nonfinite(parts: list[torch.nn.Module], folder: Path, source: HFInitWeights) -> None:
    """The tensors read by slices, straight from the folder's files (`HFInitWeights.renamed`), checked as
    `convert import-hf` checks every tensor it reads (`refuse_nonfinite`; the others were checked as read): this
    rank's part of each."""
    from meshformer.checkpointing.hf_folder import refuse_nonfinite
    from meshformer.checkpointing.state import named_parameters
    from meshformer.parallel.grad_norm import local_tensor

    for name, param in named_parameters(parts):
        try:
            refuse_nonfinite(local_tensor(param).detach(), source.renamed.get(name, name), name, folder)
        except ConversionError as err:
            raise ConversionError(f"checkpoint.init_from: {err.what}", err.fix) from None


def taken_from_folder(cfg: Config, arch: str, seconds: float) -> str:
    """One log line: what this run took from checkpoint.init_from's folder (model, tokenizer, weights)."""
    folder, m = hf_folder(cfg), cfg.model
    model = (f"model ({arch}: {m.n_layers} layers, d_model {m.d_model}, {m.attention.n_heads} heads, "
             f"vocab {m.vocab_size}, "
             f"context {m.max_seq_len})")
    tokenizer = "tokenizer" if cfg.data.tokenizer == str(folder) else f"not its tokenizer (data.tokenizer = " \
                                                                      f"{cfg.data.tokenizer})"
    return f"from {cfg.checkpoint.init_from}: {model}, {tokenizer}, step 0 weights (read in {seconds:.2f}s)"


def record_source(run_dir: Path, cfg: Config, arch: str) -> None:
    """Note in the run folder which architecture the run started from (for its final weights)."""
    folder = hf_folder(cfg)
    assert folder is not None, "record_source needs checkpoint.init_from"
    write_source(run_dir, folder, arch, cfg.checkpoint.init_from)


def write_source(folder: Path, hf_dir: Path, arch: str, init_from: str | None = None) -> None:
    """Note in `folder` the architecture and the config.json of the Hugging Face folder its weights came from, so
    that `convert export-hf` writes that architecture and keeps the keys meshformer does not model (special-token
    ids, serving settings)."""
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = None  # the architecture alone still picks the export's
    (Path(folder) / SOURCE_FILE).write_text(json.dumps({"init_from": init_from, "model_type": arch,
                                                         "config": config if isinstance(config, dict) else None}))


def source_config(folder: Path) -> dict[str, Any] | None:
    """The config.json of the Hugging Face folder a weights folder came from (None: none noted, or unreadable)."""
    path = Path(folder) / SOURCE_FILE
    try:
        config = json.loads(path.read_text()).get("config") if path.is_file() else None
    except (ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def source_arch(folder: Path) -> Arch | None:
    """The architecture a weights folder's run started from (None: not started from a Hugging Face folder, or an
    unreadable note: export then infers the architecture, as for any weights folder)."""
    path = Path(folder) / SOURCE_FILE
    try:
        arch = json.loads(path.read_text())["model_type"] if path.is_file() else None
    except (ValueError, KeyError, TypeError):
        return None
    return next((known for known in ARCHS if known == arch), None)
