"""The single-process trainer: it learns, its accounting is exact, and it leaves logs, events and weights."""

import logging
import math
import time

import pytest
import torch
from helpers.common import CONFIGS, SMALL

from meshformer.checkpointing.weights import load_weights
from meshformer.config import load_config
from meshformer.train.trainer import Trainer


def unigram_entropy(batches) -> float:
    counts = torch.zeros(4096, dtype=torch.float64)
    for batch in batches:
        labels = batch["labels"][batch["labels"] >= 0]
        counts += torch.bincount(labels, minlength=4096).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


@pytest.mark.slow
def test_tiny_gpt_learns_well_below_unigram_entropy(tmp_path):
    cfg = load_config(CONFIGS / "tiny-gpt.toml", [*SMALL, "train.steps=400", "train.eval_interval=400",
                                                 "data.batch_size=32", "optim.lr=5e-3", "schedule.warmup_steps=20",
                                                 f"logging.run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    # Estimated on a separate loader so the trainer's stream is untouched; 100 batches = 200k tokens.
    from meshformer.data import build_loader

    stream = iter(build_loader(cfg, trainer.tokenizer, "train", 0, 1))
    entropy = unigram_entropy(next(stream) for _ in range(100))
    result = trainer.fit()
    # No unigram model beats its entropy (about 6.0 nats here); context must buy at least a nat.
    assert result.eval_loss < entropy - 1.0, (result.eval_loss, entropy)
    assert math.isfinite(result.final_loss)


def test_run_leaves_config_events_and_weights(tmp_path):
    cfg = load_config(CONFIGS / "tiny-gpt.toml", [*SMALL, "train.steps=4", "logging.log_interval=2",
                                                 "train.eval_interval=4", "train.sample_interval=4",
                                                 f"logging.run_dir={tmp_path}"])
    trainer = Trainer(cfg)
    trainer.fit()
    assert load_config(tmp_path / "config.toml") == cfg
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "eval/loss"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    model = load_weights(tmp_path / "final")
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_a_run_shorter_than_its_intervals_evaluates_samples_and_saves_at_its_last_step(tmp_path, caplog):
    """What getting-started promises of `--set train.steps=...` below the intervals (3 steps, intervals of 100)."""
    cfg = load_config(CONFIGS / "tiny-gpt.toml", [*SMALL, "train.steps=3", "logging.log_interval=100",
                                                 "train.eval_interval=100", "train.eval_batches=1",
                                                 "train.sample_interval=100", "train.sample_tokens=4",
                                                 "checkpoint.interval=100", "logging.tensorboard=false",
                                                 "data.num_workers=0", f"logging.run_dir={tmp_path}"])
    with caplog.at_level("INFO", logger="meshformer"):
        Trainer(cfg).fit()
    lines = [record.getMessage() for record in caplog.records]
    assert [line.split("|")[0].split() for line in lines if line.startswith(("eval ", "sample "))] == \
        [["eval", "3"], ["sample", "3"]], lines
    assert (tmp_path / "checkpoints" / "step-00000003").is_dir()


def _one_step_params(tmp_path, batch_size: int, accum: int, loss: str = "plain") -> dict[str, torch.Tensor]:
    cfg = load_config(CONFIGS / "tiny-gpt.toml", [*SMALL, "train.steps=1", f"data.batch_size={batch_size}",
                                                 f"train.grad_accum={accum}", "data.num_workers=0",
                                                 f"train.loss={loss}", "logging.tensorboard=false",
                                                 f"logging.run_dir={tmp_path}/{batch_size}x{accum}"])
    trainer = Trainer(cfg)
    trainer.train_step()
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("loss,atol", [("plain", 3e-6), ("chunked", 3e-6), ("chunked_recompute", 3e-6)])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, loss, atol):
    # The loader's global sample order does not depend on the batch size, so 2 x 8 sees the same 16 sequences.
    # Last-bit differences, which Adam's first step (update ~ lr * g / |g|) magnifies on near-zero gradients to a
    # few 1e-6: the chunked loss applies the 1/tokens scale after the head GEMMs rather than before, and the CPU
    # attention kernel's batched GEMMs split their sums differently at another batch size (measured: 1.8e-6 above
    # rtol; SDPA 0.4e-6).
    big = _one_step_params(tmp_path / loss, 16, 1, loss)
    accumulated = _one_step_params(tmp_path / loss, 8, 2, loss)
    for name in big:
        torch.testing.assert_close(accumulated[name], big[name], rtol=1e-5, atol=atol, msg=name)


def test_tokenizer_larger_than_model_vocab_is_rejected(tmp_path):
    from meshformer.config import ConfigError

    cfg = load_config(CONFIGS / "tiny-gpt.toml", [*SMALL, "model.vocab_size=1000", f"logging.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="raise model.vocab_size"):
        Trainer(cfg)


def test_logged_learning_rate_mtp_loss_and_pace_are_those_of_the_run(tmp_path, caplog):
    """The learning rate each step used; a dense model's multi-token prediction loss, in the metrics and on the
    console line; the measured seconds per step and the run's projected time, once, at step 10."""
    cfg = load_config(CONFIGS / "tiny-gpt.toml", [*SMALL, "train.steps=12", "logging.log_interval=1",
                                                 "schedule.name=constant", "schedule.warmup_steps=10",
                                                 "optim.lr=1e-2", "logging.tensorboard=false", "data.num_workers=0",
                                                 "checkpoint.interval=0", "model.mtp.depth=1",
                                                 f"logging.run_dir={tmp_path}"])
    caplog.set_level(logging.INFO)
    start = time.perf_counter()
    history = Trainer(cfg).fit().history
    wall = time.perf_counter() - start
    assert [round(h["train/lr"] * 100, 6) for h in history] == [round(0.1 * s, 6) for s in range(1, 11)] + [1.0, 1.0]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == len(history) == 12
    for line, h in zip(lines, history, strict=True):
        assert f"| mtp loss_1 {h['mtp/loss_1']:.4f} |" in line, line
    projected = [(h["step"], h["perf/projected_run_s"]) for h in history if "perf/projected_run_s" in h]
    assert [step for step, _ in projected] == [10]
    pace, run_s = history[9]["perf/pace_s_per_step"], projected[0][1]
    assert lines[9].endswith(f" | ~{pace:.3g} s/step, run ≈ {run_s / 60:.1f} min"), lines[9]
    assert not any("s/step" in line for line in lines[:9] + lines[10:])
    assert run_s == pytest.approx(12 * pace)  # the run's 12 steps at the pace of its first 10
    step_times = [h["perf/step_time_s"] for h in history[:10]]
    assert min(step_times) <= pace <= sum(step_times) / 10 + 0.5 and run_s < 2 * wall


def test_tied_output_bias_starts_at_zero():
    from meshformer.model import Transformer

    model = Transformer(load_config(CONFIGS / "tiny-bert.toml").model)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.count_nonzero(model.output.bias) == 0


def test_sample_clips_the_source_to_the_position_table(tmp_path):
    from meshformer.data import load_tokenizer
    from meshformer.model import Transformer
    from meshformer.train.sampling import decoded_sample

    for config in (CONFIGS / "tiny-bert.toml", CONFIGS / "tiny-t5.toml"):
        cfg = load_config(config, ["model.max_seq_len=8", "data.seq_len=8", "data.target_len=8"])
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        ids = torch.tensor([tokenizer.encode("In the beginning God created the heaven and the earth." * 2)])
        text = decoded_sample(Transformer(cfg.model), tokenizer, cfg, torch.device("cpu"),
                              {"input_ids": ids, "labels": torch.full_like(ids, -100)})
        assert isinstance(text, str) and "->" in text


def test_the_sample_prompt_comes_from_the_data(tmp_path):
    """The prompt is the opening of the first held-out sequence (a foreign corpus gets a foreign prompt), with
    MLM's hidden tokens put back from the labels; never the KJV phrase meshformer once hard-coded."""
    from meshformer.data import load_tokenizer
    from meshformer.model import Transformer
    from meshformer.train.sampling import decoded_sample, prompt_ids

    tokenizer = load_tokenizer("bundled:kjv-bpe-4k")
    words = tokenizer.encode("Der Zug nach Berlin fährt um neun Uhr")
    ids = torch.tensor([[*words, tokenizer.eos_id, *tokenizer.encode("other document")]])
    assert prompt_ids({"input_ids": ids, "labels": ids}, tokenizer) == words
    masked = ids.clone()
    masked[0, 1] = tokenizer.mask_id
    labels = torch.full_like(ids, -100)
    labels[0, 1] = ids[0, 1]
    assert prompt_ids({"input_ids": masked, "labels": labels}, tokenizer) == words
    cfg = load_config(CONFIGS / "tiny-gpt.toml", ["model.d_model=32", "model.n_layers=1", "model.ffn.d_ff=64"])
    text = decoded_sample(Transformer(cfg.model), tokenizer, cfg, torch.device("cpu"), {"input_ids": ids}, max_new=4)
    assert text is not None and text.startswith("Der Zug nach") and "God" not in text


def test_a_nan_step_updates_nothing_and_a_run_of_them_stops_training(tmp_path, monkeypatch):
    from meshformer.errors import DivergenceError
    from meshformer.parallel.parallel_model import ParallelModel

    overrides = [*SMALL, "train.steps=6", "logging.log_interval=1", "logging.tensorboard=false", "data.num_workers=0",
                 "checkpoint.interval=0", "optim.max_nonfinite_in_a_row=2", f"logging.run_dir={tmp_path}"]
    trainer = Trainer(load_config(CONFIGS / "tiny-gpt.toml", overrides))
    poisoned = {2, 4, 5, 6}  # steps whose loss is NaN (1-based): one alone, then three in a row
    forward_backward = ParallelModel.forward_backward

    def nan_loss(plan, batch, global_tokens, last_micro_batch=True):
        if trainer.step + 1 in poisoned:
            global_tokens = global_tokens * float("nan")
        return forward_backward(plan, batch, global_tokens, last_micro_batch)

    monkeypatch.setattr(ParallelModel, "forward_backward", nan_loss)
    weights: dict[int, list[torch.Tensor]] = {}
    logged = []
    trainer.logger.info = logged.append
    real_step = trainer.train_step

    def recorded_step():
        result = real_step()
        weights[trainer.step] = [p.detach().clone() for p in trainer.model.parameters()]
        return result

    trainer.train_step = recorded_step
    with pytest.raises(DivergenceError, match="the last 3 steps \\(up to step 6\\)"):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(weights[1], weights[2]))  # step 2 skipped
    assert not any(torch.equal(a, b) for a, b in zip(weights[2], weights[3]))  # step 3 trained
    assert all(torch.isfinite(p).all() for p in weights[6])
    assert any("1 of the last 1 steps had an inf/nan gradient norm" in line for line in logged)
