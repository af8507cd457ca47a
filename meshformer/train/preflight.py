"""Checks before step 1: everything a run needs that can be checked before a model or process group exists.

A mistake found here costs seconds; found at the first checkpoint or evaluation it costs the run so far.
Every check raises a meshformer error naming the problem and the config key that fixes it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from meshformer import folders
from meshformer.checkpointing.directory import check_latest, committed_steps, step_dir_name
from meshformer.checkpointing.manager import refuse_earlier_checkpoints
from meshformer.config import Config, ConfigError
from meshformer.data import Tokenizer, load_tokenizer
from meshformer.data.build import check_data
from meshformer.data.tokenizer import check_vocab
from meshformer.model.flops import count_params
from meshformer.runtime.distributed import env_rank
from meshformer.runtime.run_lock import run_folder_lock
from meshformer.train.callbacks import check_config_callbacks
from meshformer.train.run_record import check_checkpoint_owner, check_rerun, config_changes

# One checkpoint holds fp32 parameters and AdamW's two fp32 moments; the rest (data and RNG state, manifest)
# is small. The margin covers filesystem overhead and the files of a save that is being replaced.
BYTES_PER_PARAM = 3 * 4
DISK_MARGIN = 1.1
DISK_SLACK_BYTES = 64 << 20


FINAL_WEIGHTS = "final"
# What an older meshformer left in a run's final/ (before the marker): the config and one file or an index.
FINAL_LEGACY = (("model_config.json", "model.safetensors"), ("model_config.json", "model.safetensors.index.json"))


def _checkpoint_dir(cfg: Config) -> tuple[Path, str]:
    """The checkpoint folder and the option that chooses it."""
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir), "checkpoint.dir"
    return Path(cfg.logging.run_dir) / "checkpoints", "logging.run_dir"


@contextmanager
def run_folders_claimed(cfg: Config) -> Iterator[None]:
    """Hold the run folder (and a checkpoint.dir outside it) for the block, so no second run writes there at the
    same time; taken before any work. Only global rank 0 takes it: its job's other ranks are covered by it."""
    if env_rank()[0] != 0:
        yield
        return
    run_dir = Path(cfg.logging.run_dir)
    checkpoint_dir, key = _checkpoint_dir(cfg)
    check_folder(run_dir, "logging.run_dir")
    with ExitStack() as held:
        # a config other than the running one's (its config.toml) is another run: waiting would not make room for it
        held.enter_context(run_folder_lock(run_dir, "logging.run_dir", another_run=bool(config_changes(run_dir, cfg))))
        if run_dir.resolve() not in (checkpoint_dir.resolve(), *checkpoint_dir.resolve().parents):
            check_folder(checkpoint_dir, key)
            held.enter_context(run_folder_lock(checkpoint_dir, key))
        yield


def preflight(cfg: Config) -> Tokenizer:
    """Callbacks, run folders, tokenizer against model.vocab_size, data, free disk space; returns the loaded
    tokenizer."""
    check_config_callbacks(cfg)  # [[callbacks]]: each imports and takes its arguments
    run_dir = Path(cfg.logging.run_dir)
    checkpoint_dir, key = _checkpoint_dir(cfg)
    check_folder(run_dir, "logging.run_dir")
    check_folder(checkpoint_dir, key)
    check_final_folder(run_dir / FINAL_WEIGHTS)
    check_latest(checkpoint_dir)
    if not cfg.checkpoint.resume:
        refuse_earlier_checkpoints(checkpoint_dir)
    from meshformer.train.downstream import check_tasks  # the layouts' modules: only training

    check_tasks(cfg)  # downstream.tasks: readable, rendered, fit for the objective, their datasets cached
    tokenizer = checked_tokenizer(cfg)
    check_data(cfg, tokenizer)
    check_disk_space(cfg, run_dir, checkpoint_dir)
    # The newest checkpoint is where a resume starts (the trainer checks again with the step it resumed).
    steps = committed_steps(checkpoint_dir) if cfg.checkpoint.resume else []
    if steps:
        check_checkpoint_owner(cfg, checkpoint_dir, checkpoint_dir / step_dir_name(steps[-1]))
    check_rerun(cfg, run_dir, steps[-1] if steps else 0, has_final_weights(run_dir))
    return tokenizer


