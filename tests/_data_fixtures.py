"""Small prepared shard sets shared by the tests/test_data_*.py files (cached per test session)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from meshformer.config import Config, load_config
from meshformer.data import load_tokenizer, prepare
from meshformer.data.sources import BUNDLED_CORPORA

_ROOT: Path | None = None
ROOT_DIR = Path(__file__).resolve().parents[1]  # the checkout (its meshformer, not an installed one)


def kjv_docs(n: int) -> list[str]:
    with gzip.open(BUNDLED_CORPORA["bundled:kjv"], "rt", encoding="utf-8") as fh:
        return [json.loads(line)["text"] for _, line in zip(range(n), fh)]


def small_corpus(folder: Path, n_docs: int = 12) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "small.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in kjv_docs(n_docs)))
    return path


def shards(tmp_root: Path, name: str = "small", record_len: int = 33, shard_records: int = 41,
           n_docs: int = 12) -> Path:
    """Prepared once per session; copy it before corrupting anything."""
    out = tmp_root / name
    if not (out / "manifest.json").exists():
        corpus = small_corpus(tmp_root / f"{name}-corpus", n_docs)
        prepare(corpus, out, tokenizer="bundled:kjv-bpe-4k", record_len=record_len, eval_fraction=0.1,
                seed=30,  # 6 x 41 + 18 train records, 20 eval
                shard_records=shard_records, progress=False)
    return out


def copy_shards(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def config(manifest_dir: Path, *overrides: str, family: str = "decoder") -> Config:
    base = [f'model.family="{family}"', f'data.shards="{manifest_dir}"', "data.seq_len=32", "data.target_len=16",
            "data.batch_size=4", "data.num_workers=0", "data.shuffle_shards=2", "model.max_seq_len=64"]
    return load_config(None, base + list(overrides))


TOKENIZER = None


def tokenizer():
    global TOKENIZER
    if TOKENIZER is None:
        TOKENIZER = load_tokenizer("bundled:kjv-bpe-4k")
    return TOKENIZER
