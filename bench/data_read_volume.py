"""Bytes each data-parallel rank reads per epoch, against its share (dataset / dp_size), with ranged reads and
with the streaming fallback, plus the shuffle quality of the global order (the same for every dp_size).

    python bench/data_read_volume.py [--corpus bundled:kjv] [--seq-len 128] [--shard-records 256] [--json out.json]

dp 1/2/4/8: simulated ranks in one process, bytes counted by the shard reader itself (and checked against the
read plan). Larger dp: the read plan (`planned_bytes` below) over the same shards, which needs no reads.

`planned_bytes(order, shards, ...)` is what one rank's ranged reads fetch over a span of stream positions:
the byte span of every record it uses plus that record's 32-byte index entry, each record once per shard
group (a group is loaded once per worker). It needs no data, so it projects to any dp_size.
tests/unit/data/test_data_read_volume.py checks it against the shard reader's own byte count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshformer.config import load_config
from meshformer.data import build_loader, load_tokenizer, prepare
from meshformer.data.order import RankView, SampleOrder
from meshformer.data.shard_index import ENTRY, index_name
from meshformer.data.shards import Manifest, ShardInfo


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="bundled:kjv")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--shard-records", type=int, default=256)
    ap.add_argument("--shuffle-shards", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3, help="per-epoch figures average over this many epochs")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    tok = load_tokenizer("bundled:kjv-bpe-4k")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "shards"
        prepare(args.corpus, out, tokenizer="bundled:kjv-bpe-4k", seq_len=args.seq_len,
                shard_records=args.shard_records, progress=False)
        cfg = load_config(None, [f'data.shards="{out}"', f"data.seq_len={args.seq_len}", "data.num_workers=0",
                                 f"data.batch_size={args.batch_size}", f"data.shuffle_shards={args.shuffle_shards}",
                                 f"model.max_seq_len={args.seq_len}"])
        base = build_loader(cfg, tok, "train", 0, 1)
        n, shards = base.samples_per_epoch, base.source.shards
        spans = record_spans(base.manifest, "train")
        dataset = sum(s.bytes for s in shards)
        print(f"{len(shards)} shards, {n} samples, {dataset / 2**20:.1f} MiB; batch {args.batch_size}/rank, "
              f"shuffle_shards {args.shuffle_shards}")
        for dp in (1, 2, 4, 8, 64, 1024):
            g = dp * args.batch_size
            steps = max(-(-args.epochs * n // g), 1)  # whole global batches covering the epochs
            epochs = steps * g / n
            ranks = range(dp) if dp <= 8 else sorted({0, dp // 2, dp - 1})
            measured, planned, fallback = [], [], []
            if dp <= 8:
                loaders = [build_loader(cfg, tok, "train", r, dp) for r in ranks]
                for _ in range(steps):
                    for loader in loaders:
                        next(loader)
                measured = [loader.source.nbytes / epochs for loader in loaders]
            for r in ranks:
                planned.append(planned_bytes(base.order, shards, spans, r, dp, args.batch_size, steps * g) / epochs)
                fallback.append(planned_bytes(base.order, shards, spans, r, dp, args.batch_size, steps * g,
                                              ranged=False) / epochs)
            if measured:
                assert np.allclose(measured, planned), "read plan differs from the measured reads"
            share = dataset / dp
            row = {"dp": dp, "share_bytes": share, "max_rank_bytes": max(measured or planned),
                   "ratio": max(measured or planned) / share, "fallback_ratio": max(fallback) / share,
                   "source": "measured" if measured else "plan"}
            rows.append(row)
            print(f"dp {dp:5d}: share {share / 2**20:8.3f} MiB  max rank {row['max_rank_bytes'] / 2**20:8.3f} MiB  "
                  f"= {row['ratio']:.3f}x share ({row['source']}); streaming fallback {row['fallback_ratio']:.1f}x")
        stream = np.array([base.order.unit_at(p) for p in range(n)])
        quality = shuffle_quality(stream, base.order.unit_start)
        print(f"shuffle quality (epoch 0, global order): same-shard adjacent pairs {quality['same_shard']:.3f} "
              f"(ideal {1 / len(shards):.3f}), mean unit gap {quality['unit_gap']:.3f} (ideal 0.333)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "quality": quality}, indent=1))


if __name__ == "__main__":
    main()
