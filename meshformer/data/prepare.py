"""`meshformer data prepare`: corpus -> tokenizer -> packed WebDataset shards + manifest.json, in bounded memory,
split over processes (`num_proc`) and machines (`part=(i, N)`), with the same output for any split.

Stages (prepare_stages.py), all deterministic for the same inputs and seed:
1. plan: the input files, and the number of buckets per split from the input size (`bucket_mb` of input
   text per bucket); saved as <out>.work/plan.json so that every part checks it runs the same plan;
2. map, one task per input file: stream documents, hold out `eval_fraction` of them, spread them over the
   buckets at random, tokenize in batches and spill token ids to <out>.work/map/;
3. reduce, one task per bucket: gather the bucket's documents, shuffle them, join them with EOS and cut
   `record_len`-token records (ragged tail dropped per bucket; pairs: one sample per (src, tgt)), write shards;
4. merge: number the shards in bucket order, write tokenizer.json and manifest.json (counts, sha256,
   tokenizer hash), move everything into <out> and remove the work folder.
Part i of N runs the map tasks u with u % N == i, then (after every map is done) the reduce tasks k with
k % N == i; a document's split, bucket and place in the shuffle depend only on its file, its index in that
file and the seed, so N (and num_proc) never changes a byte of the output. Two-level shuffle: random buckets
mix the whole corpus into every shard at any scale; the loader then permutes shards and samples per epoch.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import shutil
import time
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Literal

import numpy as np

from meshformer.errors import UsageError
from meshformer.folders import check_output, remove, replace, scratch
from meshformer.progress import Progress

from .prepare_stages import SPLITS, map_unit, reduce_bucket, train_documents, unit_done
from .shard_index import index_name
from .shards import Manifest, ShardInfo, read_shard, write_shards
from .shards import token_dtype as shard_dtype
from .sources import (
    BUNDLED_CORPORA,
    TOKEN_FORMATS,
    CorpusError,
    DocSplit,
    Unit,
    check_corpus,
    detect,
    iter_pairs,
    plan_units,
    resolve_inputs,
    unit_bytes,
)
from .tokenizer import Tokenizer, load_tokenizer, train_bpe

log = logging.getLogger("meshformer.data")
Stage = Literal["all", "map", "reduce", "merge"]
_MAX_BUCKETS = 1 << 20  # every map task keeps a row per bucket per chunk, every bucket is a reduce task


def prepare(inputs: str | Path | list[str | Path], out_dir: str | Path, *, tokenizer: str | Tokenizer = "train",
            vocab_size: int = 4096, seq_len: int = 128, record_len: int | None = None, text_field: str = "text",
            pairs: bool = False, src_field: str = "src", tgt_field: str = "tgt", doc_split: DocSplit = "file",
            eval_fraction: float = 0.02, seed: int = 1234, shard_records: int | None = None, num_proc: int = 0,
            bucket_mb: float = 128, part: tuple[int, int] = (0, 1), stage: Stage = "all", progress: bool = True,
            overwrite: bool = False, token_dtype: str = "auto", include: list[str] | None = None,
            follow_links: bool = False) -> Manifest | None:
    """Prepare shards in `out_dir` and return the manifest (also written to out_dir/manifest.json).

    inputs: text / JSONL / Parquet / Arrow files (gzip or zstd compressed text too), `datasets` folders, and
    pre-tokenized Megatron datasets (`.idx` + `.bin`), flat token files (`.bin`, of `token_dtype`: "auto" is
    uint16 for vocabularies up to 65536, else uint32) and `.npy` token arrays, whose ids are kept as they are.
    include: glob patterns choosing the files of input folders to read, whatever their names (default: the files
    named or recognised as a corpus format; other text files are refused, binary ones skipped and logged).
    follow_links: read files and folders that links take outside an input folder (refused otherwise).
    tokenizer: "train" (byte-level BPE of `vocab_size` on the training documents; only with stage "all"),
    "bundled:<name>", "gpt2", a tokenizer.json path, a Hugging Face tokenizer folder, or a loaded Tokenizer.
    Map tasks finished by an earlier run of the same plan (same inputs and settings) are kept: after a failed
    prepare, fix the file it names and run the same command again.
    Records hold `record_len` tokens (default seq_len + 1:
    one causal sequence plus its shifted label; longer records are cut into several samples at load time).
    shard_records: records per shard (default: about 16M tokens per shard). num_proc: processes for the map
    and reduce tasks (0/1: in-process; the tokenizer's own threads still use every core). bucket_mb: input
    text per bucket, which bounds reduce memory. part=(i, N), stage: run one slice of one stage (`--part i/N
    --stage map|reduce|merge`); stage "all" runs every stage of the part (for N == 1: the whole prepare).
    Returns None for the map and reduce stages.
    """
    out = Path(out_dir)
    index, count = part
    if not 0 <= index < count:
        raise UsageError(f"--part {index}/{count} does not exist", "write --part i/N with N >= 1 and i from 0 to "
                         "N - 1 (e.g. 0/4, 1/4, 2/4, 3/4)")
    if stage == "all" and count > 1:
        raise UsageError("--part i/N needs --stage", "run --stage map on every part, then "
                         "--stage reduce on every part, then --stage merge once (`meshformer data submit-prepare` "
                         "does this on SLURM)")
    check_numbers(eval_fraction=eval_fraction, seq_len=seq_len, record_len=record_len, vocab_size=vocab_size,
                  seed=seed, shard_records=shard_records, bucket_mb=bucket_mb, num_proc=num_proc)
    record_len = record_len if record_len is not None else seq_len + 1
    if token_dtype not in ("auto", "uint16", "uint32"):
        raise UsageError(f"--token-dtype {token_dtype!r} is not a token type", "use auto, uint16 or uint32")
    if tokenizer == "train" and stage != "all":
        raise UsageError("--tokenizer train needs the whole corpus in one process", "train a tokenizer first "
                         "(meshformer data prepare SAMPLE --tokenizer train) and pass its tokenizer.json")
    start = time.perf_counter()
    items = inputs if isinstance(inputs, list) else [inputs]
    check_output_folder(items, out, overwrite)
    report: list[str] = []
    files = resolve_inputs(items, include, report, follow_links, "pass --follow-links if you mean to read them where "
                           "they are, or copy them into the folder")
    check_corpus(files, None if pairs else text_field)
    for f in files if pairs else ():  # pairs need JSONL with both fields: say so before any work starts
        next(iter_pairs([f], src_field, tgt_field), None)
    for line in report:  # after the checks: a refused input stays a one-line error
        log.info(line)
    units = [Unit(str(f), detect(f)) for f in files] if pairs else plan_units(files)
    pretokenized = [u.path for u in units if u.format in TOKEN_FORMATS]
    if pretokenized and tokenizer == "train":
        raise UsageError(f"{pretokenized[0]} holds token ids, which need the tokenizer they come from",
                         "pass it with --tokenizer (a tokenizer.json or a Hugging Face tokenizer folder)")
    # parts share the work folder; a rerun of the same plan keeps its finished map tasks (resume)
    work = scratch(work_folder(out), "data prepare work", fresh=False)
    bucket_counts = _bucket_counts(units, eval_fraction, bucket_mb)
    plan = {"units": [u.as_list() for u in units], "kind": "pairs" if pairs else "packed",
            "record_len": 0 if pairs else record_len, "text_field": text_field, "src_field": src_field,
            "tgt_field": tgt_field, "doc_split": doc_split, "eval_fraction": eval_fraction, "seed": seed,
            "buckets": bucket_counts, "bucket_mb": bucket_mb}
    if isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    elif tokenizer == "train":
        plan.update(eos_id=-1, token_dtype="uint16")
        tok = train_bpe(train_documents(plan), vocab_size=vocab_size)
    else:
        tok = load_tokenizer(tokenizer)
    plan.update(tokenizer_spec=tokenizer if isinstance(tokenizer, str) else tok.name, tokenizer_sha256=tok.sha256,
                dtype=shard_dtype(tok.vocab_size).name, eos_id=tok.eos_id,
                token_dtype=shard_dtype(tok.vocab_size).name if token_dtype == "auto" else token_dtype,
                shard_records=shard_records or max(1, (1 << 24) // (record_len if not pairs else 256)))
    _agree_on_plan(work, plan, restart=stage == "all")
    if stage in ("map", "reduce"):
        _write_atomic(work / f"{stage}.parts", str(count))  # for naming the part to rerun if a task goes missing
    todo = [u for u in range(index, len(units), count) if not unit_done(plan, work, u)]
    if stage in ("all", "map") and len(todo) < len(range(index, len(units), count)):
        log.info("resuming %s: %d of %d map tasks already done", work, len(range(index, len(units), count)) -
                 len(todo), len(range(index, len(units), count)))
    map_tasks = todo if stage in ("all", "map") else []
    buckets = [(s, b) for s in SPLITS for b in range(bucket_counts[s])][index::count]
    pool = _pool(tok, num_proc, max(len(map_tasks), len(buckets) if stage in ("all", "reduce") else 0))
    try:
        _run(pool, map_unit, plan, work, tok, [(u,) for u in map_tasks], progress, "tokenize")
        if stage in ("all", "reduce"):
            _require_maps(plan, work)
            _run(pool, reduce_bucket, plan, work, tok, [(s, b, tok.eos_id) for s, b in buckets], progress, "pack")
    finally:
        if pool is not None:
            pool.terminate()
    if stage not in ("all", "merge"):
        return None
    manifest = _merge(plan, work, out, tok, files)
    tokens = sum(s.tokens for s in manifest.splits["train"])
    log.info("prepared %s: %d train shards, %d train tokens, %d eval shards in %.1fs", out,
             len(manifest.splits["train"]), tokens, len(manifest.splits["eval"]), time.perf_counter() - start)
    return manifest


def check_numbers(*, eval_fraction: float, seq_len: int, record_len: int | None, vocab_size: int, seed: int,
                  shard_records: int | None, bucket_mb: float, num_proc: int) -> None:
    """Refuse, before any work, a numeric option out of range (a zero --bucket-mb divided by zero at the plan, a
    zero --shard-records or --record-len meant the default, a negative seed failed in numpy)."""
    if not 0 <= eval_fraction < 1:
        raise UsageError(f"eval_fraction={eval_fraction} is out of range", "use a value in [0, 1), e.g. 0.02")
    if (record_len if record_len is not None else seq_len + 1) < 2:
        raise UsageError(f"record_len={record_len if record_len is not None else seq_len + 1} is too short",
                         "use --seq-len >= 1 (--record-len >= 2)")
    for option, value, least in (("--vocab-size", vocab_size, 1), ("--seed", seed, 0),
                                 ("--shard-records", shard_records, 1), ("--num-proc", num_proc, 0)):
        if value is not None and value < least:
            raise UsageError(f"{option} {value} is out of range", f"use {option} >= {least}")
    if not (math.isfinite(bucket_mb) and bucket_mb > 0):
        raise UsageError(f"--bucket-mb {bucket_mb:g} is not a positive size", "give the input text per shuffle bucket "
                         "in MB, e.g. --bucket-mb 128 (reduce memory is about 2-3x this)")


def work_folder(out: Path) -> Path:
    return out.with_name(out.name + ".work")


def check_output_folder(inputs: list[str | Path], out: Path, overwrite: bool) -> None:
    """Refuse, before any work, an --out that is (or holds, or lies in) an input, someone else's folder, or
    prepared shards without --overwrite."""
    roots = [BUNDLED_CORPORA.get(str(item), Path(item).expanduser()) for item in inputs]
    check_output(out, what="prepared shards", overwrite=overwrite, inputs=roots, legacy=["manifest.json"])


def _bucket_counts(units: list[Unit], eval_fraction: float, bucket_mb: float) -> dict[str, int]:
    total = sum(map(unit_bytes, units))
    per = bucket_mb * (1 << 20)
    counts = {"train": max(1, math.ceil(total * (1 - eval_fraction) / per)),
              "eval": max(1, math.ceil(total * eval_fraction / per))}
    if sum(counts.values()) > _MAX_BUCKETS:
        raise UsageError(f"--bucket-mb {bucket_mb:g} cuts {total} bytes of input into {sum(counts.values())} buckets",
                         f"use a larger --bucket-mb (at most {_MAX_BUCKETS} buckets; the default is 128)")
    return counts


def _agree_on_plan(work: Path, plan: dict, restart: bool) -> None:
    """The first part writes plan.json; every other part must compute the same plan. A whole prepare (`restart`)
    whose plan differs from the work folder's starts that folder afresh."""
    path = work / "plan.json"
    text = json.dumps(plan, indent=1, sort_keys=True)
    if restart and path.exists() and path.read_text() != text:
        scratch(work, "data prepare work", fresh=True)
    if not path.exists():
        _write_atomic(path, text)
    if path.read_text() != text:
        raise UsageError(f"{path} was written by a part with other inputs or settings", "run every part with the "
                         "same arguments (or delete the work folder to start over)")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _rerun(work: Path, stage: str, task: int) -> str:
    """The options that redo task number `task` of `stage` (map: input unit; reduce: bucket, train then eval):
    with N parts, part i runs the tasks t with t % N == i."""
    try:
        count = int((work / f"{stage}.parts").read_text())
    except (OSError, ValueError):  # the stage ran whole (or never)
        count = 1
    return f"`--stage {stage} --part {task % count}/{count}`" if count > 1 else f"`--stage {stage}`"


def _require_maps(plan: dict, work: Path) -> None:
    missing = [u for u in range(len(plan["units"])) if not unit_done(plan, work, u)]
    if missing:
        raise UsageError(f"{len(missing)} map task(s) of {work} are not done (first: "
                         f"{Unit(*plan['units'][missing[0]]).where()}; killed, or not run yet?)",
                         f"rerun the same command with {_rerun(work, 'map', missing[0])} (every part of the map "
                         "stage must finish before --stage reduce and --stage merge)")


def _pool(tok: Tokenizer, num_proc: int, tasks: int) -> Pool | None:
    """One process pool for both stages (starting workers costs an interpreter and imports each)."""
    if num_proc <= 1 or tasks <= 1:
        return None
    # spawn: the parent's tokenizer thread pool must not be forked; each worker tokenizes single-threaded
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return multiprocessing.get_context("spawn").Pool(min(num_proc, tasks), initializer=_init_worker,
                                                     initargs=(tok.json,))


def _run(pool: Pool | None, fn, plan: dict, work: Path, tok: Tokenizer, tasks: list[tuple], progress: bool,
         what: str) -> None:
    bar = Progress(len(tasks), what, "task", enabled=progress and bool(tasks))  # a bar on a terminal, else lines
    if pool is None or len(tasks) <= 1:
        for task in tasks:
            fn(plan, work, *((tok,) if fn is map_unit else ()), *task)
            bar.update()
    else:
        for _ in pool.imap_unordered(_call, [(fn.__name__, plan, str(work), task) for task in tasks]):
            bar.update()
    bar.close()


_WORKER_TOK: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_TOK
    from tokenizers import Tokenizer as HFTokenizer

    _WORKER_TOK = Tokenizer(HFTokenizer.from_str(tokenizer_json), "worker")


def _call(args: tuple) -> None:
    name, plan, work, task = args
    if name == "map_unit":
        assert _WORKER_TOK is not None  # set by the pool's initializer
        map_unit(plan, Path(work), _WORKER_TOK, *task)
    else:
        reduce_bucket(plan, Path(work), *task)


def _merge(plan: dict, work: Path, out: Path, tok: Tokenizer, files: list[Path]) -> Manifest:
    """Number the buckets' shards, write tokenizer.json + manifest.json, move into `out`, drop the work folder."""
    _require_maps(plan, work)
    # Staged inside our work folder (no folder beside `out` is ever touched), as links to the reduce stage's files,
    # which stay in place until the end: a killed merge is simply run again.
    tmp = work / "merged"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    splits: dict[str, list[ShardInfo]] = {}
    documents = {}
    for split in SPLITS:
        splits[split], documents[split] = [], 0
        for b in range(plan["buckets"][split]):
            task = f"reduce task {split} bucket {b} of {work}"
            number = b + (plan["buckets"]["train"] if split == "eval" else 0)  # the order parts take them in
            rerun = f"rerun the same command with {_rerun(work, 'reduce', number)}, then --stage merge"
            path = work / "reduce" / f"{split}-{b:05d}.json"
            if not path.exists():
                raise UsageError(f"{task} is not done (killed, or not run yet?)", rerun)
            done = json.loads(path.read_text())
            documents[split] += done["documents"]
            for info in map(lambda s: ShardInfo(**s), done["shards"]):
                name = f"{split}-{len(splits[split]):06d}.tar"
                src = work / "reduce" / f"{split}-{b:05d}" / info.name
                for file, staged in ((src, name), (src.with_name(index_name(src.name)), index_name(name))):
                    if not file.is_file():
                        raise UsageError(f"{task} lost its file {file.name}", rerun)
                    _link(file, tmp / staged)
                info.name = name
                splits[split].append(info)
    if not documents["train"] + documents["eval"]:
        raise CorpusError(f"no documents found in {[f.name for f in files][:3]}", "check the inputs and --text-field")
    held_out = "documents"
    if plan["eval_fraction"] > 0 and not splits["eval"]:  # too few documents to hold one out: split the records
        splits["train"], splits["eval"] = _hold_out_tail(tmp, splits["train"], plan)
        held_out = "tokens" if plan["kind"] == "packed" else "documents"
    _refuse_empty_split(plan, work, splits, documents)
    tok.save(tmp / "tokenizer.json")
    manifest = Manifest(
        record_type=plan["kind"], record_len=plan["record_len"], dtype=plan["dtype"],
        tokenizer={"spec": plan["tokenizer_spec"], "file": "tokenizer.json", "sha256": tok.sha256,
                   "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "pad_id": tok.pad_id},
        splits=splits,
        meta={"inputs": [_input_name(f) for f in files], "text_field": plan["text_field"],
              "doc_split": plan["doc_split"], "seed": plan["seed"], "eval_fraction": plan["eval_fraction"],
              "documents": documents, "eval_held_out": held_out, "buckets": plan["buckets"],
              "created_by": "meshformer data prepare"})
    (tmp / "manifest.json").write_text(manifest.to_json())
    replace(tmp, out)  # readers never see a half-written folder
    remove(work)
    manifest.url = str(out / "manifest.json")
    return manifest


def _refuse_empty_split(plan: dict, work: Path, splits: dict[str, list[ShardInfo]], documents: dict[str, int]
                        ) -> None:
    """A split left without a record (a corpus shorter than one record, or two with an eval split) is refused before
    anything is written: training from it would find no data only at its first step."""
    wanted = ["train", "eval"] if plan["eval_fraction"] > 0 else ["train"]
    empty = [split for split in wanted if not sum(info.samples for info in splits[split])]
    if not empty:
        return
    tokens = sum(json.loads(path.read_text())["tokens"] for path in (work / "map").glob("u*.done.json"))
    record = plan["record_len"]
    size = f"{tokens:,} tokens in {sum(documents.values()):,} document(s)"
    remove(work)  # nothing in it is worth keeping: the inputs must change
    if plan["kind"] != "packed":
        raise CorpusError(f"the {empty[0]} split gets no examples: the corpus holds {size}",
                          "add examples, or pass --eval-fraction 0 to hold none out")
    raise CorpusError(f"the {empty[0]} split gets no {record}-token record: the corpus holds {size}, and one record "
                      f"per split ({' and '.join(wanted)}) needs at least {len(wanted) * record:,} tokens",
                      "add text, or lower the sequence length (--seq-len or --record-len; data.seq_len when training "
                      "from a corpus)" + (", or pass --eval-fraction 0" if len(wanted) > 1 else ""))


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copyfile(src, dst)


def _hold_out_tail(folder: Path, train: list[ShardInfo], plan: dict) -> tuple[list[ShardInfo], list[ShardInfo]]:
    """Move the last round(records * eval_fraction) (at least one) train records into an eval shard."""
    total = sum(s.samples for s in train)
    n_held = max(1, round(total * plan["eval_fraction"])) if total > 1 else 0
    if not n_held:
        return train, []
    tail: list[dict] = []
    while train and len(tail) < n_held:  # the trailing shards that hold the records to move
        info = train.pop()
        got = read_shard(str(folder / info.name), info, plan["dtype"], None, record_type=plan["kind"])
        tail = [got[i] for i in range(info.samples)] + tail
        (folder / info.name).unlink()
        (folder / index_name(info.name)).unlink()
    kept, held = tail[:len(tail) - n_held], tail[len(tail) - n_held:]
    dtype, per_shard = np.dtype(plan["dtype"]), plan["shard_records"]
    first = len(train)  # the untouched train shards keep their names; the rewritten ones follow them
    train += write_shards(kept, dtype, per_shard, lambda k: folder / f"train-{first + k:06d}.tar")
    return train, write_shards(held, dtype, per_shard, lambda k: folder / f"eval-{k:06d}.tar")


def _input_name(path: Path) -> str:
    for name, bundled in BUNDLED_CORPORA.items():
        if path == bundled:
            return name
    return str(path)
