"""Small prepared shard sets shared by the test_data_*.py files (cached per test session)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np

from meshformer.config import Config, load_config
from meshformer.data import load_tokenizer, prepare
from meshformer.data.sources import BUNDLED_CORPORA

_ROOT: Path | None = None
ROOT_DIR = Path(__file__).resolve().parents[2]  # the checkout (its meshformer, not an installed one)


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


_WORDS = ("the of and to in that he was for it with as his on be at by this had not are but from or have an "
          "they which one you were her all she there would their we him been has when who will more no if out so "
          "said what up its about into than them can only other new some could time these two may then do first "
          "any my now such like our over man me even most made after also did many before must through back years "
          "where much your way well down should because each just those people how too little state good very make "
          "world still own see men work long get here between both life being under never day same another know "
          "while last might us great old year off come since against go came right used take three").split()


def write_corpus(folder: Path, megabytes: float, files: int = 8, seed: int = 0, mean_words: int = 300) -> Path:
    """`files` JSONL files of word-salad documents holding about `megabytes` of text in all; returns the folder.

    Each document starts with its number (`doc 000123:`), so a prepared stream can be traced back to the input
    order (shuffle quality), and sizes are exact to the byte budget asked for."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    budget = int(megabytes * (1 << 20)) // files
    doc = 0
    for f in range(files):
        size = 0
        with open(folder / f"part-{f:04d}.jsonl", "w") as fh:
            while size < budget:
                words = rng.choice(len(_WORDS), size=max(5, int(rng.exponential(mean_words))))
                text = f"doc {doc:07d}: " + " ".join(_WORDS[w] for w in words.tolist()) + "."
                line = json.dumps({"text": text}) + "\n"
                fh.write(line)
                size += len(line)
                doc += 1
    return folder


def forge_shard(folder: Path, records: list[list[tarfile.TarInfo | str]], shard: int = 0) -> str:
    """Replace train shard `shard` of the prepared `folder` by a tar of `records` (each a list of members: a
    TarInfo, or the name of a regular member holding 33 tokens), with an index and a manifest entry that match
    it, as someone handing over a crafted dataset could; returns the shard's file name."""
    from meshformer.data.shard_index import build_index, index_name

    manifest_path = folder / "manifest.json"
    tree = json.loads(manifest_path.read_text())
    entry = tree["splits"]["train"]["shards"][shard]
    buffer, spans = io.BytesIO(), []
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for record in records:
            start = tar.offset
            for member in record:
                info = member if isinstance(member, tarfile.TarInfo) else tarfile.TarInfo(member)
                data = np.arange(33, dtype="<u2").tobytes() if info.isreg() else b""
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data) if data else None)
            spans.append((start, tar.offset))
    blob = buffer.getvalue()
    index = build_index(blob, spans)
    (folder / entry["name"]).write_bytes(blob)
    (folder / index_name(entry["name"])).write_bytes(index)
    entry.update(samples=len(records), tokens=33 * len(records), bytes=len(blob),
                 sha256=hashlib.sha256(blob).hexdigest(), index_bytes=len(index),
                 index_sha256=hashlib.sha256(index).hexdigest())
    manifest_path.write_text(json.dumps(tree))
    return entry["name"]


def tar_member(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    """A tar member of type `kind` (tarfile.SYMTYPE, LNKTYPE, DIRTYPE, FIFOTYPE, CHRTYPE, REGTYPE)."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info
