"""Mixtures ([[data.sources]]): weights exact over every window, one global order, exact resume, counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.common import CONFIGS
from helpers.data import config, shards, tokenizer

from meshformer.config import ConfigError, load_config
from meshformer.data import DataStateError, build_loader
from meshformer.data.mixture import Interleave


@pytest.mark.parametrize("weights", [[0.7, 0.3], [5, 3, 2], [0.5, 0.25, 0.25], [1, 1], [0.13, 0.87], [9, 1, 1, 4]])
def test_interleave_stays_within_one_sample_of_the_weights(weights):
    mix = Interleave(weights)
    share = np.array(weights, dtype=float) / sum(weights)
    assert np.allclose(mix.weights / mix.period, share, atol=1e-3)
    positions = np.arange(3 * mix.period + 5)
    src, q = mix.locate(positions)
    counts = np.zeros(len(weights), dtype=np.int64)
    for p, (s, qs) in enumerate(zip(src.tolist(), q.tolist())):
        assert qs == counts[s]  # the source stream advances by one each time it is drawn
        assert mix.positions_of(s, np.array([qs]))[0] == p  # and the map inverts
        counts[s] += 1
        assert np.array_equal(mix.counts(p + 1), counts)
        assert np.all(np.abs(counts - (p + 1) * mix.weights / mix.period) < 1)
    # any window: within one sample of its share; exactly its share when that is a whole number
    for start in range(0, 2 * mix.period):
        for length in (mix.period, 2 * mix.period, 7):
            got = mix.counts(start + length) - mix.counts(start)
            ideal = length * mix.weights / mix.period
            assert np.all(np.abs(got - ideal) < 2)
            if length % mix.period == 0:
                assert np.array_equal(got, ideal.astype(np.int64))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return shards(root, "a"), shards(root, "b", n_docs=6)


def mix_config(sources, *overrides):
    a, b = sources
    return config("", f'data.sources=[{{shards="{a}", weight=0.75, name="a"}}, {{shards="{b}", weight=0.25}}]',
                  *overrides)


def run(cfg, dp: int, steps: int, state=None):
    loaders = [build_loader(cfg, tokenizer(), "train", r, dp, with_sample_ids=True) for r in range(dp)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    src, ids, tokens = [], [], []
    for _ in range(steps):
        for loader in loaders:
            batch = next(loader)
            src.append(batch["source_ids"])
            ids.append(batch["sample_ids"])
            tokens.append(batch["input_ids"])
    return torch.cat(src).numpy(), torch.cat(ids).numpy(), torch.cat(tokens), loaders[0]


def test_weights_exact_per_global_batch_and_order_independent_of_dp(sources):
    ref_src, ref_ids, ref_tok, _ = run(mix_config(sources), 1, 128)
    for batch in ref_src.reshape(-1, 8):  # 8 = 2 global batches of dp=1, or one of dp=2: 0.75 * 8 = 6
        assert np.bincount(batch, minlength=2).tolist() == [6, 2]
    for dp, workers in ((2, 0), (4, 2)):
        src, ids, tok, _ = run(mix_config(sources, f"data.num_workers={workers}"), dp, 80 // dp)
        assert np.array_equal(src, ref_src[:320]) and np.array_equal(ids, ref_ids[:320])
        assert torch.equal(tok, ref_tok[:320])
    # each source runs through its own epochs: every sample of b once before any repeats
    _, _, _, loader = run(mix_config(sources), 1, 1)
    n_b = loader.orders[1].epoch_size
    assert (ref_src == 1).sum() >= n_b
    b_ids = ref_ids[ref_src == 1][:n_b]
    assert sorted(b_ids.tolist()) == list(range(n_b))


def test_resume_with_a_dp_change_continues_the_mixture(sources):
    ref_src, ref_ids, ref_tok, _ = run(mix_config(sources), 1, 60)
    _, _, _, first = run(mix_config(sources), 2, 13)
    state = first.state_dict()
    assert state["consumed"] == 13 * 8
    src, ids, tok, _ = run(mix_config(sources, "data.num_workers=1"), 4, 4, state=state)
    assert np.array_equal(ids, ref_ids[104:104 + 64]) and np.array_equal(src, ref_src[104:104 + 64])
    assert torch.equal(tok, ref_tok[104:104 + 64])
    with pytest.raises(DataStateError, match="another data order"):
        other = build_loader(config(sources[0]), tokenizer(), "train", 0, 1)  # one source is other data
        other.load_state_dict(state)


def test_per_source_token_counts(sources):
    src, _, _, loader = run(mix_config(sources), 1, 25)
    scalars = loader.source_scalars()
    assert scalars["data/a/samples"] == (src == 0).sum() and scalars["data/source1/samples"] == (src == 1).sum()
    assert scalars["data/a/tokens"] == 32 * (src == 0).sum()


def test_mixture_config_errors(sources, tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        build_loader(mix_config(sources, f'data.shards="{sources[0]}"'), tokenizer(), "train", 0, 1)
    with pytest.raises(ConfigError, match="weight > 0"):
        build_loader(config("", 'data.sources=[{shards="x", weight=0}]'), tokenizer(), "train", 0, 1)
    cfg = load_config(None, ["data.sources=[{shards=\"a\", weight=2}]"])
    assert cfg.data.sources[0].weight == 2.0 and load_config(None).data.sources == []
    saved = tmp_path / "mix.toml"
    saved.write_text(mix_config(sources).to_toml())  # [[data.sources]] tables survive the run's saved config
    assert load_config(saved).data.sources == mix_config(sources).data.sources


def test_trainer_logs_tokens_per_source(sources, tmp_path):
    from helpers.common import SMALL

    from meshformer.train.trainer import Trainer

    a, b = sources
    cfg = load_config(CONFIGS / "tiny-gpt.toml", [*SMALL, "train.steps=3", "logging.log_interval=1",
                                                "logging.tensorboard=false", "data.num_workers=0", "data.seq_len=32",
                                                "data.batch_size=4", "checkpoint.interval=0", "model.max_seq_len=64",
                                                f"logging.run_dir={tmp_path}",
                                                f'data.sources=[{{shards="{a}", weight=3, name="web"}}, '
                                                f'{{shards="{b}", weight=1, name="code"}}]'])
    history = Trainer(cfg).fit().history
    assert [h["data/web/tokens"] for h in history] == [3 * 32 * s for s in (1, 2, 3)]  # 3 of every 4 samples
    assert [h["data/code/samples"] for h in history] == [1, 2, 3]
