"""Each rank reads only its share: bytes read per rank per epoch <= 1.25 x dataset / dp_size."""

from __future__ import annotations

import numpy as np
import pytest
from data_read_volume import planned_bytes, record_spans, shuffle_quality
from helpers.data import config, shards, tokenizer

from meshformer.data import build_loader


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # 25 shards of 40 records: enough shards that a rank's share is not dominated by one group
    return shards(tmp_path_factory.mktemp("volume"), "volume", shard_records=40, n_docs=60)


def test_bytes_per_rank_bound_at_dp_1_2_4_8(data_dir):
    """Measured (bytes the shard reader fetched) for simulated ranks in one process; the plan must match it."""
    epochs = 2
    seen = None
    for dp in (1, 2, 4, 8):
        cfg = config(data_dir)
        loaders = [build_loader(cfg, tokenizer(), "train", r, dp, with_sample_ids=True) for r in range(dp)]
        n = loaders[0].samples_per_epoch
        dataset = sum(s.bytes for s in loaders[0].manifest.splits["train"])
        steps = -(-epochs * n // (4 * dp))  # whole global batches covering two epochs
        ids = [np.concatenate([next(loader)["sample_ids"].numpy() for loader in loaders]) for _ in range(steps)]
        ids = np.concatenate(ids)
        seen = ids if seen is None else seen
        assert np.array_equal(ids[:epochs * n], seen[:epochs * n]), "global order changed with dp_size"
        per_rank = []
        for r, loader in enumerate(loaders):
            per_rank.append(loader.source.nbytes / epochs)
            plan = planned_bytes(loader.order, loader.source.shards, record_spans(loader.manifest, "train"),
                                 r, dp, 4, steps * 4 * dp)
            assert plan == loader.source.nbytes, "the read plan (used for projections) differs from the reader"
        share = dataset / dp
        assert max(per_rank) <= 1.25 * share, f"dp={dp}: a rank read {max(per_rank) / share:.2f}x its share"
        assert min(per_rank) >= 0.75 * share  # the share is really read (not served from somewhere else)


def test_workers_split_a_ranks_reads(data_dir):
    """With DataLoader workers each worker reads only the records of its own batches (plan over workers)."""
    loader = build_loader(config(data_dir), tokenizer(), "train", 0, 2)
    spans = record_spans(loader.manifest, "train")
    n = loader.samples_per_epoch
    one = planned_bytes(loader.order, loader.source.shards, spans, 0, 2, 4, n, num_workers=1)
    four = planned_bytes(loader.order, loader.source.shards, spans, 0, 2, 4, n, num_workers=4)
    assert four <= 1.05 * one


def test_shuffle_quality_measure(data_dir):
    loader = build_loader(config(data_dir), tokenizer(), "train", 0, 1)
    order = loader.order
    n = order.epoch_size
    stream = np.array([order.unit_at(p) for p in range(n)])
    q = shuffle_quality(stream, order.unit_start)
    sequential = shuffle_quality(np.arange(n), order.unit_start)
    assert sequential["same_shard"] > 0.9 and sequential["unit_gap"] < 0.01
    assert q["same_shard"] < 0.6 and q["unit_gap"] > 0.05