def checked_tokenizer(cfg: Config) -> Tokenizer:
    """data.tokenizer, loaded and checked against model.vocab_size."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, cfg.model.vocab_size)
    return tokenizer


def config_warnings(cfg: Config, tokenizer: Tokenizer) -> list[str]:
    """What trains, but likely not as meant: one line each (the trainer logs them before step 1)."""
    warnings = []
    unused = cfg.model.vocab_size - tokenizer.vocab_size
    if unused > max(128, tokenizer.vocab_size // 100):  # beyond the padding models add for fast GEMMs
        warnings.append(f"warning: the tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but "
                        f"model.vocab_size={cfg.model.vocab_size}: {unused} embedding rows no token uses (set "
                        f"model.vocab_size={tokenizer.vocab_size} unless they are meant)")
    if cfg.schedule.warmup_steps > cfg.train.steps:
        warnings.append(f"warning: schedule.warmup_steps={cfg.schedule.warmup_steps} is longer than the run "
                        f"(train.steps={cfg.train.steps}): the learning rate ends at "
                        f"{cfg.train.steps / cfg.schedule.warmup_steps:.0%} of optim.lr, still warming up (lower "
                        "schedule.warmup_steps)")
    return warnings


def check_folder(path: Path, key: str) -> None:
    """`path` exists as a folder (created if needed) and accepts a new file."""
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"{key}: {path} cannot be a folder because {blocker} is a file",
                          f"set {key} to another path, or move {blocker} away")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ConfigError(f"{key}: cannot write into {path} ({err.strerror or err})",
                          f"set {key} to a folder you can write, or fix its permissions") from None


def is_final_ours(final: Path) -> bool:
    return any(folders.is_ours(final, legacy) for legacy in FINAL_LEGACY)


def has_final_weights(run_dir: Path) -> bool:
    """Whether the run folder holds final weights this (or an earlier) run wrote."""
    final = Path(run_dir) / FINAL_WEIGHTS
    return final.is_dir() and is_final_ours(final) and any(p.suffix == ".safetensors" for p in final.iterdir())


def check_final_folder(final: Path) -> None:
    """The run's final weights replace final/ at the end only if it is ours (or missing, or empty): refuse at
    start, not after the training, a final/ holding someone else's files."""
    if is_final_ours(final):
        return
    if final.is_dir() and any(final.iterdir()):
        raise folders.OutputFolderError(f"{final} holds files meshformer did not write, and this run would replace "
                                        "it with its final weights", "move them away, or set logging.run_dir to "
                                        "another folder")
    folders.check_output(final, what="final weights", overwrite=False)  # a file in its place


def check_disk_space(cfg: Config, run_dir: Path, checkpoint_dir: Path) -> None:
    """Room for one more checkpoint (when the run saves them) and the final weights, with a margin."""
    n_params = count_params(cfg.model)["total"]
    needs = {run_dir: n_params * 4}  # final/model.safetensors
    if cfg.checkpoint.interval > 0:  # (a SIGTERM save also needs interval > 0)
        same_disk = os.stat(run_dir).st_dev == os.stat(checkpoint_dir).st_dev
        target = run_dir if same_disk else checkpoint_dir
        needs[target] = needs.get(target, 0) + n_params * BYTES_PER_PARAM
    for folder, nbytes in needs.items():
        required = int(nbytes * DISK_MARGIN) + DISK_SLACK_BYTES
        free = shutil.disk_usage(folder).free
        if free < required:
            saves = "one checkpoint and the final weights" if nbytes > n_params * 4 else "the final weights"
            raise ConfigError(f"no space left for this run: {folder} has {_gib(free)} free but {saves} of this "
                              f"{n_params / 1e6:,.1f}M-parameter model need about {_gib(required)}",
                              "free disk space, or point logging.run_dir / checkpoint.dir at a larger filesystem")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.2f} GiB"
