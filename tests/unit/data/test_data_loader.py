"""Global order, rank balance and exact resume of the streaming loader (meshformer.data.build_loader)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.data import config, shards, tokenizer

from meshformer.data import DataStateError, build_loader
from meshformer.data.shards import read_shard


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return shards(tmp_path_factory.mktemp("loader"))


def global_stream(data_dir, dp: int, workers: int, steps: int, state=None, overrides=()):
    """Run `steps` synchronous steps on dp ranks; return (global sample ids, global input_ids, final states)."""
    cfg = config(data_dir, f"data.num_workers={workers}", *overrides)
    loaders = [build_loader(cfg, tokenizer(), "train", r, dp, with_sample_ids=True) for r in range(dp)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    ids, tokens = [], []
    for _ in range(steps):
        for loader in loaders:  # rank order within a global batch
            batch = next(loader)
            assert batch["input_ids"].shape == (cfg.data.batch_size, cfg.data.seq_len)
            ids.append(batch["sample_ids"])
            tokens.append(batch["input_ids"])
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), "ranks disagree on loader state"
    return torch.cat(ids).numpy(), torch.cat(tokens), states[0], loaders[0].samples_per_epoch


@pytest.fixture(scope="module")
def reference(data_dir):
    """dp=1, no workers, two full epochs and a bit: the stream every other layout must reproduce."""
    n = build_loader(config(data_dir), tokenizer(), "train", 0, 1).samples_per_epoch
    steps = math.ceil(2 * n / 4) + 3
    ids, tokens, _, _ = global_stream(data_dir, 1, 0, steps)
    return ids, tokens, n


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_every_sample_once_per_epoch_and_same_global_order(data_dir, reference, dp, workers):
    ref_ids, ref_tokens, n = reference
    steps = math.ceil(2 * n / (4 * dp))  # two epochs, rounded up to whole global batches
    ids, tokens, _, epoch_size = global_stream(data_dir, dp, workers, steps)
    assert epoch_size == n == 264  # uneven shards: 6 x 41 + 18
    for epoch in range(2):
        seen = ids[epoch * n:(epoch + 1) * n]
        assert sorted(seen.tolist()) == list(range(n)), f"epoch {epoch} is not a permutation of all samples"
    assert np.array_equal(ids, ref_ids[:len(ids)]), "global order depends on dp size / worker count"
    assert torch.equal(tokens, ref_tokens[:len(tokens)])


def test_epochs_are_reshuffled(reference):
    ids, _, n = reference
    assert not np.array_equal(ids[:n], ids[n:2 * n])
    # the shuffle crosses shards: the first 41 samples do not all come from one shard
    assert len(set((ids[:41] // 41).tolist())) > 1


@pytest.mark.parametrize(("dp_before", "dp_after", "workers"), [(2, 2, 2), (2, 4, 1), (4, 1, 0), (1, 2, 2)])
def test_resume_equals_uninterrupted(data_dir, reference, dp_before, dp_after, workers):
    ref_ids, ref_tokens, n = reference
    steps_before = 37 // dp_before  # stop mid-epoch (and past prefetched, unconsumed worker batches)
    ids1, tok1, state, _ = global_stream(data_dir, dp_before, workers, steps_before)
    assert state["consumed"] == steps_before * 4 * dp_before
    ids2, tok2, _, _ = global_stream(data_dir, dp_after, workers, math.ceil(n / (4 * dp_after)), state=state)
    ids = np.concatenate([ids1, ids2])
    assert np.array_equal(ids, ref_ids[:len(ids)]), "resume skipped or repeated samples"
    assert torch.equal(torch.cat([tok1, tok2]), ref_tokens[:len(ids)])


def test_resume_across_epoch_boundary_with_mlm(data_dir):
    # mlm randomness is keyed by (seed, epoch, sample), so a resumed run masks identically
    ids, tokens, _, n = global_stream(data_dir, 2, 1, 40, overrides=['train.objective="mlm"', 'model.family="encoder"'])
    _, _, state, _ = global_stream(data_dir, 4, 0, 15, overrides=['train.objective="mlm"', 'model.family="encoder"'])
    assert 4 * 15 * 4 < n < 40 * 8  # the resumed part crosses into epoch 1
    ids2, tok2, _, _ = global_stream(data_dir, 1, 2, 20, state=state,
                                     overrides=['train.objective="mlm"', 'model.family="encoder"'])
    assert np.array_equal(ids2, ids[240:]) and torch.equal(tok2, tokens[240:])


def test_state_from_other_data_is_refused(data_dir):
    loader = build_loader(config(data_dir), tokenizer(), "train", 0, 1)
    next(loader)
    other = build_loader(config(data_dir, "data.seed=99"), tokenizer(), "train", 0, 1)
    with pytest.raises(DataStateError, match=r"data.seed|seed"):
        other.load_state_dict(loader.state_dict())


def test_eval_split_is_fixed_and_restarts(data_dir):
    cfg = config(data_dir)
    loader = build_loader(cfg, tokenizer(), "eval", 0, 1, with_sample_ids=True)
    first = [b["sample_ids"] for _, b in zip(range(3), loader)]
    again = [b["sample_ids"] for _, b in zip(range(3), loader)]
    assert torch.equal(torch.cat(first), torch.cat(again))
    assert torch.cat(first).tolist() == list(range(12))  # eval is read in order
    train = build_loader(cfg, tokenizer(), "train", 0, 1)
    assert loader.samples_per_epoch == 20 and train.samples_per_epoch == 264


def test_dp_rank_out_of_range(data_dir):
    with pytest.raises(ValueError, match="dp_rank"):
        build_loader(config(data_dir), tokenizer(), "train", 2, 2)


def test_long_records_are_cut_into_windows(tmp_path_factory):
    long_dir = shards(tmp_path_factory.mktemp("long"), "long", record_len=70, shard_records=23)
    loaders = [build_loader(config(long_dir, "data.num_workers=1"), tokenizer(), "train", r, 2, with_sample_ids=True)
               for r in range(2)]
    n = loaders[0].samples_per_epoch
    records = sum(s.samples for s in loaders[0].manifest.splits["train"])
    assert n == 2 * records  # 70-token records hold two 33-token causal windows
    ids = [i for _ in range(math.ceil(n / 8)) for loader in loaders for i in next(loader)["sample_ids"].tolist()]
    assert sorted(ids[:n]) == list(range(n))
    # eval is unshuffled: units 0 and 1 are tokens [0, 33) and [33, 66) of the first eval record
    manifest = loaders[0].manifest
    info = manifest.splits["eval"][0]
    tokens = read_shard(manifest.shard_url(info), info, manifest.dtype, {0})[0]["tokens"]
    record = torch.from_numpy(tokens.astype("int64"))
    batch = next(iter(build_loader(config(long_dir), tokenizer(), "eval", 0, 1, with_sample_ids=True)))
    assert batch["sample_ids"].tolist() == [0, 1, 2, 3]
    assert torch.equal(batch["input_ids"][0], record[:32]) and torch.equal(batch["labels"][0], record[1:33])
    assert torch.equal(batch["input_ids"][1], record[33:65]) and torch.equal(batch["labels"][1], record[34:66])


def test_a_process_exits_with_a_loader_whose_workers_are_still_running(data_dir, tmp_path):
    """Workers ignore stop signals (the rank acts on them), so multiprocessing's exit handler (SIGTERM, then join)
    cannot end them: a process that exits while a loader still holds running workers must not wait for them."""
    import subprocess
    import sys

    from helpers.common import ROOT

    script = tmp_path / "open_loader.py"
    script.write_text(
        "import atexit, sys, time\n"
        # an exit handler registered before the loader runs after the loader's: it must not see a worker's death
        "atexit.register(lambda: [time.sleep(0.01) for _ in range(100)])\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from helpers.data import config, tokenizer\n"
        "from meshformer.data import build_loader\n"
        f"loader = build_loader(config({str(data_dir)!r}, 'data.num_workers=2'), tokenizer(), 'train', 0, 1)\n"
        "next(loader)\n"
        "print('batch read', flush=True)\n")  # the loader stays open: its workers run when the interpreter exits
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "batch read" in done.stdout, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr[-2000:]


def test_closing_a_loader_ends_a_worker_that_is_slow_to_stop(data_dir, monkeypatch):
    """torch waits a moment for each worker to take its sentinel, then sends SIGTERM, which workers ignore (stop
    signals are the rank's): a worker busy past that wait must still end, not outlive its loader."""
    import time

    from torch.utils.data import _utils

    from meshformer.data import loader as loader_module

    stream = loader_module.BatchStream.__iter__

    def busy_after_one_batch(self):  # the workers (forked after this patch) never reach their sentinel
        yield next(stream(self))
        time.sleep(600)

    monkeypatch.setattr(loader_module.BatchStream, "__iter__", busy_after_one_batch)
    loader = build_loader(config(data_dir, "data.num_workers=2"), tokenizer(), "train", 0, 1)
    next(loader)
    workers = list(loader._it._workers)
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.1)  # torch's wait before its SIGTERM, shortened
    loader.close()
    for worker in workers:
        worker.join(timeout=20)
    assert not any(w.is_alive() for w in workers)
