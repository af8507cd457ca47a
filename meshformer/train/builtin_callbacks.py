"""The trainer's own per-step concerns, as callbacks (hooks and orders: meshformer/train/callbacks.py).

Each reads the trainer's parts (model, logger, checkpoint manager, profiler) and nothing here feeds back into the
step: removing one changes what a run reports, never its weights.
"""

from __future__ import annotations

import json
import math
import time

import torch

from meshformer.checkpointing.directory import step_dir_name
from meshformer.config import Config
from meshformer.parallel.parallelize import world_size
from meshformer.runtime.stragglers import rank_timings, straggler_scalars
from meshformer.train.callbacks import Callback, CallbackContext
from meshformer.train.downstream import DownstreamEval
from meshformer.train.metrics import current_memory_gib, memory_gib, synchronize
from meshformer.train.sampling import decoded_sample


class StepMetrics(Callback):
    """Training loss, learning rate, gradient norm, throughput, MFU and memory over each logging window (the steps
    since the last logging step), into ctx.metrics. Reducing the loss is a collective: every rank runs it."""

    order, phase = 10, "logging"
    PROJECT_AFTER = 10  # steps of this run before its pace and projected time are logged, once

    def __init__(self) -> None:
        self.window_steps = 0
        self.window_start: float | None = None  # None: the next step starts a window
        self.window_loss: torch.Tensor | None = None
        self.window_tokens: torch.Tensor | None = None
        self.run_start, self.first_step, self.projected = 0.0, 0, False

    def on_run_start(self, ctx: CallbackContext) -> None:
        device = ctx.trainer.device
        self.window_loss = torch.zeros((), device=device)
        self.window_tokens = torch.zeros((), device=device)
        self.run_start, self.first_step = time.perf_counter(), ctx.step

    def on_step_start(self, ctx: CallbackContext) -> None:
        # A window starts at its first step: evaluation, samples and saves of the logging step before it are not
        # part of its time.
        if self.window_start is None:
            synchronize(ctx.trainer.device)
            self.window_start = time.perf_counter()

    def on_step_end(self, ctx: CallbackContext) -> None:
        trainer, stats = ctx.trainer, ctx.stats
        assert stats is not None and self.window_loss is not None and self.window_tokens is not None
        assert self.window_start is not None
        self.window_loss += stats.loss_sum
        self.window_tokens += stats.global_tokens
        self.window_steps += 1
        if not ctx.log_step:
            return
        cfg = ctx.cfg
        synchronize(trainer.device)  # the window's queued device work is part of its time
        elapsed = time.perf_counter() - self.window_start
        ctx.loss = trainer.parallel_model.reduce_for_logging(self.window_loss) / max(float(self.window_tokens), 1.0)
        tokens_per_sample = cfg.data.seq_len + (trainer.target_len or 0)
        tokens_per_step = (cfg.data.batch_size * tokens_per_sample * cfg.train.grad_accum
                           * trainer.parallel_model.dp_size)
        tokens_per_s = tokens_per_step * self.window_steps / elapsed  # the whole job's
        tokens_per_s_per_rank = tokens_per_s / world_size()
        mfu, ceiling_note = trainer.ceiling.mfu(trainer.flops_per_token * tokens_per_s_per_rank)
        if ceiling_note:
            ctx.info(ceiling_note)
        record = {
            "train/loss": ctx.loss,
            "train/lr": trainer.last_lr,
            "train/grad_norm": float(stats.grad_norm),
            "perf/tokens_per_s": tokens_per_s,
            "perf/tokens_per_s_per_rank": tokens_per_s_per_rank,
            "perf/mfu": mfu if mfu is not None else math.nan,  # n/a: the ceiling is unreliable
            "perf/memory_gib": memory_gib(trainer.device),  # peak (rank 0)
            "perf/memory_now_gib": current_memory_gib(trainer.device),
            "perf/step_time_s": elapsed / self.window_steps,
        }
        skipped_updates = trainer.skipped_updates
        skipped = skipped_updates.check(ctx.step)  # raises once too many steps in a row were skipped
        if skipped or skipped_updates.total:
            record["train/skipped_steps"] = skipped_updates.total
        if skipped:
            ctx.info(f"warning: {skipped} of the last {self.window_steps} steps had an inf/nan gradient norm; "
                     f"their updates were skipped ({skipped_updates.total} in this run so far)")
        if not self.projected and ctx.step - self.first_step >= self.PROJECT_AFTER and not ctx.last:
            # this run's steps at the pace of those so far (everything between them included; evaluations and saves
            # still to come add to it)
            self.projected = True
            pace = (time.perf_counter() - self.run_start) / (ctx.step - self.first_step)
            record["perf/pace_s_per_step"] = pace
            record["perf/projected_run_s"] = pace * (cfg.train.steps - self.first_step)
        record |= trainer.train_data.source_scalars()  # mixtures: samples and tokens per source so far
        record |= trainer.training_step.qk_clip_scalars()  # MuonClip: largest attention logit, heads clipped
        ctx.metrics |= record
        self.window_loss.zero_()
        self.window_tokens.zero_()
        self.window_steps = 0
        self.window_start = None


