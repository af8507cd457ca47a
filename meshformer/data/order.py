"""The global sample order: one infinite stream of sample ("unit") ids per split, defined by (seed, epoch).

Why this shape: determinism that does not depend on worker count or data-parallel degree needs an order
defined before anyone reads, and exact resume needs that order to be addressable by one integer.

- A *unit* is one training example: window `w` of record `r` of shard `s` (a record holds
  `windows` examples when it is longer than the objective needs). Unit ids count shard by shard in
  manifest order, so they name the same example whoever reads it.
- Epoch e: the shards are permuted with rng(seed, e); consecutive runs of `group_shards` shards
  form a *group*, and the group's units are permuted with rng(seed, e, g). The epoch stream is the
  groups in order; the infinite stream is epoch 0, epoch 1, ...
- Reading: a worker holds at most one group (`group_shards` shards) and reads from it only the records
  of its own batches (ranged reads, shard_index.py), or streams the shards whole where the store cannot
  seek. Mixing is global across documents (prepare's buckets) but only group-local across epochs.
- Batches are cut from the stream without regard to epoch ends: global batch b is positions
  [b*G, (b+1)*G) with G = dp_size * batch_size, and rank r takes [b*G + r*B, b*G + (r+1)*B).
  So every rank gets the same number of batches, every epoch holds every unit exactly once, the
  global sequence is the same for any dp_size, and loader state is one number: positions consumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_SHARD_SALT, _GROUP_SALT = 0x5A4D, 0x6E72


@dataclass(frozen=True)
class Group:
    start: int  # first stream offset of the group within its epoch
    shards: tuple[int, ...]  # shard indices, in reading order
    size: int  # units in the group


class SampleOrder:
    def __init__(self, records_per_shard: list[int], windows: int, seed: int, shuffle: bool, group_shards: int,
                 skip: frozenset[int] = frozenset()) -> None:
        if windows < 1 or group_shards < 1:
            raise ValueError("windows and group_shards must be >= 1")
        self.records = np.asarray(records_per_shard, dtype=np.int64)
        self.windows = windows
        self.seed, self.shuffle, self.group_shards = seed, shuffle, group_shards
        # Unit ids follow the manifest even when shards are skipped, so a sample keeps its id (and its
        # masking) whichever shards are missing.
        self.unit_start = np.concatenate([[0], np.cumsum(self.records * windows)])
        self.units = self.records * windows
        self.units[list(skip)] = 0  # skipped shards hold no units in any epoch
        self.epoch_size = int(self.units.sum())
        if self.epoch_size == 0:
            raise ValueError("the split holds no samples")
        self._epochs: dict[int, tuple[list[Group], np.ndarray]] = {}  # plain dicts: picklable for spawn workers
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _epoch(self, epoch: int) -> tuple[list[Group], np.ndarray]:
        if epoch not in self._epochs:
            if len(self._epochs) >= 4:
                self._epochs.clear()
            self._epochs[epoch] = self._build_epoch(epoch)
        return self._epochs[epoch]

    def _perm(self, epoch: int, g: int) -> np.ndarray:
        if (epoch, g) not in self._perms:
            if len(self._perms) >= 4:
                self._perms.clear()
            self._perms[epoch, g] = self._build_perm(epoch, g)
        return self._perms[epoch, g]

    # -------------------------------------------------------------- epoch layout

    def _build_epoch(self, epoch: int) -> tuple[list[Group], np.ndarray]:
        n = len(self.records)
        rng = np.random.default_rng([self.seed, epoch, _SHARD_SALT])
        shuffled = rng.permutation(n) if self.shuffle else np.arange(n)
        order = [int(s) for s in shuffled if self.units[s] > 0]
        groups, start = [], 0
        for i in range(0, len(order), self.group_shards):
            shards = tuple(order[i:i + self.group_shards])
            size = int(self.units[list(shards)].sum())
            groups.append(Group(start, shards, size))
            start += size
        return groups, np.array([g.start for g in groups], dtype=np.int64)

    def groups(self, epoch: int) -> list[Group]:
        return self._epoch(epoch)[0]

    def _build_perm(self, epoch: int, g: int) -> np.ndarray:
        """Local stream offset within group -> global unit id."""
        group = self.groups(epoch)[g]
        units = np.concatenate([np.arange(self.unit_start[s], self.unit_start[s + 1]) for s in group.shards])
        if self.shuffle:
            units = units[np.random.default_rng([self.seed, epoch, g, _GROUP_SALT]).permutation(len(units))]
        return units

    def locate(self, position: int) -> tuple[int, int]:
        """Stream position -> (epoch, group index)."""
        epoch, offset = divmod(position, self.epoch_size)
        starts = self._epoch(epoch)[1]
        return epoch, int(np.searchsorted(starts, offset, side="right") - 1)

    def group_span(self, epoch: int, g: int) -> tuple[int, int]:
        group = self.groups(epoch)[g]
        base = epoch * self.epoch_size + group.start
        return base, base + group.size

    def units_at(self, epoch: int, g: int, positions: np.ndarray) -> np.ndarray:
        base, _ = self.group_span(epoch, g)
        return self._perm(epoch, g)[positions - base]

    def unit_at(self, position: int) -> int:
        """The unit (record) at one global position: the shuffle-quality measure walks the order with it."""
        epoch, g = self.locate(position)
        return int(self.units_at(epoch, g, np.array([position]))[0])


@dataclass(frozen=True)
class RankView:
    """Which stream positions one (rank, worker) produces, starting from `start` positions consumed globally."""

    start: int
    rank: int
    dp_size: int
    batch_size: int
    worker: int = 0
    num_workers: int = 1

    @property
    def global_batch(self) -> int:
        return self.dp_size * self.batch_size

    def batch_positions(self, j: int) -> np.ndarray:
        """Positions of this rank's j-th batch since `start` (batches j % num_workers == worker are ours)."""
        first = self.start + j * self.global_batch + self.rank * self.batch_size
        return np.arange(first, first + self.batch_size, dtype=np.int64)

    def owns(self, positions: np.ndarray, from_batch: int = 0) -> np.ndarray:
        """Mask of the global `positions` that lie in this (rank, worker)'s batches j >= from_batch: global batch
        j (counted from `start`) belongs to worker j % num_workers, and rank r takes its r-th batch_size slice."""
        p = np.asarray(positions, dtype=np.int64) - self.start
        batch = p // self.global_batch
        return (batch >= from_batch) & (batch % self.num_workers == self.worker) & \
            ((p % self.global_batch) // self.batch_size == self.rank)
