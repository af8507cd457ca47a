"""`build_loader`: config -> (auto-prepared) shards -> verified source -> rank loader."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Literal

import numpy as np

from meshformer.errors import ConfigError

from .loader import Loader
from .mixture import MixtureLoader, check_mixture
from .objectives import Objective, Sample, make_objective
from .prepare import prepare
from .shard_index import index_name
from .shards import Manifest, ManifestError, ShardError, ShardInfo, read_manifest, read_shard, read_shard_records
from .sources import BUNDLED_CORPORA, check_corpus, resolve_inputs
from .tokenizer import Tokenizer

log = logging.getLogger("meshformer.data")


class ShardSource:
    """The shards of one manifest split, read through `read_shard` (integrity-checked)."""

    def __init__(self, manifest: Manifest, split: str, skip: dict[str, str] | None = None) -> None:
        self.manifest, self.split = manifest, split
        self.record_type = manifest.record_type
        self.record_len = manifest.record_len
        self.shards: list[ShardInfo] = manifest.splits[split]
        self.skipped = skip or {}  # shard name -> reason
        self.records_per_shard = [s.samples for s in self.shards]
        self.skip = frozenset(i for i, s in enumerate(self.shards) if s.name in self.skipped)
        self.nbytes = 0  # bytes read from shards and indexes by this process (read-volume stats)
        spec = {"manifest": manifest.sha256, "split": split, "skipped": sorted(self.skipped)}
        self.fingerprint = hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]

    def read(self, shard: int, records: np.ndarray) -> dict[int, Sample]:
        info = self.shards[shard]
        got = read_shard_records(self.manifest.shard_url(info), info, self.manifest.dtype, records, self,
                                 self.record_type)
        if self.record_type == "pairs":
            return {i: (parts["src"].astype(np.int64), parts["tgt"].astype(np.int64)) for i, parts in got.items()}
        return {i: parts["tokens"] for i, parts in got.items()}


def cache_root(cfg_dir: str = "") -> Path:
    return Path(cfg_dir or os.environ.get("MESHFORMER_CACHE") or Path.home() / ".cache" / "meshformer").expanduser()


def ensure_shards(data_cfg, tokenizer: Tokenizer, record_len: int) -> str:  # data_cfg: config.DataConfig
    """data.shards if set; else prepare data.corpus once into the cache (file-locked across local ranks)."""
    if data_cfg.shards:
        return data_cfg.shards
    files = resolve_inputs(data_cfg.corpus)
    data_files = [g for f in files for g in ((f, f.with_suffix(".bin")) if f.suffix == ".idx" else (f,))]  # Megatron
    key_src = {"corpus": data_cfg.corpus, "files": [(str(f), f.stat().st_size, f.stat().st_mtime_ns)
                                                    for f in data_files],
               "field": data_cfg.text_field, "tokenizer": tokenizer.sha256, "record_len": record_len,
               "eval_fraction": data_cfg.eval_fraction, "seed": data_cfg.seed, "format": 2}
    if data_cfg.corpus in BUNDLED_CORPORA:  # the bundled file moves with the checkout; its content is fixed
        key_src["files"] = [f.stat().st_size for f in files]
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    name = data_cfg.corpus.replace("bundled:", "") if data_cfg.corpus in BUNDLED_CORPORA else files[0].stem
    out = cache_root(data_cfg.cache_dir) / "shards" / f"{name}-{key}"
    if (out / "manifest.json").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one local rank prepares, the others wait and reuse
        if not (out / "manifest.json").exists():
            log.info("data: no shards for corpus %r yet; preparing them into %s", data_cfg.corpus, out)
            start = time.perf_counter()
            prepare(data_cfg.corpus, out, tokenizer=tokenizer, record_len=record_len,
                    text_field=data_cfg.text_field, eval_fraction=data_cfg.eval_fraction, seed=data_cfg.seed,
                    shard_records=max(1, (1 << 17) // record_len), progress=False, overwrite=True)
            log.info("data: prepared %s in %.1fs", out, time.perf_counter() - start)
    return str(out)


def verify_shards(manifest: Manifest, split: str, full: bool, rank: int = 0, world: int = 1) -> dict[str, str]:
    """Shard name -> problem. Local files: existence and size always; full=True also hashes the shards i with
    i % world == rank (each process hashes its share; `agree_on_bad_shards` unites the findings)."""
    problems: dict[str, str] = {}
    for i, info in enumerate(manifest.splits[split]):
        url = manifest.shard_url(info)
        local = "://" not in url and not url.startswith("pipe:")
        if local:
            path = Path(url)
            if not path.is_file():
                problems[info.name] = f"missing ({url})"
                continue
            if path.stat().st_size != info.bytes:
                problems[info.name] = f"{path.stat().st_size} bytes on disk, manifest says {info.bytes} (truncated?)"
                continue
            index = path.with_name(index_name(path.name))
            if info.index_sha256 and (not index.is_file() or index.stat().st_size != info.index_bytes):
                problems[info.name] = f"index {index.name} missing or of the wrong size; re-run prepare or restore it"
                continue
        if full and i % world == rank and (problem := _hash_problem(url, info, manifest)):
            problems[info.name] = problem
    return problems


def _hash_problem(url: str, info: ShardInfo, manifest: Manifest) -> str:
    try:
        read_shard(url, info, manifest.dtype, wanted=set(), record_type=manifest.record_type)
    except ShardError as err:
        return err.reason
    return ""


def union_bad_shards(per_rank: list[dict[str, str]]) -> dict[str, str]:
    """Shard name -> problem over every rank's findings (sorted by name; the first rank's reason wins)."""
    merged: dict[str, str] = {}
    for rank, problems in enumerate(per_rank):
        for name, why in problems.items():
            merged.setdefault(name, why if rank == 0 else f"{why} (seen by rank {rank})")
    return dict(sorted(merged.items()))


def agree_on_bad_shards(problems: dict[str, str]) -> dict[str, str]:
    """The union of every rank's bad shards when torch.distributed is initialized (collective over the default
    group), so that all ranks leave out the same shards; `problems` unchanged in a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return problems
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return union_bad_shards([p or {} for p in everyone])


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build_loader(cfg, tokenizer: Tokenizer, split: Literal["train", "eval"] = "train", dp_rank: int = 0,
                 dp_size: int = 1, *, with_sample_ids: bool = False) -> Loader:
    """Infinite, resumable batches of `cfg.data.batch_size` for one data-parallel rank (meshformer/data/README.md)."""
    d = cfg.data
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}; use 'train' or 'eval'")
    objective: Objective = make_objective(cfg.objective, tokenizer, d)
    if d.sources:  # a mixture: [[data.sources]]
        names = _source_names(d)
        check_mixture([src.weight for src in d.sources], names)
        opened = [_open_source(src.shards, src.allow_remote_shards, d, tokenizer, objective, split)
                  for src in d.sources]
        loader: Loader = MixtureLoader([o[0] for o in opened], names, [src.weight for src in d.sources], objective,
                                       split, dp_rank, dp_size, d.batch_size, d.num_workers, d.seed, d.shuffle_shards,
                                       with_ids=with_sample_ids, reseed_on_resume=d.reseed_on_resume)
        loader.skipped_shards = sorted(f"{o[1].url}:{name}" for o in opened for name in o[0].skipped)
        loader.manifest = opened[0][1]
        return loader
    source, manifest = _open_source(ensure_shards(d, tokenizer, objective.raw_length), d.allow_remote_shards, d,
                                    tokenizer, objective, split)
    loader = Loader(source, objective, split, dp_rank, dp_size, d.batch_size, d.num_workers, d.seed,
                    d.shuffle_shards, with_ids=with_sample_ids, reseed_on_resume=d.reseed_on_resume)
    loader.skipped_shards = sorted(source.skipped)
    loader.manifest = manifest
    return loader


