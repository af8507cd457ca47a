"""Resumable training checkpoints: sharded (DCP), optionally async, committed atomically, verified on resume.

    manager = CheckpointManager.from_config(cfg, run_dir)   # every rank
    manager.resume(run)                                     # newest valid checkpoint, if any
    ... each step: manager.after_step(run)                  # saves at checkpoint.interval
    manager.finish(run)                                     # final save (or a stop's), wait for the one in flight

A save writes into step-N.partial/: DCP shards of model and optimizer (any layout), one JSON file of RNG
states per rank, and from rank 0 trainer_state.json (step, tokens, optimizer hyperparameters, each named
component's state such as the scheduler and the data-loader position, resolved config). When every rank finished,
rank 0 writes manifest.json (size and sha256 of every file), renames the folder to step-N/, updates `latest`, and
applies retention. `run` is a `Checkpointable` (train_state.py): what is saved and restored, named explicitly.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshformer.checkpointing import compat, directory
from meshformer.checkpointing import state as st
from meshformer.checkpointing.checkpoint_errors import CheckpointError, CorruptCheckpointError
from meshformer.checkpointing.commit import commit, partial_dir
from meshformer.checkpointing.dcp_io import SafeFileSystemReader, SafeLoadPlanner, read_metadata, tensor_entries
from meshformer.checkpointing.manifest import Verify, verify_manifest, write_json_atomic
from meshformer.checkpointing.rng import capture_rng_state, restore_rng_state, seed_all
from meshformer.checkpointing.save_errors import SAVE_FAILURES, all_corrupt_error, is_disk_full, save_failed_error
from meshformer.checkpointing.train_state import Checkpointable, optional, saved_contents
from meshformer.config import CheckpointConfig, Config
from meshformer.config.migrate import flatten, migrate_tree
from meshformer.data import Tokenizer

STATE_VERSION = 2  # 2: "contents" where version 1 said "kind" (an older release refuses it, never misreads)
_log = logging.getLogger("meshformer.checkpointing")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CheckpointManager:
    def __init__(self, root: Path, cfg: CheckpointConfig, *, total_steps: int = 0, log: Any = None,
                 timeout_s: float | None = None) -> None:
        self.root, self.cfg, self.total_steps = Path(root), cfg, total_steps
        self.rank, self.world_size = _rank_world()
        self.distributed = self.world_size > 1
        self.log = log or _log.info
        # A gloo group of its own: the async save thread runs collectives while training uses the default group.
        # timeout_s: the job's parallel.timeout_s (None: torch's default, 30 minutes for gloo).
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self._pending: Future | None = None
        self._pending_step: int | None = None  # the step of the save in flight
        self._saved_before: int | None = None  # last_saved_step before it (restored where it fails)
        self.last_saved_step: int | None = None
        self.failed_saves = 0  # asynchronous saves that failed (each reported at the next step)
        # In a replica group (fault tolerance) a failed interval save is skipped with a line, as an asynchronous one
        # is: the group's run goes on, and a peer group holds the same state. The label names the group.
        self.skip_failed_saves: str = ""
        self.loaded_from: Path | None = None
        self.tokenizer: Tokenizer | None = None  # the run's, saved in every checkpoint (conversions carry it on)

    @classmethod
    def from_config(cls, cfg: Config, run_dir: Path, log: Any = None) -> CheckpointManager:
        return cls(checkpoint_root(cfg, run_dir), cfg.checkpoint, total_steps=cfg.train.steps, log=log,
                   timeout_s=cfg.parallel.timeout_s)

    @property
    def enabled(self) -> bool:
        return self.cfg.interval > 0

    # ------------------------------------------------------------------ the training loop's hooks

    def after_step(self, run: Checkpointable) -> None:
        """Save at the interval."""
        if not self.enabled:
            return
        self._report_failed_save(block=False)
        step = run.state.step
        if step % self.cfg.interval == 0 and step < self.total_steps:
            if not self.skip_failed_saves:
                self.save(run)
                return
            try:
                self.save(run)
            except CheckpointError as err:
                self.failed_saves += 1
                self.log(f"WARNING: {err} ({self.skip_failed_saves}: this save is skipped; training continues, the "
                         "next save tries again)")

    def finish(self, run: Checkpointable, *, stopping: bool = False, save: bool = True) -> Path | None:
        """Final checkpoint (blocking, unless this step was just saved), then wait for anything in flight; returns
        the committed folder of this step. `stopping`: a run stopped by a signal saves even with
        checkpoint.interval=0, so that a restart continues from here. `save=False`: only wait and close (a stop
        before the run trained a step)."""
        self.wait()  # an asynchronous save of this step that failed is written again below
        if save and (self.enabled or stopping) and self.last_saved_step != run.state.step:
            self.save(run, blocking=True)
        self.close()
        if self.group is not None:
            # Every rank reaches this point on a clean finish. Tearing the save group down together keeps a rank
            # that exits early from closing gloo connections a peer still holds (seen as a C++ terminate at exit).
            dist.barrier(group=self.group)
            dist.destroy_process_group(self.group)
            self.group = None
        saved = self.root / directory.step_dir_name(run.state.step)
        return saved if self.last_saved_step == run.state.step and saved.is_dir() else None

    def close(self) -> None:
        """Wait for the save in flight."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ saving

    def save(self, run: Checkpointable, *, blocking: bool | None = None) -> None:
        """Write a checkpoint of the current step (collective: every rank calls it)."""
        blocking = not self.cfg.async_save if blocking is None else blocking
        self.wait()  # at most one save in flight
        step = run.state.step
        partial = partial_dir(self.root, step)
        try:
            self._write(run, step, partial, blocking)
        except SAVE_FAILURES as err:
            raise self._save_failed(err, step, partial) from None
        self._pending_step, self._saved_before = step, self.last_saved_step
        self.last_saved_step = step

    def _write(self, run: Checkpointable, step: int, partial: Path, blocking: bool) -> None:
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            directory.remove_leftovers(self.root)  # unfinished saves and deletes of a crash; never trusted
            partial.mkdir()
        self._barrier()
        start = time.perf_counter()
        tensors = {**st.training_tensors(run.model_parts, run.optimizer), **run.component_tensors()}
        rank_state = {"rank": self.rank, "world_size": self.world_size, "rng": capture_rng_state()}
        write_json_atomic(partial / directory.rank_file(self.rank), rank_state)
        groups = self._all_param_groups(run)
        if self.rank == 0:
            write_json_atomic(partial / directory.TRAINER_STATE, self._trainer_state(run, groups))
            (partial / directory.RUN_CONFIG).write_text(run.config.to_toml())
            if self.tokenizer is not None:
                self.tokenizer.save(partial / directory.TOKENIZER_FILE)
        writer = dcp.FileSystemWriter(str(partial), thread_count=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's notes on single-process saves and async use
            if blocking:
                dcp.save(tensors, storage_writer=writer, process_group=self.group, no_dist=not self.distributed)
                self._commit_together(partial, step)
                self.log(f"checkpoint step {step} saved in {time.perf_counter() - start:.2f}s to {self.root}")
            else:
                # Staging (a CPU copy of every tensor) happens here; the write runs in DCP's thread.
                future = dcp.async_save(tensors, storage_writer=writer, process_group=self.group,
                                        no_dist=not self.distributed)
                # Without an async stager DCP hands back a plain Future.
                self._pending = self._executor.submit(self._finish_async, cast(Future, future), partial, step, start)

    def _save_failed(self, err: BaseException, step: int, partial: Path) -> CheckpointError:
        """Say what failed, what is intact, and what to do. A full disk also gets its space back at once; any other
        unfinished folder stays until the next save clears it (as after a crash: resume never reads it)."""
        if self.rank == 0 and is_disk_full(err):
            directory.remove_tree(partial)
        newest = [s for s in directory.committed_steps(self.root) if s < step]
        return save_failed_error(err, step, self.root, directory.step_dir_name(newest[-1]) if newest else None)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed; a failure is reported, not raised."""
        self._report_failed_save(block=True)

    def _report_failed_save(self, *, block: bool) -> None:
        """Policy for a failed asynchronous save: a loud warning at the first step after it failed, and training
        goes on. The previous checkpoint is still the newest valid one, the next save tries again, and the final
        save is blocking, so a run that cannot save at all still fails at the end (after its final weights are
        written). Stopping at once would throw away the steps trained since the last good checkpoint."""
        if self._pending is None or not (block or self._pending.done()):
            return
        pending, self._pending = self._pending, None
        error = pending.exception()
        if error is not None:
            self.failed_saves += 1
            if self.last_saved_step == self._pending_step:  # not saved: the final save writes this step if it ends here
                self.last_saved_step = self._saved_before
            who = f"{self.skip_failed_saves}: " if self.skip_failed_saves else ""
            self.log(f"WARNING: {error} ({who}asynchronous save, skipped by every rank; training continues, the next "
                     "save tries again)")

    def _finish_async(self, future: Future, partial: Path, step: int, start: float) -> None:
        """The save thread of every rank: wait for the shards, then commit as the blocking path does, so a commit
        that fails on rank 0 alone fails this save on every rank (each then reports and skips it alike)."""
        try:
            future.result()  # returns after every rank's shards are written (DCP's finish step; a failure reaches all)
            self._commit_together(partial, step)
        except SAVE_FAILURES as err:
            raise self._save_failed(err, step, partial) from None
        if self.rank == 0:
            self.log(f"checkpoint step {step} saved asynchronously in {time.perf_counter() - start:.2f}s")

    def _commit_together(self, partial: Path, step: int) -> None:
        """Rank 0 commits; every rank learns the outcome in the collective that ends the save (a failure on rank 0
        alone fails the save on every rank at once, instead of leaving them in a barrier until the timeout)."""
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                self._commit(partial, step)
            except SAVE_FAILURES as err:
                failure = err
        failed = failure is not None
        if self.distributed:
            flag = torch.tensor([float(failed)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            failed = bool(flag.item())
        if failure is not None:
            raise failure
        if failed:
            raise OSError(f"rank 0 could not commit {partial.name} (its error is in rank 0's log)")

    def _commit(self, partial: Path, step: int) -> None:
        """Rank 0, once every rank finished: commit step-N/, then retention.

        Retention never deletes the step just written, and only steps <= it count (or are deleted): higher
        ones were left in this folder by another run and are not this run's to remove."""
        final = commit(partial, step, {"world_size": self.world_size})
        earlier = [s for s in directory.committed_steps(self.root) if s <= step]
        ours = _model_signature(final)
        for old_step in directory.steps_to_delete(earlier, self.cfg.keep_last, self.cfg.keep_every, protect={step}):
            old = self.root / directory.step_dir_name(old_step)
            if _model_signature(old) != ours:  # another model's checkpoint (e.g. before a partial load): keep it
                self.log(f"retention keeps {old.name}: it holds a different model than this run's")
                continue
            directory.remove_tree(old)

    def _all_param_groups(self, run: Checkpointable) -> list[dict[str, Any]]:
        """Optimizer groups with the names of every rank's parameters (pipeline stages hold different ones)."""
        groups = st.param_groups_state(run.optimizer, run.model_parts)
        if not self.distributed:
            return groups
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, [g["params"] for g in groups], group=self.group)
        for i, group in enumerate(groups):
            names = dict.fromkeys(name for rank_groups in everyone for name in rank_groups[i])
            group["params"] = list(names)
        return groups

    def _trainer_state(self, run: Checkpointable, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
        components = {}
        for name, component in run.components.items():
            components[name] = component.state_dict()
            try:
                json.dumps(components[name])
            except TypeError as err:
                raise CheckpointError(f"the state_dict() of checkpoint component {name!r} is not JSON ({err}); it "
                                      "must hold only plain numbers, strings, lists and dicts") from None
        return {
            "version": STATE_VERSION,
            "contents": "training",
            "optimizer": type(run.optimizer).__name__,
            **run.state.state_dict(),
            "param_groups": param_groups,
            **components,
            "components": sorted(components),
            "world_size": self.world_size,
            "config": run.config.to_dict(),
            "saved_at": time.time(),
        }

    # ------------------------------------------------------------------ finding and loading

    def find_valid(self, verify: Verify | None = None) -> Path | None:
        """Rank 0's scan: newest committed checkpoint whose manifest verifies; corrupt ones are set aside.

        Only a failed verification (missing manifest or file, size or hash mismatch) moves a folder aside; a
        manifest from a newer meshformer raises CheckpointError, which stops the run before any work."""
        verify = verify or self.cfg.verify
        found: Path | None = None
        corrupt: list[tuple[Path, CorruptCheckpointError]] = []
        for step in reversed(directory.committed_steps(self.root)):
            path = self.root / directory.step_dir_name(step)
            try:
                verify_manifest(path, verify)
                found = path
                break
            except CorruptCheckpointError as err:
                corrupt.append((path, err))
        if found is None and corrupt:  # starting at step 0 here would silently throw the run away
            raise all_corrupt_error(self.root, corrupt)
        for path, problem in corrupt:
            quarantine = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            self.log(f"checkpoint {path.name} is not usable ({problem}); moved aside to {quarantine.name}, "
                     "falling back to the previous checkpoint")
            os.replace(path, quarantine)
        return found

    def resume(self, run: Checkpointable) -> bool:
        """Load the newest valid checkpoint into `run` (collective); False when there is none."""
        if not self.cfg.resume:
            refuse_earlier_checkpoints(self.root)
            return False
        name, error = None, None
        if self.rank == 0:
            try:
                for leftover in directory.remove_leftovers(self.root):
                    self.log(f"removed {leftover.name}, left behind by an interrupted save or delete")
                found = self.find_valid()
                name = found.name if found is not None else None
                if found is not None and self.cfg.verify == "size":
                    self._warn_size_only(found)
            except CheckpointError as err:  # e.g. written by a newer meshformer: every rank stops, none waits
                error = str(err)
        if self.distributed:
            box = [(name, error)]
            dist.broadcast_object_list(box, src=0, group=self.group)
            name, error = box[0]
        if error is not None:
            raise CheckpointError(error)
        if name is None:
            return False
        self.load(self.root / name, run)
        return True

    def _warn_size_only(self, found: Path) -> None:
        """checkpoint.verify="size" trades the content check for speed: say so at every resume it applies to."""
        self.log(f"WARNING: resuming from step {int(found.name.removeprefix('step-'))} ({found}), checked by file "
                 "sizes only (checkpoint.verify=\"size\"): its content was not checked; set "
                 f"checkpoint.verify=\"sha256\" or run `meshformer convert verify {self.root}` to check it")

    def load(self, path: Path, run: Checkpointable) -> dict[str, Any]:
        """Load a checkpoint folder (any saved layout) into this layout; returns its trainer state."""
        path = Path(path)
        state = json.loads((path / directory.TRAINER_STATE).read_text())
        if state.get("version", 0) > STATE_VERSION:
            raise CheckpointError(f"{path} has trainer-state version {state['version']}; upgrade meshformer")
        self._warn_config_changes(state.get("config"), run.config)
        start = time.perf_counter()
        metadata = read_metadata(path)  # once: the load below reuses it
        saved = {k: (v.size, v.properties.dtype) for k, v in tensor_entries(metadata).items()}
        parts, optimizer = run.model_parts, run.optimizer
        training = saved_contents(state) == "training"
        saved_optimizer = state.get("optimizer", type(optimizer).__name__)
        load_optimizer = training and saved_optimizer == type(optimizer).__name__
        if training and not load_optimizer:
            if self.cfg.load_mode != "partial":
                raise CheckpointError(f"{path} holds {saved_optimizer} state but this run uses "
                                      f"{type(optimizer).__name__} (optim.name)",
                                      "resume with the checkpoint's optim.name, or set checkpoint.load_mode="
                                      "\"partial\" to load its weights alone (the new optimizer starts fresh)")
            self.log(f"WARNING: checkpoint.load_mode=\"partial\": {path.name} holds {saved_optimizer} state, this "
                     f"run uses {type(optimizer).__name__}: loading the weights, step, schedule and data position; "
                     "the optimizer starts fresh")
        if training:
            self._check_components(path, state, run)
        skip = self._check_fit(path, run, {k: tuple(v[0]) for k, v in saved.items()})
        model_t, optim_t, per_param = st.load_templates(parts, optimizer if load_optimizer else None, saved, skip)
        templates = {k: v for k, v in {**model_t.tensors, **optim_t.tensors}.items() if k not in skip}
        extra = run.component_templates(saved) if training else {}
        templates.update({f"{name}.{k}": v for name, found in extra.items() for k, v in found.items()})
        st.check_shapes({k: v for k, v in model_t.tensors.items() if k not in skip},
                        {k: v[0] for k, v in saved.items()})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(templates, storage_reader=SafeFileSystemReader(path, metadata), planner=SafeLoadPlanner(),
                     process_group=self.group, no_dist=not self.distributed)
        st.apply_model(parts, model_t)
        optim_t.fill_copies()
        if training:
            if load_optimizer:
                st.apply_optimizer(optimizer, parts, per_param, state["param_groups"], allow_new=bool(skip))
            for name, component in run.components.items():
                if state.get(name) is not None or not optional(component):
                    component.load_state_dict(state[name])
            for name, found in extra.items():
                run.tensor_components[name].loaded(set(found))
            run.state.load_state_dict(state)
            self._restore_rng(path, run, state)
        self.loaded_from = path
        self.last_saved_step = run.state.step if training else None
        self.log(f"resumed from {path} (step {state['step']}, saved by {state.get('world_size', '?')} ranks, "
                 f"loaded by {self.world_size}) in {time.perf_counter() - start:.2f}s")
        return state

    @staticmethod
    def _check_components(path: Path, state: dict[str, Any], run: Checkpointable) -> None:
        """Every component of this run must find its state: resuming it from scratch would be another run."""
        missing = [name for name, c in run.components.items() if state.get(name) is None and not optional(c)]
        if missing:
            raise CheckpointError(f"{path} holds no state for {', '.join(map(repr, missing))} (saved by a run "
                                  "without it); resume a run with the same components, or start from the weights "
                                  "alone (meshformer convert to-safetensors, then to-checkpoint)")

    def _check_fit(self, path: Path, run: Checkpointable, saved: compat.Shapes) -> set[str]:
        """Refuse a checkpoint of another model shape (collective: every rank decides alike), unless
        checkpoint.load_mode="partial": then the model keys to leave as initialized."""
        local = compat.model_shapes(st.model_tensors(run.model_parts).tensors)
        diff = compat.compare(compat.all_model_shapes(local, self.group), saved)
        if not diff:
            return set()
        if diff.only_router_biases_missing:
            self.log(f"{path.name} holds no MoE router biases (saved before meshformer checkpointed them): they "
                     "start at zero, as at every resume of the run that wrote it")
            return diff.skipped & set(local)
        if self.cfg.load_mode != "partial":
            raise compat.refuse(path, diff)
        self.log(f"WARNING: checkpoint.load_mode=\"partial\": loading only the tensors of {path.name} that fit this "
                 f"model ({diff.describe(limit=12)}); the rest keep their initial values")
        return diff.skipped & set(local)

    def _restore_rng(self, path: Path, run: Checkpointable, state: dict[str, Any]) -> None:
        file = path / directory.rank_file(self.rank)
        if file.is_file():
            restore_rng_state(json.loads(file.read_text())["rng"])
            return
        seed = hash((int(run.config.train.seed), int(state["step"]), self.rank)) % 2**31
        self.log(f"rank {self.rank}: the checkpoint (saved by {state.get('world_size')} ranks) has no RNG state "
                 f"for this rank; seeding fresh streams from train.seed, step and rank")
        seed_all(seed)

    def _warn_config_changes(self, saved: dict[str, Any] | None, cfg: Config) -> None:
        if not saved or self.rank != 0:
            return
        now = cfg.to_dict()
        saved = migrate_tree(saved, report="none")  # a checkpoint of an earlier release: its flat [model] keys
        changed = [f"{section}.{key}: {before.get(key)!r} -> {value!r}"
                   for section in ("model", "optim", "schedule", "data", "train")
                   if isinstance(saved.get(section), dict)
                   for before in [flatten(saved[section])]
                   for key, value in flatten(now.get(section, {})).items()
                   if _normal(before.get(key)) != _normal(value)]
        if changed:
            self.log("config differs from the checkpoint's: " + "; ".join(changed[:12]))

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


def checkpoint_root(cfg: Config, run_dir: Path | None = None) -> Path:
    """checkpoint.dir, or <run_dir>/checkpoints (run_dir: logging.run_dir unless given)."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir or cfg.logging.run_dir) / "checkpoints"


def _model_signature(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """The model tensors of a checkpoint folder and their shapes (None when its index cannot be read)."""
    try:
        entries = tensor_entries(read_metadata(folder))
    except CheckpointError:
        return None
    return {k: tuple(v.size) for k, v in entries.items() if k.startswith(st.MODEL)}


def _normal(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def refuse_earlier_checkpoints(root: Path) -> None:
    """checkpoint.resume=false starts at step 0, and its saves could not commit over the steps an earlier run left
    in `root` (a commit never replaces a checkpoint it did not write): say so before any work, not at the first
    save."""
    steps = directory.committed_steps(Path(root))
    if steps:
        raise CheckpointError(f"checkpoint.resume=false, but {root} holds checkpoints of an earlier run (steps "
                              f"{steps[0]}..{steps[-1]}) that this run's saves would collide with",
                              "move them out of that folder (or set checkpoint.dir to an empty folder) to start from "
                              "step 0, or set checkpoint.resume=true to continue from them")
