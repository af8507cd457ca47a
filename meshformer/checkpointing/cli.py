"""The `meshformer convert` commands: checkpoints, safetensors weights, Hugging Face and Megatron-Core folders."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.checkpointing.formats import ARCHS, DEFAULT_MAX_SHARD_SIZE, INDEX_FILE, SINGLE_FILE
from meshformer.errors import UsageError
from meshformer.folders import check_output, remove, replace, scratch

if TYPE_CHECKING:  # torch and the converters: imported when a conversion runs, not for --help
    import torch

    from meshformer.config import ModelConfig
    from meshformer.data import Tokenizer

WEIGHTS, CHECKPOINTS = "model weights", "checkpoints"
HF_EXTRA = "pip install 'meshformer[hf]'"


def _shard_size(text: str) -> str:
    from meshformer.config import parse_size

    try:
        size = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size; write e.g. 5GB, 500MB or 2GiB")
    return text


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small; use a value >= {minimum}")
        return value
    return parse


def _weights_legacy(folder: Path, *beside: str) -> list[str]:
    """The files an older meshformer left in a folder it wrote weights to (no marker then)."""
    return [INDEX_FILE if (folder / INDEX_FILE).is_file() else SINGLE_FILE, *beside]


def _into(args: argparse.Namespace, what: str, legacy: list[str], write: Callable[[Path], Path]) -> Path:
    """Run `write` into a scratch folder beside `args.out` and swap it in when done: an existing output is
    replaced only as `check_output` allows (checked before any work), and never left half-written."""
    out, src = Path(args.out), Path(args.src)
    if what == CHECKPOINTS and not args.overwrite:
        from meshformer.checkpointing.safetensors_io import refuse_existing_checkpoints

        refuse_existing_checkpoints(out, "write the weights-only checkpoint into an empty folder, or pass "
                                    "--overwrite to replace them")
    check_output(out, what=what, overwrite=args.overwrite, inputs=[src], legacy=legacy)
    staged = scratch(out.resolve().with_name(out.resolve().name + ".partial"), what)
    try:
        written = write(staged)
    except BaseException:
        remove(staged)
        raise
    replace(staged, out)
    return out / written.relative_to(staged)


def _write(args: argparse.Namespace, cfg: ModelConfig, state: Mapping[str, torch.Tensor],
           tokenizer: Tokenizer | None = None) -> Path:
    """A weights folder or (--checkpoint) a weights-only checkpoint, written tensor by tensor as `state` is read."""
    from meshformer.checkpointing.safetensors_io import write_weights_checkpoint
    from meshformer.checkpointing.weights import CONFIG_FILE, write_weights

    if args.checkpoint:
        return _into(args, CHECKPOINTS, ["latest"], lambda out: write_weights_checkpoint(state, cfg, out, tokenizer))
    return _into(args, WEIGHTS, _weights_legacy(Path(args.out), CONFIG_FILE),
                 lambda out: write_weights(state, cfg, out, args.max_shard_size, tokenizer))


def _source_tokenizer(args: argparse.Namespace) -> Tokenizer | None:
    """The tokenizer that goes with the output: the one saved in SRC (a weights folder or checkpoint), or
    --tokenizer if it is the same one or SRC has none (older runs); None when there is neither (tools reading the
    output then ask for --tokenizer)."""
    from meshformer.checkpointing import directory
    from meshformer.checkpointing.manifest import MANIFEST
    from meshformer.checkpointing.sharded_safetensors import has_safetensors
    from meshformer.checkpointing.weights import CONFIG_FILE, TOKENIZER_FILE, refuse_other_tokenizer, weights_tokenizer
    from meshformer.data import load_tokenizer

    src = Path(args.src)
    if has_safetensors(src) and (src / CONFIG_FILE).is_file():
        return weights_tokenizer(src, args.tokenizer) if args.tokenizer or (src / TOKENIZER_FILE).is_file() else None
    given = load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
    # the step the conversion reads (its manifest is verified there, not twice); the run's tokenizer is the same
    # in each of its steps
    steps = directory.committed_steps(src)
    step = src / directory.step_dir_name(steps[-1]) if steps and not (src / MANIFEST).is_file() else src
    if not (step / TOKENIZER_FILE).is_file():  # a checkpoint of an older run
        return given
    saved = load_tokenizer(str(step / TOKENIZER_FILE))
    if given is not None:
        refuse_other_tokenizer(given, saved.fingerprint, step, args.tokenizer, "--tokenizer")
    return saved


def _to_safetensors(args: argparse.Namespace) -> Path:
    from meshformer.checkpointing.safetensors_io import checkpoint_to_safetensors
    from meshformer.checkpointing.weights import CONFIG_FILE

    return _into(args, WEIGHTS, _weights_legacy(Path(args.out), CONFIG_FILE),
                 lambda out: checkpoint_to_safetensors(Path(args.src), out, show_progress=None,
                                                       max_shard_size=args.max_shard_size,
                                                       tokenizer=_source_tokenizer(args)))


def _to_checkpoint(args: argparse.Namespace) -> Path:
    from meshformer.checkpointing.safetensors_io import safetensors_to_checkpoint

    return _into(args, CHECKPOINTS, ["latest"],
                 lambda out: safetensors_to_checkpoint(Path(args.src), out, _source_tokenizer(args)))


def _require_transformers(command: str) -> None:
    try:
        import transformers  # noqa: F401 (only whether it is installed)
    except ImportError:
        raise UsageError(f"`meshformer convert {command}` needs Hugging Face transformers, which is not installed",
                         f"install it: {HF_EXTRA}") from None


def _export_hf(args: argparse.Namespace) -> Path:
    from meshformer.checkpointing.hf_folder import export_hf
    from meshformer.checkpointing.init_from import source_arch, source_config
    from meshformer.checkpointing.safetensors_io import read_model_source
    from meshformer.data.tokenizer import check_vocab

    _require_transformers("export-hf")

    def write(out: Path) -> Path:
        cfg, state = read_model_source(Path(args.src))
        tokenizer = _source_tokenizer(args)
        if tokenizer is not None:
            check_vocab(tokenizer, cfg.vocab_size, "--tokenizer")
        # default: the architecture a run from checkpoint.init_from started from, else the one that matches
        arch = args.arch or source_arch(Path(args.src))
        written = export_hf(state, cfg, out, arch, args.max_shard_size, tokenizer, source_config(Path(args.src)))
        if tokenizer is None:  # the export loads as a model; say why AutoTokenizer will not
            print(f"note: {args.src} carries no tokenizer, so the export has none; pass --tokenizer with the one the "
                  "model was trained with to include it", file=sys.stderr)
        return written

    return _into(args, "a Hugging Face model", _weights_legacy(Path(args.out), "config.json"), write)


def _import_hf(args: argparse.Namespace) -> Path:
    import torch

    from meshformer.checkpointing.hf_folder import import_hf
    from meshformer.data import load_tokenizer

    _require_transformers("import-hf")
    cfg, state = import_hf(Path(args.src), follow_links=args.follow_links,
                           dequantize_to=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    # the folder's own tokenizer (tokenizer.json + tokenizer_config.json) travels into the weights folder
    tokenizer = load_tokenizer(args.src) if (Path(args.src) / "tokenizer.json").is_file() else None
    if args.checkpoint:
        return _write(args, cfg, state, tokenizer)
    from meshformer.checkpointing.init_from import write_source
    from meshformer.checkpointing.weights import CONFIG_FILE, write_weights

    def write(out: Path) -> Path:
        written = write_weights(state, cfg, out, args.max_shard_size, tokenizer)
        # beside the weights: the folder's architecture and config.json, which export-hf writes back
        write_source(out, Path(args.src), json.loads((Path(args.src) / "config.json").read_text())["model_type"])
        return written

    return _into(args, WEIGHTS, _weights_legacy(Path(args.out), CONFIG_FILE), write)


def _export_megatron(args: argparse.Namespace) -> Path:
    from meshformer.checkpointing.megatron import WRITTEN_BESIDE, export_megatron
    from meshformer.checkpointing.safetensors_io import read_model_source

    def write(out: Path) -> Path:
        cfg, state = read_model_source(Path(args.src))
        return export_megatron(state, cfg, out, iteration=args.iteration, pad_vocab_multiple=args.pad_vocab_multiple)

    return _into(args, "a Megatron checkpoint", list(WRITTEN_BESIDE), write)


def _import_megatron(args: argparse.Namespace) -> Path:
    from meshformer.checkpointing.megatron import import_megatron

    cfg, state = import_megatron(Path(args.src), n_heads=args.heads, vocab_size=args.vocab_size,
                                 activation=args.activation, norm_eps=args.norm_eps, rope_theta=args.rope_theta,
                                 max_seq_len=args.max_seq_len, experts_per_token=args.experts_per_token,
                                 router_score=args.router_score, router_groups=args.router_groups,
                                 router_groups_per_token=args.router_groups_per_token)
    return _write(args, cfg, state)


def _verify(args: argparse.Namespace) -> Path:
    from meshformer.checkpointing import directory
    from meshformer.checkpointing.manifest import verify_manifest

    root = Path(args.src)
    folders = [root] if (root / "manifest.json").is_file() else [
        root / directory.step_dir_name(s) for s in directory.committed_steps(root)]
    bad = 0
    for folder in folders:
        try:
            verify_manifest(folder, "sha256")
            print(f"ok       {folder}")
        except CheckpointError as err:
            bad += 1
            print(f"CORRUPT  {folder}: {err}")
    for partial in directory.partial_dirs(root):
        print(f"partial  {partial} (incomplete save; ignored by resume)")
    for deleting in directory.deleting_dirs(root):
        print(f"deleting {deleting} (interrupted removal by retention; ignored, removed at the next start)")
    if not folders:
        raise CheckpointError(f"{root} holds no committed checkpoints", "pass a checkpoint.dir or one step folder")
    if bad:
        raise CheckpointError(f"{bad} of {len(folders)} checkpoints failed verification",
                              "restore them from a copy, or delete them to resume from an older step")
    return root

CONVERT_DESCRIPTION = """\
Convert between training checkpoints, safetensors weights, Hugging Face folders and Megatron-Core checkpoints,
or verify a checkpoint folder.

