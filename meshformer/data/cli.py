"""`meshformer data prepare ...`: registered on the main CLI by `add_cli(subparsers)`.

    meshformer data prepare bundled:kjv --out data/kjv --tokenizer train --vocab-size 4096 --seq-len 128
    meshformer data prepare /usr/share/doc/python3.11/html/_sources --out data/pydocs --tokenizer gpt2
    meshformer data prepare pairs.jsonl --pairs --out data/pairs --tokenizer bundled:kjv-bpe-4k
Then train with `data.shards=<out>` and `data.tokenizer=<out>/tokenizer.json`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from meshformer.errors import ArgumentParser, run_command

from .prepare import prepare


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    data = subparsers.add_parser("data", help="prepare training data")
    sub = data.add_subparsers(dest="data_command", required=True)
    p = sub.add_parser("prepare", help="corpus -> tokenizer -> WebDataset shards + manifest",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text/JSONL files (.gz ok), directories, or bundled:kjv")
    p.add_argument("--out", required=True, help="output folder for shards, tokenizer.json and manifest.json")
    p.add_argument("--tokenizer", default="train",
                   help="'train' (byte-level BPE on the input), 'gpt2', 'bundled:kjv-bpe-4k' or a tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary when --tokenizer train")
    p.add_argument("--seq-len", type=int, default=128, help="training sequence length; records hold seq-len + 1")
    p.add_argument("--record-len", type=int, default=None, help="tokens per record (overrides --seq-len + 1)")
    p.add_argument("--text-field", default="text", help="JSONL field holding the document text")
    p.add_argument("--doc-split", choices=["file", "paragraph", "line"], default="file",
                   help="what counts as one document in plain-text files")
    p.add_argument("--pairs", action="store_true", help="JSONL source/target pairs for seq2seq")
    p.add_argument("--src-field", default="src")
    p.add_argument("--tgt-field", default="tgt")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="share of documents held out")
    p.add_argument("--seed", type=int, default=1234, help="document shuffle seed")
    p.add_argument("--shard-records", type=int, default=None, help="records per shard (default ~16M tokens)")
    p.add_argument("--num-proc", type=int, default=0, help="tokenizer processes (0: in-process, multithreaded)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_prepare)
    return data


def run_prepare(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    manifest = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       seq_len=args.seq_len, record_len=args.record_len, text_field=args.text_field,
                       pairs=args.pairs, src_field=args.src_field, tgt_field=args.tgt_field,
                       doc_split=args.doc_split, eval_fraction=args.eval_fraction, seed=args.seed,
                       shard_records=args.shard_records, num_proc=args.num_proc, progress=not args.quiet,
                       overwrite=args.overwrite)
    train = manifest.splits["train"]
    print(f"wrote {manifest.url}: {len(train)} train shards, {sum(s.samples for s in train)} records, "
          f"{sum(s.tokens for s in train)} tokens, tokenizer sha256 {manifest.tokenizer['sha256'][:12]}")
    print(f"train with: data.shards={manifest.url} data.tokenizer={manifest.base}/tokenizer.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="meshformer")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