class StragglerReport(Callback):
    """Data wait and the spread of step times over ranks (the slowest rank named), on logging steps: an all-gather,
    so every rank runs it. Reads perf/step_time_s from the step metrics."""

    order, phase = 20, "logging"

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, ctx: CallbackContext) -> None:
        self.steps += 1
        if not ctx.log_step:
            return
        trainer = ctx.trainer
        timings = rank_timings(ctx.metrics["perf/step_time_s"], trainer.data_wait_s / self.steps, trainer.device)
        ctx.metrics |= straggler_scalars(timings)
        trainer.data_wait_s, self.steps = 0.0, 0


class MoEStatistics(Callback):
    """Per MoE layer: expert load max/mean, dropped fraction, aux and z losses; per DSA layer its indexer loss; per
    multi-token prediction module its mean loss; on logging steps (a collective)."""

    order, phase = 30, "logging"

    def on_step_end(self, ctx: CallbackContext) -> None:
        if ctx.log_step:
            ctx.metrics |= ctx.trainer.parallel_model.moe_scalars()
            ctx.metrics |= ctx.trainer.parallel_model.mtp_scalars()  # mtp/loss_<k>, multi-token prediction


class CheckpointCadence(Callback):
    """A checkpoint every checkpoint.interval steps (the manager's cadence; the final save is the trainer's)."""

    order, phase = 40, "checkpoint"

    def on_checkpoint(self, ctx: CallbackContext) -> None:
        checkpoints = ctx.trainer.checkpoints
        save_start, saved_before = time.perf_counter(), checkpoints.last_saved_step
        checkpoints.after_step(ctx.trainer.checkpointable)
        if checkpoints.last_saved_step != saved_before:  # async saves: the part that blocks training
            ctx.log({"checkpoint/save_s": time.perf_counter() - save_start})
            ctx.saved = checkpoints.root / step_dir_name(ctx.step)


class MetricsLogger(Callback):
    """Writes the step's metrics to metrics.jsonl, TensorBoard and W&B (rank 0's logger) and the console line."""

    order, phase = 90, "logging"

    def on_step_end(self, ctx: CallbackContext) -> None:
        if not ctx.log_step:
            return
        record = ctx.metrics
        ctx.history.append({"step": ctx.step, **record})
        ctx.log(record)
        loads = [v for k, v in record.items() if k.endswith("/load_max_over_mean")]
        mtp = [f"{k.removeprefix('mtp/')} {v:.4f}" for k, v in record.items() if k.startswith("mtp/loss_")]
        projected = record.get("perf/projected_run_s")
        mfu = record.get("perf/mfu", math.nan)
        ctx.info(
            f"step {ctx.step:>6}/{ctx.cfg.train.steps} | loss {record['train/loss']:.4f} | "
            + (f"mtp {', '.join(mtp)} | " if mtp else "")  # the modules' losses beside the main one
            + f"lr {record['train/lr']:.2e} | grad {record['train/grad_norm']:.3f} | "
            f"{record['perf/tokens_per_s']:,.0f} tok/s global, {record['perf/tokens_per_s_per_rank']:,.0f} per rank "
            "| mfu " + (f"{100 * mfu:.1f}%" if math.isfinite(mfu) else "n/a") + " | "
            f"mem peak {record['perf/memory_gib']:.2f} GiB, now {record['perf/memory_now_gib']:.2f} GiB"
            + (f" | expert load max/mean {max(loads):.2f}" if loads else "")
            + (f" | replicas {record['ft/replicas']:.0f}" if "ft/replicas" in record else "")
            + (f" | ~{record['perf/pace_s_per_step']:.3g} s/step, run ≈ {_duration(projected)}" if projected else "")
        )


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds < 2 * 3600 else f"{seconds / 3600:.1f} h"


