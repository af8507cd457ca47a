"""A stop signal inside a long phase of one process is acted on at the phase's next batch (token, tensor), not at
its end: a decoded sample, the `--init-from` load, the set-up before the first step, the final weights, in-loop
scoring through lm-eval's evaluator. Each test
sends SIGTERM from inside the phase (its third batch) and counts the batches that ran after it. The agreement of
two ranks on the batch to leave at, also where they hold different numbers of items, is checked on its own; the
phases under two ranks, held-out evaluation and downstream scoring among them: test_stop_signals.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from helpers.checkpoints import tiny_shards
from helpers.common import CONFIGS, SMALL

from meshformer.checkpointing.directory import committed_steps, step_dir_name
from meshformer.checkpointing.init_from import resolve_init_from
from meshformer.config import load_config
from meshformer.runtime.stop import StopAgreed, StopRequest
from meshformer.train.callbacks import Callback
from meshformer.train.trainer import Trainer

SIGNAL_AT = 3  # the phase's batch that sends the signal


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return tiny_shards(tmp_path_factory.mktemp("stop_phases"))


def _config(shards: Path, run_dir: Path, *extra: str):
    return load_config(CONFIGS / "tiny-gpt.toml", [
        *SMALL, f"data.shards={shards}", "data.seq_len=32", "model.max_seq_len=32", "data.num_workers=0",
        "train.steps=4", "logging.log_interval=1", "logging.tensorboard=false", "checkpoint.interval=2",
        f"logging.run_dir={run_dir}", *extra])


class Signaller:
    """Counts a phase's batches and sends this process SIGTERM at the SIGNAL_AT-th."""

    def __init__(self) -> None:
        self.calls = 0
        self.active = True

    def __call__(self) -> None:
        if not self.active:
            return
        self.calls += 1
        if self.calls == SIGNAL_AT:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_stop_during_a_sample_ends_it_at_the_next_token(shards, tmp_path, monkeypatch, one_thread):
    import meshformer.train.sampling as sampling

    tokens = Signaller()
    tokens.active = False
    decode = sampling.greedy_decode

    def counted(model, *args, **kwargs):  # only the sample's forward passes count, not the training steps'
        forward = model.decode
        model.decode = lambda *a, **k: (tokens(), forward(*a, **k))[1]
        tokens.active = True
        try:
            return decode(model, *args, **kwargs)
        finally:
            tokens.active = False
            del model.decode

    monkeypatch.setattr(sampling, "greedy_decode", counted)
    cfg = _config(shards, tmp_path, "train.sample_interval=2", "train.sample_tokens=16")
    result = Trainer(cfg).fit()
    assert result.stopped_by == signal.SIGTERM and result.steps == 2 and tokens.calls == SIGNAL_AT
    assert committed_steps(tmp_path / "checkpoints") == [2] and not (tmp_path / "final").exists()


@pytest.mark.slow
def test_a_stop_during_the_init_from_load_ends_it_and_saves_nothing(shards, tmp_path, monkeypatch, one_thread):
    pytest.importorskip("transformers")
    from helpers.hf_models import hf_folder

    import meshformer.checkpointing.weights as weights

    _, folder = hf_folder("llama", tmp_path / "hf")
    tensors, copy = Signaller(), weights._copy_local
    monkeypatch.setattr(weights, "_copy_local", lambda *a, **k: (copy(*a, **k), tensors())[0])
    cfg = resolve_init_from(load_config(None, [
        f"data.shards={shards}", "data.seq_len=32", "data.batch_size=4", "data.num_workers=0", "train.steps=2",
        "train.eval_interval=0", "train.sample_interval=0", "train.device=cpu", "logging.tensorboard=false",
        f"logging.run_dir={tmp_path / 'run'}", f"checkpoint.init_from=hf:{folder}"]))
    result = Trainer(cfg).fit()
    assert result.stopped_by == signal.SIGTERM and result.steps == 0 and tensors.calls == SIGNAL_AT
    assert not committed_steps(tmp_path / "run" / "checkpoints")  # half-loaded weights are no checkpoint
    tensors.active = False
    again = Trainer(cfg).fit()  # the same command starts again from the folder's weights
    assert again.stopped_by is None and again.steps == 2 and (tmp_path / "run" / "final").is_dir()


