"""The training loop: one path for every family, device and parallel layout.

The loop knows nothing about sharding or the update: it hands each step's micro-batches to a `TrainStep`
(meshformer.train.step), which owns the parallelized model, the optimizer and the schedule. Everything else a step
does (metrics and their sinks, evaluation, samples, checkpoint cadence, profiling, straggler and MoE reports) is a
callback (meshformer/train/callbacks.py lists the hooks). Host-device syncs happen only at logging, evaluation and
sampling intervals.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshformer import folders
from meshformer.batch import Batch
from meshformer.checkpointing.init_from import SOURCE_FILE, load_init_weights, record_source, taken_from_folder
from meshformer.checkpointing.manager import CheckpointManager
from meshformer.checkpointing.save_errors import final_weights_failed_error
from meshformer.config import Config
from meshformer.data import Tokenizer
from meshformer.loss.cross_entropy import LossFn
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.parallel_dims import ParallelDims
from meshformer.runtime.profiler import StepProfiler
from meshformer.runtime.stop import StopAgreed, StopRequest, exit_status, signal_name
from meshformer.train import setup
from meshformer.train.callbacks import Callback, CallbackContext
from meshformer.train.optim import SkippedUpdates
from meshformer.train.preflight import (
    FINAL_WEIGHTS,
    check_final_folder,
    config_warnings,
    has_final_weights,
    run_folders_claimed,
)
from meshformer.train.replica_step import ReplicaTraining, replica_config
from meshformer.train.run_record import check_rerun, record_config
from meshformer.train.step import StepStats


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    eval_loss: float | None
    run_dir: Path
    history: list[dict[str, float]] = field(default_factory=list)
    stopped_by: int | None = None  # the signal that stopped the run before train.steps (its checkpoint is saved)


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class Trainer:
    def __init__(self, cfg: Config, *, rank: int = 0, local_rank: int = 0, tokenizer: Tokenizer | None = None,
                 dims: ParallelDims | None = None, callbacks: Sequence[Callback] = (),
                 loss: LossFn | None = None) -> None:
        """tokenizer: the one preflight loaded and checked, when the caller ran preflight (else loaded here).
        dims: the layout `init_distributed` validated when it joined the process group (else validated here).
        callbacks: more callbacks (meshformer/train/callbacks.py), besides the built-in ones and the config's.
        loss: a token loss of your own, `(logits, labels) -> summed loss` on full-vocabulary logits, instead of
        train.loss's cross-entropy (the model's auxiliary terms still join it; docs/extending/index.md#losses)."""
        # The set-up, one step after another (meshformer/train/setup.py); a restarted replica group redoes it.
        resolved = setup.resolve_config(cfg, callbacks)
        cfg = resolved.cfg
        self.cfg, self.rank = cfg, rank
        placement = setup.place(cfg, local_rank, dims)
        self.device, self.ceiling = placement.device, placement.ceiling
        output = setup.open_run(cfg, rank, placement.world_size, resolved.callbacks)
        self.run_dir, self.logger, self.watchdog = output.run_dir, output.logger, output.watchdog
        self.tokenizer = setup.load_tokenizer(cfg, tokenizer)
        built = setup.build_model(cfg, placement, loss)
        self.parallel_model: ParallelModel = built.parallel
        self.model = built.model  # the whole model for decoded samples (None under pipeline parallel)
        self.build_s, self.target_len, self.flops_per_token = built.build_s, built.target_len, built.flops_per_token
        self.training_step = setup.build_optimizer(cfg, self.parallel_model, self.watchdog.phase)
        run_callbacks = setup.build_callbacks(cfg, self.tokenizer, resolved.callbacks, rank, self.watchdog.phase)
        self.downstream, self.callbacks = run_callbacks.downstream, run_callbacks.callbacks
        self.context = CallbackContext(self)  # the run's hook argument (fit starts it at the resumed step)
        if self.callbacks.wants("on_optimizer_step"):  # after the FP8 and router-bias hooks
            self.training_step.add_post_step_hook(
                lambda applied: self.callbacks.call("on_optimizer_step", self.context, applied))
        data = setup.build_data(cfg, self.tokenizer, self.parallel_model)
        self.train_data, self.eval_data = data.train, data.eval
        run_state = setup.track_state(cfg, self.device, self.parallel_model, self.training_step, data, self.callbacks,
                                      output, self.tokenizer)
        self.state, self.checkpointable, self.checkpoints = (run_state.state, run_state.checkpointable,
                                                             run_state.checkpoints)
        # restore_state, the last step, runs at the start of fit (under the watchdog, with the stop check armed)

        self.train_iter: Iterator[Batch] | None = None  # started at the first step, after a resume moved the loader
        self.last_lr: float = self.training_step.optimizer.param_groups[0]["lr"]  # the rate the last step used
        # A stop signal (scheduler, Ctrl-C, launcher): every rank finishes the same step (or batch of a long phase),
        # saves and exits 128+signal.
        self.stop = (StopRequest(every=cfg.checkpoint.preempt_check_interval, log=self.logger.info,
                                 on_stop_now=self.logger.flush) if cfg.checkpoint.save_on_sigterm else None)

        self.logger.info(
            f"model: {cfg.model.family}, {built.n_params / 1e6:.2f}M parameters, objective {cfg.objective}; "
            f"device {self.device}, dtype {cfg.train.dtype}; optimizer: {cfg.optim.name} "
            f"({self.training_step.kernel}); attention: "
            f"{self.parallel_model.report.get('attention', cfg.model.attention.backend)}; host malloc: "
            f"{placement.host_memory}; {self.ceiling.describe()}; model built and sharded in {self.build_s:.2f}s"
        )
        for warning in config_warnings(cfg, self.tokenizer):
            self.logger.info(warning)
        # A profiled step range (the Profiling callback drives it), and the time this rank waits for batches
        # (the straggler report reads and resets it at each logging step).
        self.profiler = StepProfiler(cfg.profile, self.run_dir, rank)
        self.data_wait_s = 0.0
        # fault_tolerance.enabled: this rank's part in the replica groups (quorum, heal, gradient average, commit)
        self.replicas = ReplicaTraining(self) if cfg.fault_tolerance.enabled else None
        if self.replicas is not None:
            self.checkpoints.skip_failed_saves = f"replica group {self.replicas.replica_id}"

    def restore_state(self, source: CheckpointManager | dict[str, Any]) -> bool:
        """The set-up's last step (meshformer/train/setup.py): at a start or restart from the newest checkpoint
        (`self.checkpoints`), at a heal from a live peer's state; False when there is no checkpoint."""
        return setup.restore_state(self.checkpointable, source)

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def tokens_seen(self) -> torch.Tensor:
        return self.state.tokens_seen

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.training_step.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.training_step.scheduler

    @property
    def skipped_updates(self) -> SkippedUpdates:
        return self.training_step.skipped_updates

    # ------------------------------------------------------------------ steps

    def train_step(self) -> StepStats:
        """One optimizer step over grad_accum micro-batches of the training data."""
        self.watchdog.phase("data", self.step + 1)
        wait_start = time.perf_counter()
        if self.train_iter is None:
            self.train_iter = iter(self.train_data)
        batches = self.train_iter
        micro_batches = [to_device(next(batches), self.device) for _ in range(self.cfg.train.grad_accum)]
        self.data_wait_s += time.perf_counter() - wait_start
        stats = self.training_step.step(micro_batches)
        if self.replicas is not None:
            self.replicas.after_step(self.step + 1)
            if not stats.committed:
                return stats
        self.last_lr = stats.lr
        self.state.step += 1
        # with replica groups: the target tokens of every group that trained the step
        self.state.tokens_seen += stats.global_tokens.to(torch.long) if self.replicas is None else \
            round(self.replicas.last.tokens)
        return stats

    def poll_stop(self) -> None:
        """The stop check between two batches of a long phase (every rank calls it as often as the others): raises
        StopAgreed once every rank agreed to stop (meshformer/runtime/stop.py)."""
        if self.stop is not None:
            self.stop.poll()

    @torch.no_grad()
    def evaluate(self) -> float:
        for part in self.parallel_model.model_parts:
            part.eval()
        loss_sum, tokens = 0.0, 0.0
        eval_iter = iter(self.eval_data)  # the same held-out batches at every evaluation
        try:
            for _ in range(self.cfg.train.eval_batches):
                self.poll_stop()
                batch_loss, batch_tokens = self.parallel_model.evaluate(to_device(next(eval_iter), self.device))
                loss_sum += float(batch_loss)
                tokens += float(batch_tokens)
        finally:
            self.eval_data.close()  # no idle eval workers holding prefetched batches until the next evaluation
            for part in self.parallel_model.model_parts:
                part.train()
        return loss_sum / max(tokens, 1.0)

    def sample_batch(self) -> dict[str, torch.Tensor]:
        """The first held-out batch: samples start from the run's own data."""
        batch = next(iter(self.eval_data))  # eval batches are the same at every pass: training order is untouched
        self.eval_data.close()
        return batch

    # ------------------------------------------------------------------ loop

    def fit(self) -> TrainResult:
        """Train to train.steps, or until a stop signal (then save and return with `stopped_by` set); a collective
        timeout ends in an error naming the slowest rank."""
        if self.stop is not None:
            self.stop.install()
        try:
            with self.watchdog.guard(on_error=self.logger.close):  # a failed run keeps its TensorBoard events
                return self._fit()
        finally:
            if self.stop is not None:
                self.stop.close()

    def _fit(self) -> TrainResult:
        cfg, log = self.cfg, self.logger
        # model, optimizer, scheduler, step, data, RNG: before iterating
        resumed = self.restore_state(self.checkpoints)
        start_step, had_final = self.step, has_final_weights(self.run_dir)
        if dropped := log.rewind(start_step):
            log.info(f"metrics.jsonl: dropped {dropped} lines logged after step {start_step} by the interrupted run "
                     "(this run logs those steps again)")
        # The run folder is a record: a changed config that trains nothing (or retrains a finished run) is refused.
        changes = check_rerun(cfg, self.run_dir, start_step, had_final)
        ctx = self.context
        ctx.step = self.step
        callbacks = self.callbacks
        try:
            # The set-up before the first step is checked between its phases (nothing overlaps the exchange there),
            # and the init-from load after each tensor: a stop before any step ends the run with nothing to save.
            self._check_stop_now()
            # a run started from an HF folder reads it only while it has no checkpoint of its own
            if not resumed and cfg.checkpoint.init_from:
                self._load_init_weights()
            if self.step >= cfg.train.steps:
                log.info(f"the run in {self.run_dir} already reached step {self.step} >= train.steps="
                         f"{cfg.train.steps}; raise train.steps to train further, or pass --new-run for a fresh run")
            elif self.rank == 0:
                record_config(cfg, self.run_dir, start_step, changes, log.info)
            self.train_iter = iter(self.train_data)  # from the position the resume restored
            callbacks.call("on_run_start", ctx)
            self._check_stop_now()
            while self.step < cfg.train.steps:
                if self.replicas is not None:
                    self.replicas.start_step()  # the step's quorum; a heal from a live peer may move self.step
                ctx.step, ctx.stats, ctx.metrics, ctx.saved = self.step + 1, None, {}, None
                callbacks.call("on_step_start", ctx)
                ctx.stats = self.train_step()
                if not ctx.stats.committed:
                    continue  # dropped by fault tolerance: the same step again, with the same batches
                step = self.step
                ctx.log_step = step % cfg.logging.log_interval == 0 or step == cfg.train.steps
                callbacks.call("on_step_end", ctx)
                # Read one step late: every rank gets the same answer after the same step, without a host sync. A
                # stop skips evaluation and samples (the grace period before the scheduler's kill is for the
                # save); one agreed during them (StopAgreed, within a batch) leaves them at once.
                ctx.stopping = self.stop is not None and step < cfg.train.steps and self.stop.agreed(step)
                if self.replicas is not None and step < cfg.train.steps:
                    ctx.stopping = self.replicas.stop_agreed(ctx.stopping)  # every replica group at the same step
                if not ctx.stopping:
                    try:
                        callbacks.call("on_evaluation", ctx)
                    except StopAgreed as agreed:  # replica groups: it rides in the next cross-group exchange
                        if self.replicas is None or not self.replicas.stop_in_evaluation(agreed, step):
                            raise
                log.flush()  # the metrics of a step are on disk before its checkpoint commits
                if ctx.stopping:
                    break
                callbacks.call("on_checkpoint", ctx)
            if self.replicas is not None and self.step >= cfg.train.steps:
                self.replicas.finish()  # local_sgd / diloco: the last synchronisation of the groups' weights
        except StopAgreed:
            ctx.stopping = True
            log.flush()
        self.watchdog.phase("finish")
        stopping, trained = ctx.stopping, self.step > start_step
        saved: Path | None = None
        try:  # raises if the final checkpoint cannot be written...
            # a stop before this run trained a step saves nothing: the folder's newest checkpoint (or none, before
            # an unfinished init-from load) is where the same command starts again
            saved = self.checkpoints.finish(self.checkpointable, stopping=stopping, save=trained or not stopping)
        finally:
            # ...but the trained weights are written first (again only if this run trained, or they are missing).
            # A stop leaves them unwritten where this step's checkpoint is committed (the same command writes them
            # from it); otherwise they are all the run keeps, and they are finished.
            if not stopping and self.step >= cfg.train.steps and (trained or not had_final):
                stopping = not self.save_final_weights(stoppable=saved is not None)
        stopped_by = self.stop.signum if stopping and self.stop is not None else None
        if stopped_by is not None:
            assert self.stop is not None
            self.stop.saved()
            log.info(self._stopped_line(stopped_by, saved, trained))
        ctx.step, ctx.saved = self.step, saved
        callbacks.call("on_run_end", ctx)
        log.close()
        if self.replicas is not None:
            self.replicas.close()
        return TrainResult(self.step, ctx.loss, ctx.eval_loss, self.run_dir, ctx.history, stopped_by)

    def _check_stop_now(self) -> None:
        if self.stop is not None:
            self.stop.check_now()

    def _load_init_weights(self) -> None:
        """checkpoint.init_from's weights into this rank's shards, with a stop check after each tensor (every rank
        checks as often as the one with the most tensors: pipeline stages hold different numbers)."""
        from meshformer.checkpointing.state import named_parameters

        start = time.perf_counter()
        parts = self.parallel_model.model_parts
        poll = self.stop.poll_padded(sum(len(named_parameters([part])) for part in parts)) \
            if self.stop is not None else None
        arch = load_init_weights(parts, self.cfg, between=poll)
        if poll is not None:
            poll.finish()
        if self.rank == 0:
            record_source(self.run_dir, self.cfg, arch)
        self.logger.info(taken_from_folder(self.cfg, arch, time.perf_counter() - start))

    def _stopped_line(self, signum: int, saved: Path | None, trained: bool) -> str:
        steps = self.cfg.train.steps
        resume = f"run the same command to resume (exit status {exit_status(signum)})"
        if saved is None and not trained:
            return (f"stopped by {signal_name(signum)} before step {self.step + 1}/{steps}: nothing trained, no "
                    f"checkpoint saved; run the same command to start again (exit status {exit_status(signum)})")
        where = f"checkpoint {saved} committed" if saved is not None else "no checkpoint saved"
        if self.step >= steps:
            where += f", final weights not written ({FINAL_WEIGHTS}/: the same command writes them)"
        return f"stopped by {signal_name(signum)} after step {self.step}/{steps}: {where}; {resume}"

    def save_final_weights(self, *, stoppable: bool = False) -> bool:
        """Write the weights beside final/ (final.partial/, ours) and then swap them in: a failed write leaves
        an earlier final/ as it was, and a final/ someone else filled during the run is refused, not replaced.
        `stoppable`: a stop agreed during the write abandons it (returns False; the staged folder is removed)."""
        from meshformer.checkpointing.weights import save_weights

        final = self.run_dir / FINAL_WEIGHTS
        staged = final.with_name(final.name + ".partial")
        if self.rank == 0:
            folders.scratch(staged, "final weights")
        try:
            path = save_weights(self.parallel_model, staged, self.cfg.checkpoint.max_shard_size, self.tokenizer,
                                between=self.poll_stop if stoppable else None)
        except StopAgreed:
            if self.rank == 0:
                folders.remove(staged)
            return False
        except Exception as err:
            if self.rank == 0:
                folders.remove(staged)
            one_line = final_weights_failed_error(err, final)
            if one_line is None:
                raise
            raise one_line from None
        if path is not None:
            if (self.run_dir / SOURCE_FILE).is_file():  # from an HF folder: export goes back to its architecture
                shutil.copy(self.run_dir / SOURCE_FILE, staged / SOURCE_FILE)
            check_final_folder(final)
            folders.replace(staged, final)
            self.logger.info(f"final weights written to {final / path.name}")
        return True


def train(cfg: Config, callbacks: Sequence[Callback] = (), loss: LossFn | None = None) -> TrainResult:
    """Single-process entry point; distributed runs go through meshformer.train.__main__ under torchrun.
    callbacks: more callbacks, besides the built-in ones and the config's [[callbacks]]. loss: as `Trainer`'s."""
    cfg = replica_config(cfg)  # a replica group (fault_tolerance) trains in its own run folder
    with run_folders_claimed(cfg):
        return Trainer(cfg, callbacks=callbacks, loss=loss).fit()
