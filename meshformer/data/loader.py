"""The resumable, rank-balanced loader over a record source (prepared WebDataset shards).

`Loader` is iterable forever. Each rank's torch DataLoader workers produce whole batches: worker w of W
builds this rank's batches j = w, w+W, ... (torch returns them round-robin, so the order does not depend
on W). State is the number of stream positions consumed globally (see order.py), which is why a resume
may change dp_size, batch_size or num_workers and still continue the same global sequence.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from meshformer.errors import MeshformerError

from .objectives import Objective, Sample
from .order import RankView, SampleOrder

_RNG_SALT = 0x4D46


class DataStateError(MeshformerError, ValueError):
    """A loader state that does not belong to this data."""


class Source(Protocol):
    kind: str  # "packed": token records of record_len; "pairs": (src, tgt) token arrays
    record_len: int
    records_per_shard: list[int]  # as in the manifest
    skip: frozenset[int]  # shards left out (bad, with data.bad_shards="skip")
    fingerprint: str  # identifies the data (manifest hash, skipped shards)

    def read(self, shard: int, records: np.ndarray) -> dict[int, Sample]:
        """Records of one shard, by index within the shard (only those asked for need decoding)."""
        ...


class BatchStream(IterableDataset):
    """One rank's batches from stream position `view.start`, split across DataLoader workers."""

    def __init__(self, source: Source, order: SampleOrder, objective: Objective, view: RankView,
                 with_ids: bool = False) -> None:
        self.source, self.order, self.objective, self.view, self.with_ids = source, order, objective, view, with_ids
        self.window = objective.raw_length if source.kind == "packed" else 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        view = replace(self.view, worker=info.id, num_workers=info.num_workers) if info else self.view
        group_key, cache = None, {}
        j = view.worker
        while True:
            positions = view.batch_positions(j)
            samples, units, rngs = [], [], []
            for p in positions.tolist():
                epoch, g = self.order.locate(p)
                if (epoch, g) != group_key:
                    cache = self._load_group(view, j, epoch, g)
                    group_key = (epoch, g)
                unit = int(self.order.units_at(epoch, g, np.array([p]))[0])
                samples.append(cache[unit])
                units.append(unit)
                if self.objective.needs_rng:
                    rngs.append(np.random.default_rng([self.order.seed, epoch, unit, _RNG_SALT]))
            batch = self.objective.collate(samples, rngs if self.objective.needs_rng else None)
            if self.with_ids:
                batch["sample_ids"] = torch.tensor(units, dtype=torch.long)
            yield batch
            j += view.num_workers

    def _load_group(self, view: RankView, j: int, epoch: int, g: int) -> dict[int, Sample]:
        """Read the group's shards front to back, keeping only the units this worker will use."""
        lo, hi = self.order.group_span(epoch, g)
        units = self.order.units_at(epoch, g, view.positions_in(j, lo, hi))
        out: dict[int, Sample] = {}
        for shard in self.order.groups(epoch)[g].shards:
            first = int(self.order.unit_start[shard])
            mine = units[(units >= first) & (units < int(self.order.unit_start[shard + 1]))]
            records, windows = np.divmod(mine - first, self.order.windows)
            if not len(mine):
                continue
            got = self.source.read(shard, np.unique(records))
            for unit, rec, win in zip(mine.tolist(), records.tolist(), windows.tolist()):
                sample = got[rec]
                if self.window:  # packed record -> the unit's window
                    sample = sample[win * self.window:(win + 1) * self.window].astype(np.int64)
                out[unit] = sample
        return out


class Loader:
    """Infinite batches for one data-parallel rank, with exact `state_dict()`/`load_state_dict()`.

    Train split: iteration continues from the consumed count (use `next(loader)` or one `for` loop).
    Eval split: unshuffled, and every `iter(loader)` restarts at position 0 so evals see the same batches.
    """

    def __init__(self, source: Source, objective: Objective, split: str, dp_rank: int, dp_size: int,
                 batch_size: int, num_workers: int, seed: int, shuffle_shards: int, with_ids: bool = False) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        self.source, self.objective, self.split = source, objective, split
        self.dp_rank, self.dp_size, self.batch_size, self.num_workers = dp_rank, dp_size, batch_size, num_workers
        windows = source.record_len // objective.raw_length if source.kind == "packed" else 1
        self.order = SampleOrder(source.records_per_shard, windows, seed, shuffle=split == "train",
                                 group_shards=shuffle_shards, skip=source.skip)
        self.with_ids = with_ids
        self.consumed = 0  # stream positions consumed by all ranks together
        self.skipped_shards: list[str] = []  # bad shards left out (data.bad_shards="skip")
        self.manifest: Any = None  # the shards' Manifest, set by build_loader
        self._it: Iterator[dict[str, torch.Tensor]] | None = None
        spec = {"data": source.fingerprint, "objective": objective.name, "raw": objective.raw_length,
                "split": split, "seed": seed, "shuffle_shards": shuffle_shards}
        self.fingerprint = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def samples_per_epoch(self) -> int:
        return self.order.epoch_size

    @property
    def epoch(self) -> int:
        return self.consumed // self.order.epoch_size

    @property
    def global_batch(self) -> int:
        return self.dp_size * self.batch_size

    def __iter__(self) -> Loader:
        if self.split == "eval":
            self.consumed = 0
            self.close()
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._it = self._start()
        batch = next(self._it)
        self.consumed += self.global_batch
        return batch

    def _start(self) -> Iterator[dict[str, torch.Tensor]]:
        # The loader owns the torch iterator directly (no generator holding `self`), so dropping the loader
        # shuts its workers down at once instead of at a later garbage collection with queues half torn down.
        view = RankView(self.consumed, self.dp_rank, self.dp_size, self.batch_size)
        stream = BatchStream(self.source, self.order, self.objective, view, self.with_ids)
        workers: dict[str, Any] = {"num_workers": self.num_workers}
        if self.num_workers:
            workers.update(prefetch_factor=4, persistent_workers=False)
        # A private generator: seeding workers from the global RNG would shift dropout after a resume.
        return iter(DataLoader(stream, batch_size=None, pin_memory=torch.cuda.is_available(),
                               generator=torch.Generator(), **workers))

    def close(self) -> None:
        """Stop worker processes (they restart from the current position on the next batch)."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "consumed": self.consumed, "epoch": self.epoch,
                "samples_per_epoch": self.samples_per_epoch, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise DataStateError(
                f"data loader state was saved for different data or settings (fingerprint "
                f"{state.get('fingerprint')} != {self.fingerprint}: corpus, shards, tokenizer, objective, "
                "seq_len, seed or shuffle_shards changed); resuming would not be exact. Restore those settings, "
                "or drop the data state to restart the data stream")
        self.consumed = int(state["consumed"])
        self.close()  # the next batch is built from the restored position
