"""The resumable, rank-balanced loader over a record source (prepared WebDataset shards).

`Loader` is iterable forever. Each rank's torch DataLoader workers produce whole batches: worker w of W
builds this rank's batches j = w, w+W, ... (torch returns them round-robin, so the order does not depend
on W). State is the number of stream positions consumed globally (see order.py), which is why a resume
may change dp_size, batch_size or num_workers and still continue the same global sequence.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import multiprocessing
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from meshformer.errors import STOP_SIGNALS, ConfigError

from .objectives import Objective, Sample
from .order import RankView, SampleOrder

_RNG_SALT = 0x4D46
_log = logging.getLogger("meshformer.data")


class DataStateError(ConfigError):
    """A loader state that does not belong to this data (a ConfigError: the fix is a setting)."""


class Source(Protocol):
    record_type: str  # "packed": token records of record_len; "pairs": (src, tgt) token arrays
    record_len: int
    records_per_shard: list[int]  # as in the manifest
    skip: frozenset[int]  # shards left out (bad, with data.bad_shards="skip")
    fingerprint: str  # identifies the data (manifest hash, skipped shards)

    def read(self, shard: int, records: np.ndarray) -> dict[int, Sample]:
        """Records of one shard, by index within the shard (only those asked for need decoding)."""
        ...


class BatchStream(IterableDataset):
    """One rank's batches from stream position `view.start`, split across DataLoader workers.

    One loop for a single source and for mixtures: a mixture (MixtureStream) overrides how a stream position
    maps to (source, position in that source's own stream) and back, each sample's rng key, and the ids."""

    def __init__(self, sources: list[Source], orders: list[SampleOrder], objective: Objective, view: RankView,
                 with_ids: bool = False) -> None:
        self.sources, self.orders, self.objective, self.view, self.with_ids = sources, orders, objective, view, with_ids
        self.windows = [objective.raw_length if s.record_type == "packed" else 0 for s in sources]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        view = replace(self.view, worker=info.id, num_workers=info.num_workers) if info else self.view
        keys: dict[int, tuple[int, int]] = {}  # per source: the (epoch, group) held in caches
        caches: dict[int, dict[int, Sample]] = {}
        j = view.worker
        while True:
            src, q = self._locate(view.batch_positions(j))
            samples, units, rngs = [], [], []
            for s, qs in zip(src.tolist(), q.tolist()):
                order = self.orders[s]
                epoch, g = order.locate(qs)
                if keys.get(s) != (epoch, g):
                    caches[s] = self._load_group(s, view, j, epoch, g)
                    keys[s] = (epoch, g)
                unit = int(order.units_at(epoch, g, np.array([qs]))[0])
                samples.append(caches[s][unit])
                units.append(unit)
                if self.objective.needs_rng:
                    rngs.append(np.random.default_rng(self._rng_key(s, epoch, unit)))
            batch = self.objective.collate(samples, rngs if self.objective.needs_rng else None)
            if self.with_ids:
                batch.update(self._ids(units, src))
            yield batch
            j += view.num_workers

    def _locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions -> (source, position within that source's stream)."""
        return np.zeros(len(positions), dtype=np.int64), positions

    def _positions_of(self, s: int, q: np.ndarray) -> np.ndarray:
        """Positions within source s's stream -> stream positions (the inverse of `_locate`)."""
        return q

    def _rng_key(self, s: int, epoch: int, unit: int) -> list[int]:
        return [self.orders[s].seed, epoch, unit, _RNG_SALT]

    def _ids(self, units: list[int], src: np.ndarray) -> dict[str, torch.Tensor]:
        return {"sample_ids": torch.tensor(units, dtype=torch.long)}

    def _load_group(self, s: int, view: RankView, j: int, epoch: int, g: int) -> dict[int, Sample]:
        """Source s's units in the group that this worker will use (its batches j, j + num_workers, ...)."""
        order = self.orders[s]
        lo, hi = order.group_span(epoch, g)
        q = np.arange(lo, hi, dtype=np.int64)
        units = order.units_at(epoch, g, q[view.owns(self._positions_of(s, q), j)])
        return read_units(self.sources[s], order, order.groups(epoch)[g].shards, units, self.windows[s])


def read_units(source: Source, order: SampleOrder, shards: tuple[int, ...], units: np.ndarray,
               window: int) -> dict[int, Sample]:
    """Unit id -> sample for `units` of a group, reading from each shard only the records they lie in."""
    out: dict[int, Sample] = {}
    for shard in shards:
        first = int(order.unit_start[shard])
        mine = units[(units >= first) & (units < int(order.unit_start[shard + 1]))]
        records, windows = np.divmod(mine - first, order.windows)
        if not len(mine):
            continue
        got = source.read(shard, np.unique(records))
        for unit, rec, win in zip(mine.tolist(), records.tolist(), windows.tolist()):
            sample = got[rec]
            if window:  # packed record -> the unit's window
                assert isinstance(sample, np.ndarray)  # packed shards hold token arrays, not pairs
                sample = sample[win * window:(win + 1) * window].astype(np.int64)
            out[unit] = sample
    return out


class Loader:
    """Infinite batches for one data-parallel rank, with exact `state_dict()`/`load_state_dict()`.

    Train split: iteration continues from the consumed count (use `next(loader)` or one `for` loop).
    Eval split: unshuffled, and every `iter(loader)` restarts at position 0 so evals see the same batches.
    """

    def __init__(self, source: Source, objective: Objective, split: str, dp_rank: int, dp_size: int,
                 batch_size: int, num_workers: int, seed: int, shuffle_shards: int, with_ids: bool = False,
                 reseed_on_resume: bool = False) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        self.source, self.objective, self.split = source, objective, split
        self.dp_rank, self.dp_size, self.batch_size, self.num_workers = dp_rank, dp_size, batch_size, num_workers
        windows = source.record_len // objective.raw_length if source.record_type == "packed" else 1
        self.order = SampleOrder(source.records_per_shard, windows, seed, shuffle=split == "train",
                                 group_shards=shuffle_shards, skip=source.skip)
        self.with_ids, self.seed, self.reseed_on_resume = with_ids, seed, reseed_on_resume
        self.consumed = 0  # stream positions consumed by all ranks together
        self.skipped_shards: list[str] = []  # bad shards left out (data.bad_shards="skip")
        self.manifest: Any = None  # the shards' Manifest, set by build_loader
        self._it: Iterator[dict[str, torch.Tensor]] | None = None
        self.settings = {"data": source.fingerprint, "objective": objective.name, "raw": objective.raw_length,
                         "split": split, "seed": seed, "shuffle_shards": shuffle_shards}
        self.fingerprint = hashlib.sha256(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:16]

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
        stream = self._stream(RankView(self.consumed, self.dp_rank, self.dp_size, self.batch_size))
        workers: dict[str, Any] = {"num_workers": self.num_workers}
        if self.num_workers:
            workers.update(prefetch_factor=4, persistent_workers=False, worker_init_fn=_ignore_stop_signals)
        # A private generator: seeding workers from the global RNG would shift dropout after a resume.
        it = iter(DataLoader(stream, batch_size=None, pin_memory=torch.cuda.is_available(),
                             generator=torch.Generator(), **workers))
        if self.num_workers:
            _killed_at_exit(getattr(it, "_workers", []))
        return it

    def _stream(self, view: RankView) -> IterableDataset:
        return BatchStream([self.source], [self.order], self.objective, view, self.with_ids)

    def source_scalars(self) -> dict[str, float]:
        """Per-source sample/token counts for logging (mixtures only)."""
        return {}

    def close(self) -> None:
        """Stop worker processes (they restart from the current position on the next batch)."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()  # the workers' sentinel; one still busy after torch's wait gets SIGTERM ...
            for worker in getattr(it, "_workers", []):
                if worker.is_alive():
                    worker.kill()  # ... which it ignores (below)

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "consumed": self.consumed, "epoch": self.epoch,
                "samples_per_epoch": self.samples_per_epoch, "fingerprint": self.fingerprint,
                "settings": self.settings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from the saved position. When the order changed (data.seed, data.shuffle_shards, the shards)
        this is refused, or with data.reseed_on_resume=true the saved sample count is kept and the order of the
        current settings continues from that position (see README.md, "Changing the order on resume")."""
        if state.get("fingerprint") != self.fingerprint:
            changed = self._changed_settings(state.get("settings"))
            if not self.reseed_on_resume:
                raise DataStateError(
                    f"the checkpoint's data position was saved for another data order ({changed}) — restore "
                    "those settings for an exact resume, or set data.reseed_on_resume=true to keep its position "
                    f"({int(state['consumed'])} samples consumed) and continue the order of the current settings")
            _log.warning("data: data.reseed_on_resume=true and the data order changed (%s): continuing the new order "
                         "at sample %d (epoch %d); samples of the current epoch may repeat or be left out",
                         changed, int(state["consumed"]), int(state["consumed"]) // self.samples_per_epoch)
        self.consumed = int(state["consumed"])
        self.close()  # the next batch is built from the restored position

    def _changed_settings(self, saved: dict[str, Any] | None) -> str:
        names = {"data": "the shards (data.corpus/data.shards, the tokenizer, or data.seed when the corpus is "
                         "prepared automatically)", "objective": "train.objective", "raw": "data.seq_len",
                 "seed": "data.seed", "shuffle_shards": "data.shuffle_shards", "split": "the split"}
        if not saved:
            return ("corpus, shards, tokenizer, objective, seq_len, data.seed or data.shuffle_shards; the checkpoint "
                    "does not record which")
        names |= {"weights": "the mixture weights", "names": "the mixture's source names"}
        return ", ".join(f"{names[k]}: {saved.get(k)!r} -> {v!r}" if k in ("objective", "raw", "seed",
                                                                         "shuffle_shards") else names[k]
                         for k, v in self.settings.items() if saved.get(k) != v)


# The process ids of every worker this process started (see _kill_workers_at_exit).
_WORKER_PIDS: set[int] = set()


def _killed_at_exit(workers: list[Any]) -> None:
    if not _WORKER_PIDS:  # atexit runs last-registered first: before multiprocessing's own exit handler
        atexit.unregister(_kill_workers_at_exit)
        atexit.register(_kill_workers_at_exit)
    _WORKER_PIDS.update(w.pid for w in workers)


def _kill_workers_at_exit() -> None:
    """Workers ignore SIGTERM (below), so multiprocessing's exit handler, which terminates its children with SIGTERM
    and then joins them, would wait forever for a worker still running when the process exits: one of a loader still
    open (a library user's, a test's), or one that was busy when its loader shut down. Kill them first."""
    workers = [child for child in multiprocessing.active_children() if child.pid in _WORKER_PIDS]
    if not workers:
        return
    if threading.current_thread() is threading.main_thread():
        # torch's SIGCHLD handler raises "DataLoader worker ... is killed by signal" for an open loader's workers,
        # into whatever exit handler runs next: at exit their death is intended
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in workers:
        child.kill()
    for child in workers:
        child.join(5)


def _ignore_stop_signals(worker_id: int) -> None:
    """A stop signal sent to the whole process group is the rank's to act on (it saves, then shuts its workers
    down); a worker that died of it would fail the rank's last steps instead."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
