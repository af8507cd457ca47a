"""The config tree's sections: one dataclass per TOML table, with its defaults.

`ModelConfig` (the `[model]` table) lives with the model (meshformer/model/config.py), which reads nothing else;
the rest are here. Loading is in `load.py`, checks in `validate.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from meshformer.config.optim_compat import install_optim_renamed
from meshformer.config.write import dump_toml
from meshformer.model.config import ModelConfig
from meshformer.model.families import get_family_spec
from meshformer.optim import AdamWConfig, MuonConfig, NorMuonConfig

Recompute = Literal["none", "full", "selective", "every_k"]


@dataclass
class DataSourceConfig:
    """One `[[data.sources]]` table of a mixture."""

    shards: str = ""  # manifest.json (path or URL) of prepared shards
    weight: float = 1.0  # share of samples, relative to the other sources' weights
    name: str = ""  # label in logs (data/<name>/tokens); "": source<i>
    allow_remote_shards: bool = False  # as data.allow_remote_shards, for this source's manifest


@dataclass
class DataConfig:
    corpus: str = "bundled:kjv"  # "bundled:kjv", a text/JSONL(.gz) file or a directory
    text_field: str = "text"  # JSONL field holding the text
    tokenizer: str = "bundled:kjv-bpe-4k"  # bundled name, "gpt2", or a tokenizer.json path
    seq_len: int = 128  # tokens per training sequence (decoder input length)
    target_len: int = 64  # encoder-decoder target length
    batch_size: int = 16  # sequences per micro-batch per data-parallel rank
    eval_fraction: float = 0.02  # share of documents held out for evaluation
    mlm_probability: float = 0.15  # mlm objective: share of tokens masked
    span_noise_density: float = 0.15  # span objective (T5): share of tokens corrupted
    span_mean_length: float = 3.0  # span objective: mean corrupted span length
    seed: int = 1234  # seed of the data order and of the held-out split
    shards: str = ""  # manifest.json (path or URL) of prepared shards; "": prepare data.corpus into cache_dir
    # true: the manifest of data.shards may name shards outside its folder (absolute paths, URLs, `pipe:` commands,
    # which are then read or run); only for a manifest you wrote yourself. false: only files in its folder
    allow_remote_shards: bool = False
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
    # shared by every optimizer: AdamW's keys, for all parameters under AdamW and for those that Muon/NorMuon leave
    # to AdamW (embeddings, norms, biases, output head)
    lr: float = 3e-3  # peak learning rate (the schedule scales it)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's moment decay rates
    eps: float = 1e-8  # AdamW's denominator epsilon
    weight_decay: float = 0.1  # decoupled weight decay of matrices (norms, biases and embeddings get none)
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    # A step whose gradient norm is inf/nan updates nothing (train/optim.py: SkippedUpdates); the run stops once more
    # than this many come in a row (0: at the first).
    max_nonfinite_in_a_row: int = 10
    # the optimizer (meshformer/optim/: one file each); its own keys are the table [optim.<name>].
    # "muon"/"normuon": Muon/NorMuon for the blocks' weight matrices, AdamW (the keys above) for everything else
    name: Literal["adamw", "muon", "normuon"] = "adamw"
    adamw: AdamWConfig = field(default_factory=AdamWConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    normuon: NorMuonConfig = field(default_factory=NorMuonConfig)
    # MuonClip's QK-clip (Kimi K2; with Muon or AdamW; train/qk_clip.py): after each step, every attention head whose
    # largest logit q·k·scale in the step's forwards exceeded this threshold tau has its query and key projection
    # rows scaled so that it would be tau (Kimi K2: 100). Needs attention_backend auto/blockwise/math (which see the
    # scores) and no qk_norm. None or 0: off.
    qk_clip_threshold: float | None = None


install_optim_renamed(OptimConfig)  # cfg.optim.muon_lr, OptimConfig(muon_lr=...): deprecated (optim_compat.py)


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "noam", "wsd", "constant"] = "cosine"  # noam: optim.lr is the scale factor
    warmup_steps: int = 50  # linear warm-up from 0 to optim.lr
    min_lr_ratio: float = 0.1  # cosine / wsd floor as a fraction of optim.lr
    decay_fraction: float = 0.2  # wsd: share of the run spent decaying


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps the run trains to
    objective: Literal["auto", "causal", "mlm", "span", "seq2seq"] = "auto"  # auto: the model family's objective
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0  # seed of initial weights, dropout and samples
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    dtype: Literal["fp32", "bf16"] = "fp32"  # bf16 = autocast with fp32 master weights
    label_smoothing: float = 0.0  # cross-entropy label smoothing
    z_loss: float = 0.0  # coefficient of mean(logsumexp(logits)^2) (PaLM); 0: off
    eval_interval: int = 100  # steps between held-out loss evaluations, and one at the last step (0: never)
    eval_batches: int = 8  # held-out batches per evaluation
    sample_interval: int = 100  # decode a text sample this often, and at the last step (0: never)
    sample_tokens: int = 48  # tokens each decoded sample generates
    compile: bool | Literal["off", "blocks", "model"] = False  # true = "blocks" (each block compiled)
    loss: Literal["auto", "plain", "chunked", "chunked_recompute", "liger"] = "auto"  # auto: train/loss_choice.py
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"  # torchao float8 linears; FP8 tensor cores (sm 8.9+)
    fp8_keep_ends: bool = False  # the first and last block of each stack keep high-precision linears
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = "default"  # inductor mode for train.compile


@dataclass
class ParallelConfig:
    pp: int = 1  # pipeline-parallel stages
    dp_replicate: int = 1  # data-parallel replicas (HSDP: full copies, each sharded over dp_shard)
    dp_shard: int = -1  # -1: whatever the other dimensions leave of the world
    cp: int = 1  # context parallel (decoder/encoder-only): each sequence split over cp ranks (parallel/context.py)
    # how context-parallel ranks meet in the token mixers: "allgather" (each rank all-gathers the keys and values,
    # linear kinds pass their state piece to piece) or "ulysses" (all-to-all from sequence shards to head shards and
    # back around each mixer; heads must split over cp). docs/parallel.md compares them.
    cp_method: Literal["allgather", "ulysses"] = "allgather"
    tp: int = 1  # tensor (and sequence) parallel ranks
    # expert parallel (MoE): each MoE layer's experts split over ep ranks holding other tokens, which exchange
    # tokens all-to-all; ep is taken from dp_shard x cp x tp (a multiple of cp x tp; parallel/expert_parallel.py)
    ep: int = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"] = "1f1b"  # pipeline schedule
    pp_microbatches: int = 0  # 0: one per pipeline stage
    pp_stages_per_rank: int = 1  # virtual stages per pipeline rank (interleaved schedules: 2 or more)
    pp_split_points: list[int] = field(default_factory=list)  # manual layer split points
    recompute: Recompute = "none"  # activation recomputation: full blocks, selective (attention ops), every k-th block
    recompute_every: int = 2  # every_k: recompute one block in this many
    mixed_precision_param: Literal["fp32", "bf16"] = "fp32"  # FSDP: dtype of gathered parameters for compute
    mixed_precision_reduce: Literal["fp32", "bf16"] = "fp32"  # FSDP: dtype of the gradient reduce-scatter
    reshard_after_forward: bool = True  # FSDP: free gathered parameters after forward (gather again in backward)
    pp_fsdp_unsharded_microbatches: bool = False  # PP x FSDP: keep stage params+grads whole across microbatches
    timeout_s: float = 600.0  # seconds a collective may wait before the run stops naming it


@dataclass
class CheckpointConfig:
    dir: str = ""  # "": <run_dir>/checkpoints
    interval: int = 0  # steps between saves; 0: only the final weights
    keep_last: int = 2  # committed checkpoints kept (0: all)
    keep_every: int = 0  # also keep every M-th step (0: none)
    async_save: bool = False  # write in a background thread (DCP thread mode); at most one save in flight
    resume: bool = True  # start from the newest valid checkpoint in checkpoint.dir, if any
    # a checkpoint.dir whose newest checkpoint another run (another logging.run_dir) saved is refused at start;
    # true: resume from it (its weights, optimizer, step and data position continue in this run folder)
    resume_other_run: bool = False
    verify: Literal["sha256", "size"] = "sha256"  # how resume checks a checkpoint's files against its manifest
    # "full": a checkpoint whose model tensors differ from this model's (names or shapes) is refused;
    # "partial": load the tensors that fit (and their optimizer state), keep the rest as initialized, and resume
    # the step, schedule and data position (retention keeps the other model's checkpoints)
    load_mode: Literal["full", "partial"] = "full"
    # On SIGTERM, SIGINT (Ctrl-C), SIGHUP, SIGUSR1 or SIGUSR2: every rank finishes the same step, a checkpoint is
    # committed (also with interval=0), and the run exits with 128+signal; false: the signal's default action
    save_on_sigterm: bool = True
    preempt_check_interval: int = 1  # steps between the ranks' asynchronous exchanges of their stop flags
    # Launcher (`meshformer train --nproc-per-node`): seconds between forwarding a stop signal to the ranks and
    # killing them; 0: 60 s plus the checkpoint's bytes per node at 500 MB/s
    stop_grace_s: float = 0.0
    max_shard_size: str = "5GB"  # final weights: largest safetensors file (HF-style shards + index beyond it)
    # "hf:PATH": step 0 starts from a Hugging Face folder's weights (streamed into this rank's shards), model config
    # and tokenizer (checkpointing/init_from.py); a resume continues from this run's own checkpoints instead
    init_from: str = ""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"  # the run folder: logs, metrics, checkpoints, final weights
    log_interval: int = 10  # steps between progress lines and scalars
    tensorboard: bool = True  # write TensorBoard event files under the run folder
    # Weights & Biases (the [wandb] extra): the same scalars as TensorBoard and metrics.jsonl; "offline" needs no
    # network (`wandb sync <run_dir>/wandb/offline-run-*` uploads later)
    wandb: bool = False
    wandb_project: str = "meshformer"  # W&B project
    wandb_mode: Literal["online", "offline"] = "online"  # W&B mode; offline writes under the run folder


@dataclass
class ProfileConfig:
    """torch.profiler traces of a step range (Perfetto / chrome://tracing / TensorBoard), written per rank."""

    start_step: int = 0  # first profiled optimizer step (1-based); 0: profiling off
    steps: int = 3  # how many steps to record from start_step
    ranks: list[int] = field(default_factory=list)  # ranks that record; []: every rank
    record_shapes: bool = False  # record operator input shapes
    profile_memory: bool = False  # record tensor allocations
    with_stack: bool = False  # Python stacks per op (large traces)
    dir: str = ""  # "": <run_dir>/profile


@dataclass
class DownstreamConfig:
    """Tasks scored during training by lm-evaluation-harness' own evaluator (docs/evaluation.md)."""

    # "bundled:NAME" (kjv_cloze, kjv_next, kjv_lastword, kjv_perplexity, kjv_complete), the path of an lm-eval task
    # YAML (dataset_path: json, its JSONL data_files in the YAML's folder, named relative to it), or an lm-eval task
    # or group name (its dataset from the local datasets cache); logged as downstream/<task>/<metric> and
    # <metric>_stderr; []: none
    tasks: list[str] = field(default_factory=list)
    interval: int = 0  # steps between downstream evaluations (and after the last step); 0: at train.eval_interval
    batch_size: int = 0  # requests (data.seq_len tokens at most) per forward per rank; 0: data.batch_size
    # run the task files as code, as lm-eval does: templates render unsandboxed and `!function module.name` loads
    # from module.py in the task's folder (false: templates render in a sandbox and !function is refused)
    trust_task_code: bool = False
    follow_links: bool = False  # read data_files that links take outside the task's folder (refused otherwise)
    max_task_mb: int = 64  # MiB of JSONL documents one task may hold (read into memory, scored at every evaluation)
    include_path: list[str] = field(default_factory=list)  # folders of task YAMLs lm-eval indexes
    num_fewshot: int = -1  # few-shot examples per request; -1: each task's own
    limit: float = 0  # documents per task (a fraction when below 1); 0: all


@dataclass
class CallbackConfig:
    """One `[[callbacks]]` table: a training-loop callback of your own (meshformer/train/callbacks.py), built on
    every rank before step 1 and run on the ranks its class declares."""

    # "package.module:ClassName" of a meshformer.train.callbacks.Callback subclass: the module (or package) from
    # `folder` when it is there, else installed or on PYTHONPATH
    path: str = ""
    # keyword arguments of the class's constructor, e.g. {every = 10}
    args: dict[str, Any] = field(default_factory=dict)
    # the folder the module is looked up in first; "": the folder of the config file that names the callback (the
    # current folder for a bundled config), resolved when the config is loaded; relative: to that folder
    folder: str = ""


@dataclass
class FaultToleranceConfig:
    """Replica groups on torchft (meshformer/runtime/fault_tolerance.py, docs/fault-tolerance.md): the data-parallel
    replicate dimension becomes independent torchrun jobs that train on when one of them fails."""

    enabled: bool = False  # train as one replica group of several (MESHFORMER_REPLICA_ID names which)
    # how many replica groups the run has; each reads its own 1/replica_groups share of every step's global batch
    replica_groups: int = 1
    # the torchft Lighthouse as http://HOST:PORT ("": the TORCHFT_LIGHTHOUSE environment variable, which
    # `meshformer train --replica-groups N` sets)
    lighthouse: str = ""
    min_replicas: int = 1  # replica groups a step needs to update the weights; fewer wait for a quorum
    timeout_s: float = 60.0  # seconds a cross-group all-reduce, commit vote or heal transfer may take
    quorum_timeout_s: float = 60.0  # seconds one request for the Lighthouse's quorum may take
    # seconds a group keeps asking for a quorum (the Lighthouse gone, fewer than min_replicas groups up) before it
    # stops with a checkpoint
    wait_s: float = 300.0
    # Lighthouse started by `meshformer lighthouse` / `meshformer train --replica-groups N`: seconds without a
    # heartbeat before a group counts as gone (the survivors' pause after a kill -9)
    heartbeat_timeout_s: float = 2.0
    # Lighthouse: seconds a quorum waits for heartbeating groups that have not asked to join yet
    join_timeout_s: float = 10.0
    # "sync": gradients averaged over the replicas alive at each step; "local_sgd": each group steps on its own and
    # the weights are averaged every sync_every steps; "diloco": every sync_every steps the groups average their
    # pseudo-gradient (the weights' change since the last sync) and take an outer Nesterov SGD step on it
    method: Literal["sync", "local_sgd", "diloco"] = "sync"
    sync_every: int = 1  # local_sgd / diloco: steps between synchronisations (H)
    outer_lr: float = 0.7  # diloco: the outer SGD's learning rate
    outer_momentum: float = 0.9  # diloco: the outer SGD's Nesterov momentum


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
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    callbacks: list[CallbackConfig] = field(default_factory=list)  # [[callbacks]]: your own training-loop callbacks

    @property
    def objective(self) -> str:
        """train.objective, with "auto" resolved to the family's first objective."""
        if self.train.objective != "auto":
            return self.train.objective
        return get_family_spec(self.model.family).objectives[0]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())