def _open_source(spec: str, allow_remote_shards: bool, d, tokenizer: Tokenizer, objective: Objective,
                 split: str) -> tuple[ShardSource, Manifest]:
    """One manifest's split, checked against the run and verified (bad shards: error, or skipped and logged)."""
    manifest = read_manifest(spec, allow_remote_shards)
    _check_manifest(manifest, tokenizer, objective, split)
    problems = verify_shards(manifest, split, d.bad_shards == "skip", _rank(), _world())
    if d.bad_shards == "skip":
        problems = agree_on_bad_shards(problems)  # every rank must skip the same shards: one sample order
    if problems and d.bad_shards == "error":
        name, why = next(iter(problems.items()))
        raise ShardError(f"shard {name} of {manifest.url} is unusable: {why}. Re-run `meshformer data prepare`, "
                         f"restore the file, or set data.bad_shards='skip' ({len(problems)} bad shard(s) in all)")
    if problems and _rank() == 0:
        lost = sum(s.samples for s in manifest.splits[split] if s.name in problems)
        log.warning("data: skipping %d bad shard(s) of %s split %s (%d samples lost): %s", len(problems),
                    manifest.url, split, lost, "; ".join(f"{k}: {v}" for k, v in problems.items()))
    source = ShardSource(manifest, split, problems)
    if len(source.skip) == len(source.shards):
        raise ShardError(f"split {split!r} of {manifest.url} has no usable samples; prepare with a larger corpus "
                         "or eval_fraction, or repair the shards")
    return source, manifest