class HeldOutLoss(Callback):
    """The held-out loss every train.eval_interval steps and at the last step (a collective: every rank)."""

    order, phase = 10, "eval"

    def on_evaluation(self, ctx: CallbackContext) -> None:
        if not ctx.every(ctx.cfg.train.eval_interval, last=True):
            return
        ctx.eval_loss = loss = ctx.trainer.evaluate()
        ctx.log({"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50))})
        ctx.info(f"eval  {ctx.step:>6} | loss {loss:.4f} | ppl {math.exp(min(loss, 50)):.2f}")


class DownstreamScores(Callback):
    """lm-eval's scores of downstream.tasks (train/downstream.py) every downstream.interval steps
    (0: with the held-out loss) and at the last step (a collective: every rank)."""

    order, phase = 15, "downstream"

    def __init__(self, evaluation: DownstreamEval) -> None:
        self.evaluation = evaluation

    def on_evaluation(self, ctx: CallbackContext) -> None:
        if not self.evaluation.due(ctx.step, ctx.last):
            return
        scores = self.evaluation.run(ctx.trainer.parallel_model, ctx.trainer.poll_stop, ctx.trainer.model)
        ctx.log(scores)
        ctx.info(self.evaluation.describe(ctx.step, scores))


class Samples(Callback):
    """A decoded text sample every train.sample_interval steps and at the last step, from the first held-out batch
    (models that generate; pipeline stages do not)."""

    order, phase = 20, "sample"

    def on_evaluation(self, ctx: CallbackContext) -> None:
        trainer = ctx.trainer
        if not ctx.every(ctx.cfg.train.sample_interval, last=True) or trainer.model is None:
            return
        text = decoded_sample(trainer.model, trainer.tokenizer, ctx.cfg, trainer.device, trainer.sample_batch(),
                              poll=trainer.poll_stop)
        if text is not None:
            trainer.logger.text(ctx.step, "sample", text)
            ctx.info(f"sample {ctx.step:>5} | {json.dumps(text, ensure_ascii=False)}")  # one line, quoted


class Profiling(Callback):
    """torch.profiler over profile.start_step .. + profile.steps (the trainer's StepProfiler, on the ranks it
    names)."""

    order, phase = 95, "profile"

    def on_run_start(self, ctx: CallbackContext) -> None:
        ctx.trainer.profiler.step(ctx.step)  # starts here when profile.start_step is the first step of this run

    def on_checkpoint(self, ctx: CallbackContext) -> None:
        ctx.trainer.profiler.step(ctx.step)
        if ctx.last:  # a range past the last step ends here: the final save is not part of it
            ctx.trainer.profiler.stop()

    def on_run_end(self, ctx: CallbackContext) -> None:
        ctx.trainer.profiler.stop()  # a stop signal ended the run inside the range


def builtin_callbacks(cfg: Config, downstream: DownstreamEval | None = None) -> list[Callback]:
    """The trainer's own callbacks for this config (`downstream`: the scorer of downstream.tasks, if any)."""
    moe: list[Callback] = [MoEStatistics()] if cfg.model.moe.n_experts or cfg.model.mtp.depth else []
    scores: list[Callback] = [DownstreamScores(downstream)] if downstream is not None else []
    return [StepMetrics(), StragglerReport(), *moe, CheckpointCadence(), MetricsLogger(), HeldOutLoss(), *scores,
            Samples(), Profiling()]
