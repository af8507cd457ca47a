"""`data prepare` throughput and memory on a generated corpus (no downloads).

    python bench/data_prepare.py [--mb 8] [--reference /work/main] [--json out.json]
    python bench/data_prepare.py --formats [--mb 8]    # per input format (#23)

- MB of input text per CPU-second (= MB/s per busy core, robust on a shared machine): one process with a
  single-threaded tokenizer, against `encode_batch` alone on the same text in the same run (the ceiling),
  and with num_proc=2; plus the wall-clock scaling from 1 to 2 processes (meaningful on an idle machine).
- Peak RSS at corpus 1x and 10x (fresh process each), for this prepare and, with --reference, for the prepare
  of another checkout (e.g. the previous one, which held the corpus in memory).
- Shuffle quality of the prepared stream: mean distance between consecutive documents in input order, as a
  fraction of the corpus (a global shuffle gives 1/3).

--formats: the same corpus as JSONL, JSONL.zst, Parquet, an Arrow stream (a `datasets` file), and pre-tokenized
as a Megatron dataset and a flat uint16 .bin. For each text format, prepare's MB of text per CPU-second against
reading + tokenizing that format alone with its own library (pyarrow / zstandard / json, then `encode_batch`),
one process, single-threaded tokenizer; for the token formats, prepare's tokens per CPU-second against the
JSONL prepare's (no tokenizing). Peak RSS at 1x and 10x corpus for Parquet and zstd.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tables import add_table_arguments, write_table  # noqa: E402  (bench/ is on the path when run as a script)

RUN = textwrap.dedent("""
    import json, resource, sys, time
    sys.path.insert(0, {root!r})
    from meshformer.data import prepare
    import pyarrow, pyarrow.parquet, zstandard  # imported before the baseline, as torch is
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS (VmHWM) := current RSS: growth is prepare's own
    status = lambda key: int(__import__("re").search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
    base = status("VmRSS")
    cpu0 = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                                                   resource.RUSAGE_CHILDREN)))
    start = time.perf_counter()
    prepare({corpus!r}, {out!r}, tokenizer="bundled:kjv-bpe-4k", record_len=129, progress=False, **{kwargs!r})
    wall = time.perf_counter() - start
    use = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(u.ru_utime + u.ru_stime for u in use) - cpu0
    print(json.dumps({{"wall": wall, "cpu": cpu, "rss_kb": max(u.ru_maxrss for u in use),
                      "growth_kb": status("VmHWM") - base}}))
""")
ENCODE = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    cpu = time.process_time
    sys.path.insert(0, {root!r})
    from meshformer.data import load_tokenizer
    tok = load_tokenizer("bundled:kjv-bpe-4k")
    texts = [json.loads(line)["text"] for f in sorted(Path({corpus!r}).iterdir()) for line in open(f)]
    start, cpu0 = time.perf_counter(), cpu()
    for i in range(0, len(texts), 4096):
        tok.encode_batch(texts[i:i + 4096])
    print(json.dumps({{"wall": time.perf_counter() - start, "cpu": cpu() - cpu0}}))
""")


ALONE = textwrap.dedent("""
    import io, json, sys, time
    sys.path.insert(0, {root!r})
    from meshformer.data import load_tokenizer
    tok = load_tokenizer("bundled:kjv-bpe-4k")
    fmt, files = {fmt!r}, {files!r}
    cpu = time.process_time

    def texts():
        for f in files:
            if fmt == "parquet":
                import pyarrow.parquet as pq
                for batch in pq.ParquetFile(f).iter_batches(batch_size=4096, columns=["text"]):
                    yield from batch.column(0).to_pylist()
            elif fmt == "arrow":
                import pyarrow as pa
                for batch in pa.ipc.open_stream(pa.memory_map(f)):
                    yield from batch.column(0).to_pylist()
            else:
                import zstandard
                raw = zstandard.ZstdDecompressor().stream_reader(open(f, "rb")) if fmt == "zst" else open(f, "rb")
                for line in io.TextIOWrapper(raw, encoding="utf-8"):
                    yield json.loads(line)["text"]

    start, cpu0 = time.perf_counter(), cpu()
    batch = []
    for text in texts():
        batch.append(text)
        if len(batch) == 4096:
            tok.encode_batch(batch)
            batch = []
    tok.encode_batch(batch)
    print(json.dumps({{"wall": time.perf_counter() - start, "cpu": cpu() - cpu0}}))
""")