@pytest.mark.slow
def test_a_stop_during_in_loop_lm_eval_scoring_ends_it_at_the_next_batch(shards, tmp_path, monkeypatch, one_thread):
    """lm-eval's evaluator is scoring a task's requests (one a batch) through the layout's evaluation forward when
    SIGTERM arrives: no further batch runs, the step's checkpoint is committed and nothing of the scoring is logged."""
    import meshformer.eval.layout_forward as layout_forward

    batches, score = Signaller(), layout_forward.score_rows_greedy
    forwards: list[int] = []

    def counted(model, cfg, rows, batch_size, pad_id, seq_len, poll):
        evaluate = model.evaluate
        model.evaluate = lambda *a, **k: (forwards.append(batches.calls), evaluate(*a, **k))[1]
        try:
            return score(model, cfg, rows, batch_size, pad_id, seq_len, lambda: (batches(), poll())[1])
        finally:
            del model.evaluate

    monkeypatch.setattr(layout_forward, "score_rows_greedy", counted)  # what LayoutScorer calls
    cfg = _config(shards, tmp_path, 'downstream.tasks=["bundled:kjv_cloze"]', "downstream.interval=2",
                  "downstream.batch_size=1")
    result = Trainer(cfg).fit()
    assert result.stopped_by == signal.SIGTERM and result.steps == 2
    assert batches.calls == SIGNAL_AT and forwards == list(range(1, SIGNAL_AT))  # the signalled batch never ran
    assert committed_steps(tmp_path / "checkpoints") == [2] and not (tmp_path / "final").exists()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not any(key.startswith("downstream/") for line in logged for key in line)


class StopsInSetUp(Callback):
    """A stop that arrives after the resume, before the first step (as a slow set-up would receive it)."""

    def on_run_start(self, ctx):
        os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_stop_during_the_set_up_trains_no_step(shards, tmp_path, one_thread, caplog):
    cfg = _config(shards, tmp_path)
    with caplog.at_level("INFO", logger="meshformer"):
        result = Trainer(cfg, callbacks=[StopsInSetUp()]).fit()
    assert result.stopped_by == signal.SIGTERM and result.steps == 0
    assert not committed_steps(tmp_path / "checkpoints")
    assert any(r.getMessage().startswith("stopped by SIGTERM before step 1/4: nothing trained, no checkpoint saved")
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.slow
def test_a_stop_during_the_final_weights_leaves_them_to_the_next_run(shards, tmp_path, monkeypatch, one_thread):
    """Where the last step's checkpoint is committed, the final weights are dropped at the next tensor (the same
    command writes them); where it is not (checkpoint.interval = 0), they are all the run keeps and are finished."""
    import meshformer.checkpointing.weights as weights

    pieces, gathered = Signaller(), weights.gathered_pieces

    def counted(*args, **kwargs):
        for piece in gathered(*args, **kwargs):
            pieces()
            yield piece

    monkeypatch.setattr(weights, "gathered_pieces", counted)
    result = Trainer(_config(shards, tmp_path / "run")).fit()
    assert result.stopped_by == signal.SIGTERM and result.steps == 4 and pieces.calls == SIGNAL_AT
    assert committed_steps(tmp_path / "run" / "checkpoints")[-1] == 4
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / "final.partial").exists()
    pieces.active = False
    again = Trainer(_config(shards, tmp_path / "run")).fit()
    assert again.stopped_by is None and (tmp_path / "run" / "final" / "model.safetensors").is_file()

    pieces.active, pieces.calls = True, 0
    kept = Trainer(_config(shards, tmp_path / "kept", "checkpoint.interval=0")).fit()
    assert kept.stopped_by is None and pieces.calls > SIGNAL_AT
    assert (tmp_path / "kept" / "final" / "model.safetensors").is_file()
    assert not (tmp_path / "kept" / "checkpoints" / step_dir_name(4)).exists()


def _agreement_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    stop = StopRequest()
    items = 3 if rank == 0 else 7  # e.g. two pipeline stages' tensors
    poll = stop.poll_padded(items)
    for _ in range(items):
        poll()
    poll.finish()
    left = None
    for batch in range(10):
        if rank == 1 and batch == 2:  # rank 1 alone is signalled, before its third batch
            stop._on_signal(signal.SIGUSR1, None)
        try:
            stop.poll()
        except StopAgreed as agreed:
            left = [batch, agreed.signum]
            break
    stop.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"polls": poll.done, "left": left}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_leave_a_phase_after_the_same_batch(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_agreement_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # the ranks polled alike through a phase of unequal lengths, then both left at the batch after the signal's
    assert results == [{"polls": 7, "left": [3, signal.SIGUSR1]}] * 2