def check_data(cfg, tokenizer: Tokenizer) -> None:
    """What `build_loader` would refuse, checked cheaply before any model or process group exists: the objective
    against the tokenizer, prepared shards' manifest, or the raw corpus's files (the data options themselves are
    checked when the config is loaded)."""
    d = cfg.data
    objective = make_objective(cfg.objective, tokenizer, d)
    if d.sources:
        check_mixture([src.weight for src in d.sources], _source_names(d))
    prepared = [(src.shards, src.allow_remote_shards) for src in d.sources] or (  # a mixture: every source
        [(d.shards, d.allow_remote_shards)] if d.shards else [])
    for spec, allow_remote_shards in prepared:
        manifest = read_manifest(spec, allow_remote_shards)  # read once (it may be remote), checked for both splits
        for split in ("train", "eval"):
            _check_manifest(manifest, tokenizer, objective, split)
    if prepared:
        return
    files = resolve_inputs(d.corpus)
    check_corpus(files, d.text_field)
    cache = cache_root(d.cache_dir)
    parent = next(p for p in (cache, *cache.parents) if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"the shard cache {cache} cannot be created ({parent} is not a writable folder)",
                          "set data.cache_dir (or MESHFORMER_CACHE) to a folder you can write, or prepare the "
                          "shards elsewhere with `meshformer data prepare` and set data.shards")


def _source_names(d) -> list[str]:  # d: config.DataConfig
    """The mixture's source names as logged (data/<name>/...): each source's name, or source<i>."""
    return [src.name or f"source{i}" for i, src in enumerate(d.sources)]


def _check_manifest(manifest: Manifest, tokenizer: Tokenizer, objective: Objective, split: str) -> None:
    where = manifest.url
    if manifest.tokenizer.get("sha256") != tokenizer.sha256:
        raise ManifestError(f"{where} was prepared with tokenizer {manifest.tokenizer.get('spec')!r} "
                            f"(sha256 {str(manifest.tokenizer.get('sha256'))[:12]}..) but data.tokenizer is "
                            f"{tokenizer.name!r} ({tokenizer.sha256[:12]}..); set data.tokenizer to the "
                            f"tokenizer.json next to the manifest, or re-run prepare with this tokenizer")
    if split not in manifest.splits or not manifest.splits[split]:
        raise ManifestError(f"{where} has no {split!r} split; prepare with --eval-fraction > 0 for evaluation")
    if manifest.record_type == "pairs" and objective.name != "seq2seq":
        raise ManifestError(f"{where} holds source/target pairs, usable only by objective 'seq2seq' "
                            f"(not {objective.name!r}); point data.shards at packed shards")
    if manifest.record_type == "packed" and manifest.record_len < objective.raw_length:
        raise ManifestError(f"{where} holds {manifest.record_len}-token records but objective {objective.name!r} "
                            f"with data.seq_len={objective.seq_len} needs {objective.raw_length}; re-run "
                            f"`meshformer data prepare --record-len {objective.raw_length}` or lower data.seq_len")


__all__ = ["ShardSource", "agree_on_bad_shards", "build_loader", "cache_root", "check_data", "ensure_shards",
           "union_bad_shards", "verify_shards"]
