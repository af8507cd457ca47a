"""The `meshformer data prepare` and `meshformer data submit-prepare` commands."""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from meshformer.errors import ArgumentParser, UsageError, run_command

from .submit import SUBMIT_PREPARE_DESCRIPTION, part_from_env, submit_prepare

if TYPE_CHECKING:
    from .shards import Manifest

PREPARE_DESCRIPTION = """\
Read a corpus (text, JSONL, Parquet, Arrow, Megatron .idx/.bin, token arrays; a file, a folder or a glob), train or
load a tokenizer, and write tokenized WebDataset shards with a manifest into --out. It ends with the command that
trains on the result (`train with: meshformer train tiny-gpt --set ...`).

examples:
  meshformer data prepare bundled:kjv --out data/kjv --tokenizer train --vocab-size 4096 --seq-len 128
  meshformer data prepare my_corpus/ --out data/mine --tokenizer gpt2
  meshformer data prepare pairs.jsonl --pairs --out data/pairs --tokenizer bundled:kjv-bpe-4k
  meshformer data prepare fineweb/*.parquet --out data/fw --tokenizer hf/llama3/ --text-field text
  meshformer data prepare megatron/my_text_document --out data/mt --tokenizer hf/gpt2/   # token ids kept

a large corpus over several machines (any number of parts gives the same output):
  meshformer data prepare corpus/ --out data/big --tokenizer tok.json --part 0/4 --stage map      # and parts 1-3
  meshformer data prepare corpus/ --out data/big --tokenizer tok.json --part 0/4 --stage reduce   # and parts 1-3
  meshformer data prepare corpus/ --out data/big --tokenizer tok.json --stage merge
  meshformer data submit-prepare corpus/ --out data/big --tokenizer tok.json --parts 16   # the same on SLURM
"""

_PART_OR_NUMBER = re.compile(r"^-\d+(/\d+)?$|^-\d*\.\d+$")  # argparse's negative numbers, and -i/N


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    data = subparsers.add_parser("data", help="prepare training data")
    sub = data.add_subparsers(dest="data_command", required=True)
    p = sub.add_parser("prepare", help="corpus -> tokenizer -> WebDataset shards + manifest",
                       description=PREPARE_DESCRIPTION)
    _prepare_arguments(p)
    p._negative_number_matcher = _PART_OR_NUMBER  # `--part -1/2` is a (wrong) value, not an unknown option
    p.add_argument("--part", default="0/1",
                   help="i/N: this process's slice of the stage (any N gives the same output), or 'slurm' for "
                        "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT")
    p.add_argument("--stage", choices=["all", "map", "reduce", "merge"], default="all",
                   help="with --part i/N: map on every part, then reduce on every part, then merge once")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_prepare)
    s = sub.add_parser("submit-prepare", help="run a prepare as SLURM array jobs (map, reduce, merge)",
                       description=SUBMIT_PREPARE_DESCRIPTION)
    _prepare_arguments(s)
    s.add_argument("--parts", type=int, required=True, help="array tasks per stage (machines sharing the work)")
    s.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="extra #SBATCH option for every job, e.g. --sbatch=--partition=cpu (repeatable)")
    s.add_argument("--dry-run", action="store_true", help="print the three batch scripts, submit nothing")
    s.set_defaults(func=run_submit_prepare)
    return data


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+",
                   help="text/JSONL files (.gz, .zst ok), Parquet, Arrow, datasets folders, Megatron .idx/.bin "
                        "datasets (or their prefix), flat .bin / .npy token files, directories, or bundled:kjv")
    p.add_argument("--out", required=True, help="output folder for shards, tokenizer.json and manifest.json")
    p.add_argument("--tokenizer", default="train",
                   help="'train' (byte-level BPE on the input), 'gpt2', 'bundled:kjv-bpe-4k', a tokenizer.json or a "
                        "Hugging Face tokenizer folder (pre-tokenized inputs: the tokenizer of their ids)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary when --tokenizer train")
    p.add_argument("--seq-len", type=int, default=128, help="training sequence length; records hold seq-len + 1")
    p.add_argument("--record-len", type=int, default=None, help="tokens per record (overrides --seq-len + 1)")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet or Arrow column holding the text")
    p.add_argument("--token-dtype", choices=["auto", "uint16", "uint32"], default="auto",
                   help="token type of flat .bin files (auto: uint16 up to 65536 tokens, else uint32)")
    p.add_argument("--doc-split", choices=["file", "paragraph", "line"], default="file",
                   help="what counts as one document in plain-text files")
    p.add_argument("--include", action="append", metavar="GLOB",
                   help="read exactly the files of input folders that match (name or path in the folder; "
                        "repeatable), e.g. --include '*' or --include '*.log' (default: files named as a corpus "
                        "format or recognised by content; other text files are an error)")
    p.add_argument("--follow-links", action="store_true",
                   help="read files of input folders that links take outside the folder (default: refused; a "
                        "corpus folder is what lies in it)")
    p.add_argument("--pairs", action="store_true", help="JSONL source/target pairs for seq2seq")
    p.add_argument("--src-field", default="src", help="JSONL field of the source text (translation pairs)")
    p.add_argument("--tgt-field", default="tgt", help="JSONL field of the target text (translation pairs)")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="share of documents held out")
    p.add_argument("--seed", type=int, default=1234, help="document shuffle seed")
    p.add_argument("--shard-records", type=int, default=None, help="records per shard (default ~16M tokens)")
    p.add_argument("--bucket-mb", type=float, default=128,
                   help="input text per shuffle bucket (reduce memory is about 2-3x this)")
    p.add_argument("--num-proc", type=int, default=0, help="processes for tokenizing/packing (0: in-process)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")