def write_formats(jsonl_dir: Path, root: Path, text_only: bool = False) -> dict[str, Path]:
    """The JSONL corpus in every format, file for file (Megatron and flat .bin: tokenized by the bundled BPE)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    sys.path.insert(0, str(ROOT))
    from meshformer.data import load_tokenizer

    tok = load_tokenizer("bundled:kjv-bpe-4k")
    out = {name: root / name for name in ("jsonl", "zst", "parquet", "arrow", "megatron", "flat")}
    for folder in out.values():
        folder.mkdir(parents=True)
    out["jsonl"] = jsonl_dir
    for f in sorted(jsonl_dir.iterdir()):
        data = f.read_bytes()
        texts = [json.loads(line)["text"] for line in data.decode().splitlines()]
        (out["zst"] / f"{f.stem}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
        table = pa.table({"text": texts})
        pq.write_table(table, out["parquet"] / f"{f.stem}.parquet", row_group_size=2048)
        with pa.OSFile(str(out["arrow"] / f"{f.stem}.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=1000)
        ids = tok.encode_batch(texts)
        lengths = np.array([len(d) for d in ids], dtype=np.int32)
        flat = np.array([t for d in ids for t in d], dtype=np.uint16)
        flat.tofile(out["megatron"] / f"{f.stem}.bin")
        write_megatron_index(out["megatron"] / f"{f.stem}.idx", lengths, np.uint16)
        np.array([t for d in ids for t in (*d, tok.eos_id)], dtype=np.uint16).tofile(out["flat"] / f"{f.stem}.bin")
    return out


def write_megatron_index(path: Path, lengths, dtype) -> None:
    """A Megatron MMIDIDX index, one sequence per document (the tests write theirs with megatron-core's builder;
    here the bench stays free of a megatron-core import)."""
    import struct

    import numpy as np

    n = len(lengths)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * np.dtype(dtype).itemsize)[:-1]])
    with open(path, "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
        fh.write(lengths.astype(np.int32).tobytes() + pointers.astype(np.int64).tobytes()
                 + np.arange(n + 1, dtype=np.int64).tobytes())


def formats(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.helpers.data import write_corpus

    result: dict = {"throughput": {}, "rss": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        c1 = write_corpus(tmp_path / "c1", args.mb, files=args.files)
        mb = sum(f.stat().st_size for f in c1.iterdir()) / 2**20
        corpora = write_formats(c1, tmp_path / "f1")
        kwargs = {"bucket_mb": args.bucket_mb, "num_proc": 1}
        jsonl_cpu = 0.0
        for fmt, folder in corpora.items():
            inputs = str(folder) if fmt != "flat" else sorted(str(p) for p in folder.iterdir())
            text = fmt in ("jsonl", "zst", "parquet", "arrow")
            prep, alone = [], []
            for r in range(args.repeat):  # alternating, the least CPU of each: a shared machine only adds time
                prep.append(run(RUN.format(root=str(ROOT), corpus=inputs, out=str(tmp_path / f"o-{fmt}-{r}"),
                                           kwargs=kwargs))["cpu"])
                if text:
                    files = sorted(str(p) for p in folder.iterdir())
                    alone.append(run(ALONE.format(root=str(ROOT), fmt=fmt, files=files))["cpu"])
            got = {"cpu": min(prep)}
            row = {"prepare_cpu_s": got["cpu"], "prepare_mb_cpu_s": mb / got["cpu"]}
            if text:
                row.update(alone_mb_cpu_s=mb / min(alone), ratio=min(alone) / got["cpu"])
                jsonl_cpu = got["cpu"] if fmt == "jsonl" else jsonl_cpu
            else:
                row.update(vs_jsonl_prepare=jsonl_cpu / got["cpu"])
            result["throughput"][fmt] = row
        c10 = write_corpus(tmp_path / "c10", 10 * args.mb, files=10 * args.files, seed=1)
        corpora10 = write_formats(c10, tmp_path / "f10", text_only=True)
        for fmt in ("jsonl", "zst", "parquet"):
            rss, growth = [], []
            for name, corpus in (("1x", corpora[fmt]), ("10x", corpora10[fmt])):
                got = run(RUN.format(root=str(ROOT), corpus=str(corpus), out=str(tmp_path / f"r-{fmt}-{name}"),
                                     kwargs={"bucket_mb": args.bucket_mb}), True)
                rss.append(got["rss_kb"] / 1024)
                growth.append(got["growth_kb"] / 1024)
            result["rss"][fmt] = {"rss_1x_mib": rss[0], "rss_10x_mib": rss[1], "ratio": rss[1] / rss[0],
                                  "growth_1x_mib": growth[0], "growth_10x_mib": growth[1]}
    result["corpus_mb"], result["load_avg"] = mb, os.getloadavg()[0]
    for fmt, row in result["throughput"].items():
        extra = (f"read + tokenize alone {row['alone_mb_cpu_s']:.2f} -> {row['ratio']:.2f}x" if "ratio" in row else
                 f"{row['vs_jsonl_prepare']:.2f}x the JSONL prepare's speed (no tokenizing)")
        print(f"{fmt:9s} prepare {row['prepare_mb_cpu_s']:.2f} MB of text per CPU-second; {extra}")
    for fmt, r in result["rss"].items():
        print(f"peak RSS {fmt}: 1x {r['rss_1x_mib']:.0f} MiB, 10x {r['rss_10x_mib']:.0f} MiB = {r['ratio']:.2f}x; "
              f"growth above the imports {r['growth_1x_mib']:.0f} -> {r['growth_10x_mib']:.0f} MiB")
    return result


def run(code: str, threads: bool = False) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true" if threads else "false", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def doc_gap(out: Path, total_docs: int) -> float:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from meshformer.data import load_tokenizer, read_manifest
    from meshformer.data.shards import read_shard

    tok, m = load_tokenizer("bundled:kjv-bpe-4k"), read_manifest(str(out))
    ids = []
    for info in m.splits["train"]:
        records = read_shard(m.shard_url(info), info, m.dtype, None)
        text = tok.decode([t for i in range(info.samples) for t in records[i]["tokens"].tolist()])
        ids += [int(w[:7]) for w in text.split("doc ")[1:] if w[:7].isdigit()]
    return float(np.mean(np.abs(np.diff(ids))) / total_docs)


TEXT_FORMATS = {"jsonl": "JSONL", "zst": "zstd JSONL", "parquet": "Parquet", "arrow": "Arrow"}


def table_rows(result: dict) -> list[list[str]]:
    """One row per text format (prepare's speed over reading and tokenizing alone), and one for the token formats
    (their prepare's speed over the JSONL prepare's)."""
    throughput = result["throughput"]
    rows = [[name, f"{throughput[fmt]['ratio']:.2f}×"] for fmt, name in TEXT_FORMATS.items() if fmt in throughput]
    tokens = [throughput[fmt]["vs_jsonl_prepare"] for fmt in ("megatron", "flat") if fmt in throughput]
    if tokens:
        low, high = round(min(tokens)), round(max(tokens))
        span = f"{low}–{high}" if low != high else f"{low}"
        rows.append(["Megatron .idx/.bin, flat token files",
                     f"{span}× faster than a JSONL prepare (nothing is tokenized)"])
    return rows


def rss_note(result: dict) -> str:
    growth = ", ".join(f"{TEXT_FORMATS[fmt]} {r['ratio']:.2f}×" for fmt, r in result["rss"].items())
    return f"Single runs scatter by ±0.3. Peak RSS from 1× to 10× the corpus: {growth}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=8, help="corpus size at 1x (10x is also measured)")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=4)
    ap.add_argument("--reference", default="", help="another checkout whose prepare to measure alongside")
    ap.add_argument("--json", default="")
    ap.add_argument("--formats", action="store_true", help="per input format (Parquet, zstd, Arrow, Megatron, .bin)")
    ap.add_argument("--repeat", type=int, default=1, help="--formats: runs per measurement (the least CPU counts)")
    add_table_arguments(ap)
    args = ap.parse_args()
    if args.formats:
        out = formats(args)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        if args.table:
            write_table(args.table, machine=args.machine, page="training", title="Data preparation per format",
                        command=f"python bench/data_prepare.py --formats --repeat {args.repeat}",
                        notes=rss_note(out), columns=["format", "prepare speed against reading and tokenizing the "
                                                                "format alone"], rows=table_rows(out))
        return
    if args.table:
        raise SystemExit("--table writes the per-format table: give --formats with it")
    sys.path.insert(0, str(ROOT))
    from tests.helpers.data import write_corpus

    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        c1 = write_corpus(tmp_path / "c1", args.mb, files=args.files)
        mb = sum(f.stat().st_size for f in c1.iterdir()) / 2**20
        ours = {"bucket_mb": args.bucket_mb}
        enc = run(ENCODE.format(root=str(ROOT), corpus=str(c1)))
        one = run(RUN.format(root=str(ROOT), corpus=str(c1), out=str(tmp_path / "o1"), kwargs={**ours, "num_proc": 1}))
        two = run(RUN.format(root=str(ROOT), corpus=str(c1), out=str(tmp_path / "o2"), kwargs={**ours, "num_proc": 2}))
        result["throughput"] = {"corpus_mb": mb, "encode_only_mb_cpu_s": mb / enc["cpu"],
                                "prepare_1proc_mb_cpu_s": mb / one["cpu"], "prepare_2proc_mb_cpu_s": mb / two["cpu"],
                                "wall_1proc_s": one["wall"], "wall_2proc_s": two["wall"],
                                "scaling_1_to_2": one["wall"] / two["wall"], "load_avg": os.getloadavg()[0]}
        total_docs = sum(1 for f in c1.iterdir() for _ in open(f))
        result["doc_gap"] = doc_gap(tmp_path / "o1", total_docs)
        c10 = write_corpus(tmp_path / "c10", 10 * args.mb, files=10 * args.files, seed=1)
        rss = {}
        for name, root, kwargs in [("this", ROOT, ours), ("reference", args.reference, {})]:
            if not root:
                continue
            r1 = run(RUN.format(root=str(root), corpus=str(c1), out=str(tmp_path / f"{name}1"), kwargs=kwargs), True)
            r10 = run(RUN.format(root=str(root), corpus=str(c10), out=str(tmp_path / f"{name}10"), kwargs=kwargs),
                      True)
            rss[name] = {"rss_1x_mib": r1["rss_kb"] / 1024, "rss_10x_mib": r10["rss_kb"] / 1024,
                         "ratio": r10["rss_kb"] / r1["rss_kb"], "mb_s_10x_threads": 10 * mb / r10["wall"]}
        result["rss"] = rss
    t = result["throughput"]
    print(f"corpus {t['corpus_mb']:.1f} MB, MB of text per CPU-second (per core): encode_batch alone "
          f"{t['encode_only_mb_cpu_s']:.2f}; prepare 1 process {t['prepare_1proc_mb_cpu_s']:.2f} "
          f"({t['prepare_1proc_mb_cpu_s'] / t['encode_only_mb_cpu_s']:.2f}x of encode alone); 2 processes "
          f"{t['prepare_2proc_mb_cpu_s']:.2f}. Wall 1 -> 2 processes: {t['wall_1proc_s']:.1f}s -> "
          f"{t['wall_2proc_s']:.1f}s = {t['scaling_1_to_2']:.2f}x (load average {t['load_avg']:.1f})")
    for name, r in result["rss"].items():
        print(f"peak RSS ({name}): 1x {r['rss_1x_mib']:.0f} MiB, 10x {r['rss_10x_mib']:.0f} MiB = {r['ratio']:.2f}x")
    print(f"shuffle quality: mean gap between consecutive documents {result['doc_gap']:.3f} of the corpus "
          "(global shuffle 0.333)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
