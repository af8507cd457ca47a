"""Mixtures: several prepared datasets, each with a weight, as one exact, resumable stream.

The global stream position p names a source and a position in that source's own stream (its SampleOrder,
with its own epochs). Which source: a smooth weighted round-robin over integer weights w_s (sum W), the same
for any dp_size or worker count. It is periodic in W, so the source of p and how many samples each source
has had before p are O(1) table lookups (exact resume from the one integer, as for a single dataset), and
it stays within one sample of the ideal count p * w_s / W for every p and source, so any window of positions
holds each source's share to within one sample (exactly, where the window's share is a whole number).
"""

from __future__ import annotations

import hashlib
import json
import math
from fractions import Fraction

import numpy as np
import torch
from torch.utils.data import IterableDataset

from meshformer.errors import ConfigError

from .loader import _RNG_SALT, BatchStream, Loader, Source
from .objectives import Objective
from .order import RankView, SampleOrder

_MAX_PERIOD = 1 << 20


def integer_weights(weights: list[float]) -> list[int]:
    """The whole numbers the round-robin mixes by, in the ratio of `weights` (each to 1/1000). Refused in one line:
    a weight that is not a finite positive number, or one these numbers cannot carry (a source would get too few
    samples, or none: 0.0001 next to 1), or ratios whose period is too long."""
    if not weights:
        raise ConfigError("data.sources is empty", "list at least one [[data.sources]] table, or set data.shards")
    for i, w in enumerate(weights):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
            raise ConfigError(f"data.sources[{i}].weight={w} is not a positive number",
                              "give every source a finite weight > 0 (its share is weight / sum of weights)")
    fracs = [Fraction(w).limit_denominator(1000) for w in weights]
    scale = math.lcm(*(f.denominator for f in fracs))
    ints = [int(f * scale) for f in fracs]
    g = math.gcd(*ints)
    ints = [i // g for i in ints] if g else ints
    total, period = sum(weights), sum(ints)
    for i, (w, n) in enumerate(zip(weights, ints)):
        if abs(n / period - w / total) > 0.01 * (w / total):  # the source would not get its share
            raise ConfigError(f"data.sources[{i}].weight={w} cannot be mixed in at its share next to the other "
                              f"weights {weights} (weights count in steps of 0.001)", "scale the weights up, e.g. "
                              "10000 and 1 rather than 1 and 0.0001")
    if period > _MAX_PERIOD:
        raise ConfigError(f"the mixture weights {weights} repeat only every {period:.3g} samples",
                          "use simpler ratios (e.g. 0.7/0.3 or 5/3/2)")
    return ints


def check_mixture(weights: list[float], names: list[str]) -> None:
    """Refuse, before any work, weights the mixture cannot follow and two sources of one name (their sample
    counts would be logged as one)."""
    integer_weights(weights)
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"data.sources[{names.index(name)}] and data.sources[{i}] are both named {name!r}",
                              "give each source its own name (it labels the source's counts in the logs)")


class Interleave:
    """Source of each stream position (smooth weighted round-robin), and its inverse."""

    def __init__(self, weights: list[float]) -> None:
        ints = integer_weights(weights)
        self.weights = np.array(ints, dtype=np.int64)
        self.period = int(self.weights.sum())
        current = np.zeros(len(ints), dtype=np.int64)
        self.source = np.empty(self.period, dtype=np.int64)
        for p in range(self.period):
            current += self.weights
            s = int(np.argmax(current))  # largest deficit; ties go to the first source
            current[s] -= self.period
            self.source[p] = s
        # before[s, r]: samples of source s among the first r positions of a period
        self.before = np.zeros((len(ints), self.period + 1), dtype=np.int64)
        for s in range(len(ints)):
            self.before[s, 1:] = np.cumsum(self.source == s)
        self.slots = [np.flatnonzero(self.source == s) for s in range(len(ints))]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global positions -> (source, position within that source's stream)."""
        k, r = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        src = self.source[r]
        return src, k * self.weights[src] + self.before[src, r]

    def positions_of(self, s: int, q: np.ndarray) -> np.ndarray:
        """Positions within source s's stream -> global positions."""
        k, r = np.divmod(np.asarray(q, dtype=np.int64), self.weights[s])
        return k * self.period + self.slots[s][r]

    def counts(self, position: int) -> np.ndarray:
        """Samples each source contributed to global positions [0, position)."""
        k, r = divmod(position, self.period)
        return k * self.weights + self.before[:, r]


class MixtureStream(BatchStream):
    """One rank's batches of the mixture from `view.start`: BatchStream's loop, positions placed by `mix`."""

    def __init__(self, sources: list[Source], orders: list[SampleOrder], mix: Interleave, objective: Objective,
                 view: RankView, seed: int, with_ids: bool = False) -> None:
        super().__init__(sources, orders, objective, view, with_ids)
        self.mix, self.seed = mix, seed

    def _locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.mix.locate(positions)

    def _positions_of(self, s: int, q: np.ndarray) -> np.ndarray:
        return self.mix.positions_of(s, q)

    def _rng_key(self, s: int, epoch: int, unit: int) -> list[int]:
        return [self.seed, s, epoch, unit, _RNG_SALT]

    def _ids(self, units: list[int], src: np.ndarray) -> dict[str, torch.Tensor]:
        return {**super()._ids(units, src), "source_ids": torch.from_numpy(src)}


class MixtureLoader(Loader):
    """A `Loader` over several sources mixed by weight; state is still the positions consumed globally."""

    def __init__(self, sources: list[Source], names: list[str], weights: list[float], objective: Objective,
                 split: str, dp_rank: int, dp_size: int, batch_size: int, num_workers: int, seed: int,
                 shuffle_shards: int, with_ids: bool = False, reseed_on_resume: bool = False) -> None:
        super().__init__(sources[0], objective, split, dp_rank, dp_size, batch_size, num_workers, seed,
                         shuffle_shards, with_ids, reseed_on_resume)
        self.sources, self.names, self.mix = sources, names, Interleave(weights)
        self.orders = []
        for i, source in enumerate(sources):
            windows = source.record_len // objective.raw_length if source.record_type == "packed" else 1
            self.orders.append(SampleOrder(source.records_per_shard, windows, seed + 7919 * i,
                                           shuffle=split == "train", group_shards=shuffle_shards, skip=source.skip))
        self.settings = {"data": [s.fingerprint for s in sources], "weights": self.mix.weights.tolist(),
                         "names": names, "objective": objective.name, "raw": objective.raw_length, "split": split,
                         "seed": seed, "shuffle_shards": shuffle_shards}
        self.fingerprint = hashlib.sha256(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def samples_per_epoch(self) -> int:
        """Positions until every source has been through at least one epoch."""
        return max(math.ceil(o.epoch_size * self.mix.period / int(w)) for o, w in zip(self.orders, self.mix.weights))

    def source_scalars(self) -> dict[str, float]:
        """Samples and tokens each source has contributed to the global stream so far (all ranks together)."""
        counts = self.mix.counts(self.consumed)
        out: dict[str, float] = {}
        for name, n, source in zip(self.names, counts.tolist(), self.sources):
            out[f"data/{name}/samples"] = float(n)
            if source.record_type == "packed":
                out[f"data/{name}/tokens"] = float(n * self.objective.seq_len)
        return out

    def _stream(self, view: RankView) -> IterableDataset:
        return MixtureStream(self.sources, self.orders, self.mix, self.objective, view, self.seed, self.with_ids)