_FORWARDED = ("tokenizer", "vocab_size", "seq_len", "record_len", "text_field", "doc_split", "src_field", "tgt_field",
              "eval_fraction", "seed", "shard_records", "bucket_mb", "num_proc", "token_dtype", "include")
_FLAGS = ("pairs", "overwrite", "follow_links")


def _parse_part(spec: str) -> tuple[int, int]:
    if spec == "slurm":
        return part_from_env()
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        raise UsageError(f"--part {spec!r} is not a part", "write i/N (e.g. 0/4) or 'slurm'") from None
    return index, count


def run_prepare(args: argparse.Namespace) -> int:
    from .prepare import prepare  # torch: imported when a prepare runs, not for --help

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    manifest = prepare(args.inputs, args.out, part=_parse_part(args.part), stage=args.stage,
                       progress=not args.quiet, **{k: getattr(args, k) for k in (*_FORWARDED, *_FLAGS)})
    if manifest is None:
        print(f"done: stage {args.stage} of part {args.part} for {args.out}")
        return 0
    train = manifest.splits["train"]
    print(f"wrote {manifest.url}: {len(train)} train shards, {sum(s.samples for s in train)} records, "
          f"{sum(s.tokens for s in train)} tokens, tokenizer sha256 {manifest.tokenizer['sha256'][:12]}")
    print(f"train with: {train_command(manifest, args.out)}")
    return 0


def train_command(manifest: Manifest, out: str) -> str:
    """The command that trains a bundled tiny model on a prepared dataset as it stands: every key the run needs
    (the tokenizer's vocabulary, the records' length), in a run folder of its own (not the quick-start's)."""
    vocab = manifest.tokenizer["vocab_size"]
    keys = [f"data.shards={manifest.url}", f"data.tokenizer={manifest.base}/{manifest.tokenizer['file']}",
            f"model.vocab_size={vocab}"]
    if manifest.record_type == "packed":  # causal LM: records hold seq_len + 1 tokens
        seq_len = manifest.record_len - 1
        keys += [f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}"]
    keys.append(f"logging.run_dir=runs/{Path(out).resolve().name}")
    config = "tiny-gpt" if manifest.record_type == "packed" else "tiny-t5"
    return shlex.join(["meshformer", "train", config, "--set", *keys])


def run_submit_prepare(args: argparse.Namespace) -> int:
    from .prepare import check_numbers, check_output_folder

    check_output_folder(args.inputs, Path(args.out), args.overwrite)  # refused now, not in every array task
    check_numbers(**{k: getattr(args, k) for k in ("eval_fraction", "seq_len", "record_len", "vocab_size", "seed",
                                                   "shard_records", "bucket_mb", "num_proc")})
    forwarded = [*args.inputs, "--out", str(Path(args.out).resolve())]
    for key in _FORWARDED:
        value = getattr(args, key)
        for one in value if isinstance(value, list) else [] if value is None else [value]:
            forwarded += [f"--{key.replace('_', '-')}", str(one)]
    forwarded += [f"--{key.replace('_', '-')}" for key in _FLAGS if getattr(args, key)]
    result = submit_prepare(forwarded, args.out, args.parts, args.sbatch, dry_run=args.dry_run)
    if args.dry_run:
        print("\n".join(result))
    else:
        print(f"submitted map {result[0]}, reduce {result[1]}, merge {result[2]}; the manifest appears at "
              f"{Path(args.out).resolve()}/manifest.json when the merge job ends")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="meshformer")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
