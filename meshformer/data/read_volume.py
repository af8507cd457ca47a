"""Read volume and shuffle quality of the sample order (bench/data_read_volume.py, tests).

`planned_bytes(order, shards, ...)` is what one rank's ranged reads fetch over a span of stream positions:
the byte span of every record it uses plus that record's 32-byte index entry, each record once per shard
group (a group is loaded once per worker). It needs no data, so it projects to any dp_size.
"""

from __future__ import annotations

import numpy as np

from .order import RankView, SampleOrder
from .shard_index import ENTRY, index_name
from .shards import Manifest, ShardInfo


def record_spans(manifest: Manifest, split: str) -> list[np.ndarray]:
    """Bytes of each record's span, per shard, from the local index files."""
    return [np.fromfile(index_name(manifest.shard_url(s)), dtype=ENTRY)["length"].astype(np.int64)
            for s in manifest.splits[split]]


def planned_bytes(order: SampleOrder, shards: list[ShardInfo], spans: list[np.ndarray], rank: int, dp_size: int,
                  batch_size: int, positions: int, num_workers: int = 1, ranged: bool = True) -> int:
    """Bytes rank `rank` reads for global stream positions [0, positions) (a whole number of global batches).

    ranged=False: the streaming fallback (`pipe:`, http, shards without index), which reads every shard that
    holds any record the worker needs, front to back."""
    total = 0
    touched = sorted({order.locate(p) for p in range(positions)})
    for worker in range(num_workers):
        view = RankView(0, rank, dp_size, batch_size, worker, num_workers)
        for epoch, g in touched:  # a worker loads its share of a whole group when it first needs the group
            lo, hi = order.group_span(epoch, g)
            p = np.arange(lo, hi, dtype=np.int64)
            mine = p[view.owns(p)]
            if not len(mine) or mine[0] >= positions:
                continue
            units = order.units_at(epoch, g, mine)
            shard = np.searchsorted(order.unit_start, units, side="right") - 1
            record = (units - order.unit_start[shard]) // order.windows
            for s in np.unique(shard):
                records = np.unique(record[shard == s])
                whole = len(records) == shards[s].samples or not ranged  # streamed whole instead
                total += shards[s].bytes if whole else int(spans[s][records].sum()) + len(records) * ENTRY.itemsize
    return total


def shuffle_quality(unit_ids: np.ndarray, unit_start: np.ndarray) -> dict:
    """How well consecutive samples of a stream are mixed.

    same_shard: fraction of adjacent pairs drawn from the same shard (lower is better; about
    1/len(shards) for a perfect shuffle over all shards). unit_gap: mean |id_a - id_b| / epoch size of adjacent
    samples, where ids count in prepare's output order (1/3 for a perfect shuffle, 0 for sequential reading).
    """
    shard = np.searchsorted(unit_start, unit_ids, side="right") - 1
    return {"same_shard": float(np.mean(shard[1:] == shard[:-1])),
            "unit_gap": float(np.mean(np.abs(np.diff(unit_ids))) / max(int(unit_start[-1]), 1))}