examples:
  meshformer convert to-safetensors runs/x/checkpoints runs/x/export        # the newest valid step
  meshformer convert to-checkpoint  runs/x/export runs/y/checkpoints        # a weights-only step 0
  meshformer convert export-hf      runs/x/export hf/x [--arch MODEL_TYPE]
  meshformer convert import-hf      hf/x runs/y/checkpoints --checkpoint
  meshformer convert export-megatron runs/x/export mcore/ [--pad-vocab-multiple 128]
  meshformer convert import-megatron mcore/ runs/y/export [--heads 12 --vocab-size 50257]
  meshformer convert verify         runs/x/checkpoints

SRC of the export commands is a weights folder (model.safetensors, or model-*-of-*.safetensors shards with
model.safetensors.index.json, + model_config.json), a checkpoint step folder, or a checkpoint directory.
Imports write a weights folder, or with --checkpoint a weights-only checkpoint that `train` resumes from
(fresh optimizer) when checkpoint.dir points at it. Conversions stream: one tensor in memory at a time (plus,
when writing safetensors, at most one output file's worth: --max-shard-size).

OUT is written as OUT.partial beside it and renamed into place when complete. An existing OUT that is not
empty is replaced only with --overwrite; OUT may never be SRC, hold it, or lie inside it.
"""


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    convert = subparsers.add_parser("convert", help="convert checkpoints: safetensors, Hugging Face, Megatron-Core",
                                    description=CONVERT_DESCRIPTION)
    sub = convert.add_subparsers(dest="conversion", required=True)

    def command(name: str, func, help_text: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help_text)
        parser.add_argument("src", help="the folder to read (a run's checkpoints/export, an HF or Megatron folder)")
        if name != "verify":
            parser.add_argument("out", help="the folder to write (replaced only with --overwrite)")
        if name in ("to-safetensors", "export-hf", "import-hf", "import-megatron"):
            parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, type=_shard_size,
                                help="largest safetensors file written (e.g. 5GB, 500MB; HF-style shards + index "
                                     f"beyond it; default {DEFAULT_MAX_SHARD_SIZE})")
        if name in ("to-safetensors", "to-checkpoint", "export-hf"):
            parser.add_argument("--tokenizer", help="the tokenizer the model was trained with, written with the "
                                "output; default: the one saved with SRC (its weights or checkpoint)")
        if name != "verify":
            parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (it may not be, "
                                "hold or lie inside SRC)")
        parser.set_defaults(func=lambda args: _run(func, args))
        return parser

    command("to-safetensors", _to_safetensors, "sharded checkpoint -> model.safetensors + model_config.json")
    command("to-checkpoint", _to_checkpoint, "weights folder -> weights-only sharded checkpoint (training starts "
            "from it at step 0)")
    command("export-hf", _export_hf, f"-> Hugging Face folder ({', '.join(ARCHS)})").add_argument(
        "--arch", choices=ARCHS, help="a Hugging Face model_type (default: the one matching the model config)")
    hf_in = command("import-hf", _import_hf, "Hugging Face folder -> weights folder")
    hf_in.add_argument("--checkpoint", action="store_true", help="write a weights-only checkpoint instead of a "
                       "weights folder")
    hf_in.add_argument("--follow-links", action="store_true", help="read files that links take outside SRC (default: "
                       "refused, except a Hugging Face hub cache snapshot's links into its blobs/)")
    hf_in.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the dtype a quantized folder's "
                       "FP8 / MXFP4 weights are dequantized to (the training dtype; unquantized tensors keep theirs)")
    megatron_out = command("export-megatron", _export_megatron, "-> Megatron-Core torch_dist GPT checkpoint")
    megatron_out.add_argument("--iteration", type=_count(0), default=0, help="the iter_<N> folder to write")
    megatron_out.add_argument("--pad-vocab-multiple", type=_count(1), default=1,
                              help="pad the vocabulary as Megatron does (make_vocab_size_divisible_by x TP)")
    megatron_in = command("import-megatron", _import_megatron, "Megatron-Core torch_dist GPT checkpoint -> weights")
    megatron_in.add_argument("--heads", type=_count(1), help="attention heads (not stored in tensors); default: from "
                             "the meshformer_model_config.json that export-megatron writes, required without one")
    megatron_in.add_argument("--vocab-size", type=_count(1), help="true vocabulary; default: Megatron's padded size")
    megatron_in.add_argument("--activation", choices=["gelu", "gelu_tanh", "relu", "swiglu"],
                             help="non-gated MLP activation (default gelu; gated checkpoints are swiglu)")
    megatron_in.add_argument("--norm-eps", type=float, help="default: the saved config's, else 1e-5")
    megatron_in.add_argument("--rope-theta", type=float, help="default: the saved config's, else 10000")
    megatron_in.add_argument("--max-seq-len", type=_count(1), help="RoPE models: the context length to record")
    megatron_in.add_argument("--experts-per-token", type=_count(1), help="MoE: the router's top-k (not stored in "
                             "tensors; Megatron's --moe-router-topk); default: the saved config's")
    megatron_in.add_argument("--router-score", choices=["softmax", "sigmoid"], help="MoE: default the saved "
                             "config's, else sigmoid where routers carry a bias (Megatron allows it only there)")
    megatron_in.add_argument("--router-groups", type=_count(1), help="MoE: group-limited routing's expert groups "
                             "(not stored in tensors; Megatron's --moe-router-num-groups); default: the saved "
                             "config's, else 1 (no groups)")
    megatron_in.add_argument("--router-groups-per-token", type=_count(1), help="MoE: the groups each token keeps "
                             "(Megatron's --moe-router-group-topk); default: the saved config's, else 1")
    megatron_in.add_argument("--checkpoint", action="store_true", help="write a weights-only checkpoint")
    command("verify", _verify, "check every checkpoint's files against its manifest (sizes and sha256)")


def _run(func, args: argparse.Namespace) -> None:
    path = func(args)
    print(f"wrote {path}" if args.conversion != "verify" else "all checkpoints verified")
