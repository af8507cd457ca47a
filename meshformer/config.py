"""One typed config tree, loaded from TOML with dotted command-line overrides.

    cfg = load_config("configs/tiny-gpt.toml", ["train.steps=200", "model.n_layers=4"])
    cfg = load_config("tiny-gpt")  # a bundled config by name (shipped inside the package)

Every section is a dataclass; unknown keys, wrong types and inconsistent values raise a
`ConfigError` that names the key and the fix before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

from meshformer.errors import MeshformerError


class ConfigError(MeshformerError, ValueError):
    """A configuration problem, phrased as what is wrong and how to fix it."""


Family = Literal["decoder", "encoder", "encoder_decoder"]
Activation = Literal["relu", "gelu", "gelu_tanh", "swiglu"]
Recompute = Literal["none", "full", "selective", "every_k"]


@dataclass
class ModelConfig:
    family: Family = "decoder"
    vocab_size: int = 4096
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: multi-head; 1: multi-query; else grouped-query
    n_layers: int = 4  # decoder-only / encoder-only stack depth
    n_encoder_layers: int | None = None  # encoder-decoder; None: n_layers
    n_decoder_layers: int | None = None  # encoder-decoder; None: n_layers
    d_ff: int = 512
    activation: Activation = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    norm_position: Literal["pre", "post"] = "pre"
    final_norm: bool | None = None  # norm after each stack; None: only with pre-norm
    embedding_norm: bool = False  # norm right after the embeddings (BERT)
    position: Literal["sinusoidal", "learned", "rope", "alibi", "t5_relative", "none"] = "learned"
    rope_theta: float = 10000.0
    relative_buckets: int = 32  # t5_relative: learned bias buckets per stack (half per direction in the encoder)
    relative_max_distance: int = 128  # t5_relative: distances beyond this share the last bucket
    max_seq_len: int = 256
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model)
    tie_embeddings: bool = True  # output projection shares the (target) token embedding
    share_embeddings: bool = True  # encoder-decoder: one embedding for source and target
    bias: bool = True  # biases in linear layers and norms
    head_transform: bool = False  # BERT prediction head: dense + act + norm before output
    output_bias: bool = False
    dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_window: int | None = None  # sliding window: keys with |i - j| < window
    attention_backend: Literal["sdpa", "math", "flash", "cudnn", "efficient"] = "sdpa"  # or that SDPA kernel first
    attention_scale: float | None = None  # score multiplier; None: 1/sqrt(head_dim) (T5 folds it into init: 1.0)
    scale_output: bool = False  # multiply final hidden states by d_model**-0.5 before the output projection (T5)
    cross_downsample: int = 1  # pool encoder output by this factor before cross-attention
    init: Literal["normal", "xavier"] = "normal"
    init_std: float = 0.02

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    # Layers in each stack (0 without one); the model's `encoder_layers` / `decoder_layers` modules hold them.
    @property
    def encoder_depth(self) -> int:
        if self.family == "decoder":
            return 0
        if self.family == "encoder":
            return self.n_layers
        return self.n_encoder_layers if self.n_encoder_layers is not None else self.n_layers

    @property
    def decoder_depth(self) -> int:
        if self.family == "encoder":
            return 0
        if self.family == "decoder":
            return self.n_layers
        return self.n_decoder_layers if self.n_decoder_layers is not None else self.n_layers

    @property
    def use_final_norm(self) -> bool:
        return self.norm_position == "pre" if self.final_norm is None else self.final_norm


@dataclass
class DataSourceConfig:
    """One `[[data.sources]]` table of a mixture."""

    shards: str = ""  # manifest.json (path or URL) of prepared shards
    weight: float = 1.0  # share of samples, relative to the other sources' weights
    name: str = ""  # label in logs (data/<name>/tokens); "": source<i>


@dataclass
class DataConfig:
    corpus: str = "bundled:kjv"  # "bundled:kjv", a text/JSONL(.gz) file or a directory
    text_field: str = "text"  # JSONL field holding the text
    tokenizer: str = "bundled:kjv-bpe-4k"  # bundled name, "gpt2", or a tokenizer.json path
    seq_len: int = 128  # tokens per training sequence (decoder input length)
    target_len: int = 64  # encoder-decoder target length
    batch_size: int = 16  # sequences per micro-batch per data-parallel rank
    eval_fraction: float = 0.02  # share of documents held out for evaluation
    mlm_probability: float = 0.15
    span_noise_density: float = 0.15
    span_mean_length: float = 3.0
    seed: int = 1234
    shards: str = ""  # manifest.json (path or URL) of prepared shards; "": prepare data.corpus into cache_dir
    cache_dir: str = ""  # "": $MESHFORMER_CACHE or ~/.cache/meshformer
    num_workers: int = 1  # DataLoader worker processes per rank (0: load in the training process)
    shuffle_shards: int = 4  # shards mixed into one shuffle group (memory: one group per worker)
    bad_shards: Literal["error", "skip"] = "error"  # corrupt/short/missing shard: raise, or skip and log
    # true: a resume whose data order changed (data.seed, data.shuffle_shards, shards) keeps the checkpoint's sample
    # count and continues the order of the current settings from that position (see data/README.md)
    reseed_on_resume: bool = False
    sources: list[DataSourceConfig] = field(default_factory=list)  # [[data.sources]] mixture; []: data.shards


@dataclass
class OptimConfig:
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "noam", "wsd", "constant"] = "cosine"  # noam: optim.lr is the scale factor
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine / wsd floor as a fraction of optim.lr
    decay_fraction: float = 0.2  # wsd: share of the run spent decaying


@dataclass
class TrainConfig:
    steps: int = 300
    objective: Literal["auto", "causal", "mlm", "span", "seq2seq"] = "auto"
    grad_accum: int = 1
    seed: int = 0
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    dtype: Literal["fp32", "bf16"] = "fp32"  # bf16 = autocast with fp32 master weights
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    eval_interval: int = 100
    eval_batches: int = 8
    sample_interval: int = 100  # decode a text sample this often (0: never)
    sample_tokens: int = 48
    compile: bool | Literal["off", "blocks", "model"] = False  # true = "blocks" (each block compiled)
    loss: Literal["auto", "plain", "chunked", "liger"] = "auto"  # auto: a fused head loss where the layout allows
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"  # torchao float8 linears; FP8 tensor cores (sm 8.9+)
    fp8_keep_ends: bool = False  # the first and last block of each stack keep high-precision linears
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = "default"  # inductor mode for train.compile


@dataclass
class ParallelConfig:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the other dimensions leave of the world
    cp: int = 1
    tp: int = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"] = "1f1b"
    pp_microbatches: int = 0  # 0: one per pipeline stage
    pp_stages_per_rank: int = 1
    pp_split_points: list[int] = field(default_factory=list)  # manual layer split points
    recompute: Recompute = "none"
    recompute_every: int = 2
    mixed_precision_param: Literal["fp32", "bf16"] = "fp32"
    mixed_precision_reduce: Literal["fp32", "bf16"] = "fp32"
    reshard_after_forward: bool = True
    timeout_s: float = 600.0


@dataclass
class CheckpointConfig:
    dir: str = ""  # "": <run_dir>/checkpoints
    interval: int = 0  # steps between saves; 0: only the final weights
    keep_last: int = 2
    keep_every: int = 0  # also keep every M-th step (0: none)
    async_save: bool = False  # write in a background thread (DCP thread mode); at most one save in flight
    resume: bool = True  # start from the newest valid checkpoint in checkpoint.dir, if any
    verify: Literal["sha256", "size"] = "sha256"  # how resume checks a checkpoint's files against its manifest
    # "full": a checkpoint whose model tensors differ from this model's (names or shapes) is refused;
    # "partial": load the tensors that fit (and their optimizer state), keep the rest as initialized, and resume
    # the step, schedule and data position (retention keeps the other model's checkpoints)
    load_mode: Literal["full", "partial"] = "full"
    save_on_sigterm: bool = True  # on SIGTERM: save at the next step boundary, then stop
    preempt_check_interval: int = 10  # steps between the cross-rank "did any rank get SIGTERM?" check
    max_shard_size: str = "5GB"  # final weights: largest safetensors file (HF-style shards + index beyond it)


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    log_interval: int = 10
    tensorboard: bool = True


@dataclass
class ProfileConfig:
    """torch.profiler traces of a step range (Perfetto / chrome://tracing / TensorBoard), written per rank."""

    start_step: int = 0  # first profiled optimizer step (1-based); 0: profiling off
    steps: int = 3  # how many steps to record from start_step
    ranks: list[int] = field(default_factory=list)  # ranks that record; []: every rank
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False  # Python stacks per op (large traces)
    dir: str = ""  # "": <run_dir>/profile


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    @property
    def objective(self) -> str:
        if self.train.objective != "auto":
            return self.train.objective
        return {"decoder": "causal", "encoder": "mlm", "encoder_decoder": "span"}[self.model.family]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or defaults), apply `section.key=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})", "fix the line it names") from None
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.steps=200")
        _set_dotted(raw, key.strip(), _parse_value(value.strip()))
    cfg = config_from_dict(raw)
    validate(cfg)
    return cfg


def bundled_configs() -> dict[str, Path]:
    """The configs shipped inside the package, by name (`tiny-gpt`, `llama-8b`, ...)."""
    folder = Path(__file__).parent / "configs"
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


def resolve_config_path(path: str | Path) -> Path:
    """A TOML file, or the name of a bundled config."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    bundled = bundled_configs()
    if str(path) in bundled:
        return bundled[str(path)]
    if candidate.is_dir():
        raise ConfigError(f"config {str(path)!r} is a folder; pass a TOML file or a bundled config name "
                          f"({', '.join(bundled)})")
    hint = difflib.get_close_matches(candidate.stem, bundled, n=1)
    fix = f"did you mean {hint[0]!r}? " if hint else ""
    raise ConfigError(f"config file {str(path)!r} not found; {fix}pass a TOML file or a bundled config name "
                      f"({', '.join(bundled)})")


def config_from_dict(raw: dict[str, Any]) -> Config:
    return build_section(Config, raw, "")


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word such as rmsnorm or a path


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is a value, not a section")
    node[parts[-1]] = value


def build_section(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{prefix}] must be a table of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        where = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {where!r}{hint} (valid: {', '.join(fields)})")
        kwargs[key] = _coerce(hints[key], value, where)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build_section(hint, value, where)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_txt = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{where} = {value!r} is not one of {list(args)}{hint_txt}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        if origin is tuple and len(args) == 2 and args[1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where} must have {len(args)} items, got {value!r}")
            return tuple(_coerce(a, v, where) for a, v in zip(args, value))
        item = args[0] if args else Any
        out = [_coerce(item, v, where) for v in value]
        return tuple(out) if origin is tuple else out
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{where} must be {hint.__name__}, got {type(value).__name__} {value!r}")
        return value
    return value


# ----------------------------------------------------------------------------- validation


def validate(cfg: Config) -> None:
    """Check cross-field consistency; every message names the key and the fix."""
    m, d, t = cfg.model, cfg.data, cfg.train
    _positive(cfg, ["model.vocab_size", "model.d_model", "model.n_heads", "model.d_ff", "model.max_seq_len",
                    "data.seq_len", "data.batch_size", "train.steps", "train.grad_accum", "optim.lr",
                    "logging.log_interval"])
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
                          "choose n_heads that divides d_model")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
                          "n_kv_heads must divide n_heads (1 = multi-query)")
    if m.position == "rope" and m.head_dim % 2:
        raise ConfigError(f"RoPE needs an even head dimension, got d_model/n_heads={m.head_dim}")
    if m.position == "t5_relative" and (m.relative_buckets < 4 or m.relative_max_distance <= m.relative_buckets // 2):
        raise ConfigError(f"model.relative_buckets={m.relative_buckets} / model.relative_max_distance="
                          f"{m.relative_max_distance}: t5_relative needs at least 4 buckets and a max distance above "
                          "relative_buckets / 2 (the exactly bucketed range); T5 uses 32 and 128")
    if m.family in ("decoder", "encoder") and m.n_layers <= 0:
        raise ConfigError("model.n_layers must be positive")
    if m.family == "encoder_decoder" and (m.encoder_depth <= 0 or m.decoder_depth <= 0):
        raise ConfigError("model.n_encoder_layers and model.n_decoder_layers must be positive")
    if m.family == "encoder_decoder" and d.target_len <= 0:
        raise ConfigError(f"data.target_len must be positive for an encoder-decoder model, got {d.target_len}")
    key, longest = max([("data.seq_len", d.seq_len)]
                       + ([("data.target_len", d.target_len)] if m.family == "encoder_decoder" else []),
                       key=lambda item: item[1])
    if m.position in ("learned", "sinusoidal", "rope") and longest > m.max_seq_len:
        raise ConfigError(f"{key}={longest} exceeds model.max_seq_len={m.max_seq_len}; "
                          "raise model.max_seq_len or shorten data.seq_len")
    if m.attention_window is not None:
        if m.attention_window <= 0:
            raise ConfigError("model.attention_window must be positive (or omitted for full attention)")
        if m.attention_window > d.seq_len:
            raise ConfigError(f"model.attention_window={m.attention_window} is larger than data.seq_len="
                              f"{d.seq_len}; use a smaller window or remove it for full attention")
    if m.cross_downsample < 1:
        raise ConfigError("model.cross_downsample must be >= 1 (1 disables pooling)")
    if m.cross_downsample > 1 and m.family != "encoder_decoder":
        raise ConfigError("model.cross_downsample only applies to family = 'encoder_decoder'")
    if not 0 <= m.dropout < 1 or not 0 <= m.attention_dropout < 1:
        raise ConfigError("model.dropout and model.attention_dropout must lie in [0, 1)")
    if not 0 <= t.label_smoothing < 1:
        raise ConfigError("train.label_smoothing must lie in [0, 1)")
    objective = cfg.objective
    allowed = {"decoder": {"causal"}, "encoder": {"mlm"}, "encoder_decoder": {"span", "seq2seq"}}[m.family]
    if objective not in allowed:
        raise ConfigError(f"train.objective={objective!r} does not fit model.family={m.family!r}; "
                          f"use one of {sorted(allowed)} or 'auto'")
    if not 0 < d.mlm_probability < 1 or not 0 < d.span_noise_density < 1:
        raise ConfigError("data.mlm_probability and data.span_noise_density must lie in (0, 1)")
    _check_training_ranges(cfg)
    if cfg.schedule.name == "noam" and cfg.schedule.warmup_steps == 0:
        raise ConfigError("schedule.name='noam' needs schedule.warmup_steps > 0")
    if cfg.profile.start_step < 0 or cfg.profile.steps <= 0:
        raise ConfigError(f"profile.start_step={cfg.profile.start_step} and profile.steps={cfg.profile.steps}: "
                          "start_step must be >= 0 (0: off) and steps positive, e.g. profile.start_step=10 "
                          "profile.steps=3")
    if t.dtype == "bf16" and not t.device.startswith(("auto", "cpu", "cuda")):
        raise ConfigError(f"train.dtype='bf16' is not supported on device {t.device!r}; use fp32")


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
    if t.z_loss < 0:
        raise ConfigError(f"train.z_loss={t.z_loss} must be >= 0 (0 disables it)")
    if t.eval_interval > 0 and t.eval_batches <= 0:
        raise ConfigError("train.eval_batches must be positive when train.eval_interval > 0 (0 disables evaluation)")
    for key in ("train.eval_interval", "train.sample_interval", "checkpoint.interval", "checkpoint.keep_last",
                "checkpoint.keep_every"):
        if (value := getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])) < 0:
            raise ConfigError(f"{key}={value} is negative", "use a value >= 0 (0 turns it off; keep_last=0 keeps all)")
    d = cfg.data
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers={d.num_workers} must be >= 0 (0 loads in the training process)")
    if d.shuffle_shards < 1:
        raise ConfigError(f"data.shuffle_shards={d.shuffle_shards} must be >= 1 (shards mixed per shuffle group)")
    if not 0 <= d.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must lie in [0, 1)")
    if d.sources and d.shards:
        raise ConfigError("set either data.shards (one dataset) or [[data.sources]] (a mixture), not both")
    for i, src in enumerate(d.sources):
        if not src.shards or not src.weight > 0:
            raise ConfigError(f"data.sources[{i}] needs shards = <manifest> and weight > 0 (got {src.shards!r}, "
                              f"{src.weight})")


def _positive(cfg: Config, keys: list[str]) -> None:
    for key in keys:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(getattr(cfg, section), name)}")


# ----------------------------------------------------------------------------- writing


def dump_toml(tree: dict[str, Any]) -> str:
    """The config tree as TOML (None is omitted: it means "the default")."""
    return tomli_w.dumps(_without_none(tree))


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_none(v) for v in value]
    return value
