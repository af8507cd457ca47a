"""The `meshformer` command: train, generate, inspect, prepare data, convert checkpoints, plan memory."""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import sys
from pathlib import Path

from meshformer.errors import DEBUG_ENV, ArgumentParser, UsageError, run_command
from meshformer.launcher import cli as launcher_cli  # light: its commands import what they need when they run

CONFIG_HELP = "bundled config name (`meshformer config list`) or TOML file"
INIT_FROM_CONFIG = "continue-hf"  # `train --init-from PATH` without a config: the bundled continued-pretraining run

# Command groups whose modules import torch: imported only when the command line names one, so that `--help` and
# `--version` start at once. command -> (module with add_cli, its line in `meshformer --help`).
LAZY_COMMANDS = {
    "data": ("meshformer.data.cli", "prepare training data"),
    "convert": ("meshformer.checkpointing.cli", "convert checkpoints: safetensors, Hugging Face, Megatron-Core"),
    "plan": ("meshformer.planner.cli", "memory per rank of a layout at any world size, and the layouts that fit"),
    "eval": ("meshformer.eval.cli", "score lm-eval tasks (offline) with a run's weights or a folder"),
}

TOKENIZER_HELP = ("default: the tokenizer saved with the weights (WEIGHTS/tokenizer.json); another one is refused "
                  "unless it is the same tokenizer")


def _train(args: argparse.Namespace) -> None:
    from meshformer.config import load_config
    from meshformer.launcher.torchrun import check_launch_options, check_rdzv_endpoint, launch_torchrun

    check_launch_options(args.nproc_per_node, args.nnodes, args.max_restarts)
    if args.nnodes > 1:  # one node: torchrun --standalone picks its own endpoint
        check_rdzv_endpoint(args.rdzv_endpoint)
    overrides = args.set
    if args.config is None:
        if not args.init_from:
            raise UsageError("train needs a config", "name one (`meshformer config list`), e.g. `meshformer train "
                             "tiny-gpt`, or pass --init-from HF_FOLDER to continue a Hugging Face model")
        # the folder's model and tokenizer, the bundled run settings, a run folder named after the model's folder
        args.config = INIT_FROM_CONFIG
        overrides = [f"logging.run_dir=runs/{Path(args.init_from).expanduser().resolve().name}", *overrides]
    if args.init_from:
        overrides = [*overrides, f"checkpoint.init_from=hf:{args.init_from}"]
    elif args.config == INIT_FROM_CONFIG and not any(o.startswith("checkpoint.init_from=") for o in overrides):
        raise UsageError(f"{INIT_FROM_CONFIG} continues a Hugging Face model and has no model of its own",
                         "pass --init-from HF_FOLDER (or no config: `meshformer train --init-from HF_FOLDER`)")
    if args.new_run:  # a fresh run beside the one in logging.run_dir, which stays as it is
        from meshformer.train.run_record import new_run_overrides

        overrides, fresh = new_run_overrides(load_config(args.config, overrides), overrides)
        print(f"--new-run: this run goes into {fresh}", file=sys.stderr)
    if args.replica_groups:
        _train_replica_groups(args, overrides)
        return
    if args.nproc_per_node > 1 or args.nnodes > 1:
        from meshformer.checkpointing.init_from import resolve_init_from
        from meshformer.parallel_dims import validate_parallel
        from meshformer.train.preflight import preflight, run_folders_claimed

        # one process checks before torchrun starts any rank
        cfg = resolve_init_from(load_config(args.config, overrides))
        validate_parallel(cfg, args.nproc_per_node * args.nnodes)
        with run_folders_claimed(cfg):  # a run folder in use is refused here; rank 0 holds it for the job
            preflight(cfg)
        if args.debug:
            os.environ[DEBUG_ENV] = "1"  # the ranks show tracebacks too (this process exits after torchrun)
        from meshformer.launcher.torchrun import stop_grace_s
        from meshformer.model.flops import count_params

        grace_s = stop_grace_s(cfg.checkpoint.stop_grace_s, count_params(cfg.model)["total"], args.nnodes)
        sys.exit(launch_torchrun(args.config, overrides, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                                 rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts, grace_s=grace_s))
    from meshformer.train.__main__ import run

    run(args.config, overrides)


def _params(args: argparse.Namespace) -> None:
    from meshformer.config import load_config
    from meshformer.model.flops import count_params, flops_per_token

    cfg = load_config(args.config, args.set)
    counts = count_params(cfg.model)
    report: dict[str, float] = {f"{key}_params": value for key, value in counts.items()}
    report["flops_per_token"] = flops_per_token(cfg.model, cfg.data.seq_len, cfg.data.target_len)
    report["seq_len"] = cfg.data.seq_len
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>22}: {value:,}" if isinstance(value, int) else f"{key:>22}: {value:,.4g}")


def _prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of `generate`: each --prompt, then each non-empty line of --prompts-file."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            text = open(args.prompts_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"--prompts-file {args.prompts_file}: {err}", "pass a UTF-8 text file, one prompt a line"
                             ) from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError("no prompt to continue", "pass --prompt TEXT (repeat it for several) or --prompts-file")
    return prompts


def _generate(args: argparse.Namespace) -> None:
    from meshformer.checkpointing.weights import load_for_inference
    from meshformer.model.generate import greedy_decode, pad_rows

    prompts = _prompts(args)
    model, tokenizer = load_for_inference(args.weights, args.tokenizer)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens={args.max_new_tokens}", "ask for at least 1 new token")
    if not model.spec.has_decoder:
        raise UsageError(f"{args.weights} holds an encoder-only model, which cannot generate text",
                         "pass the weights of a decoder-only or encoder-decoder model")
    rows = [tokenizer.encode_prompt(prompt) for prompt in prompts]  # BOS where the tokenizer adds one
    for prompt, row in zip(prompts, rows, strict=True):
        if not row:
            raise UsageError(f"--prompt {prompt!r} holds no tokens", "pass some text, e.g. --prompt 'In the beginning'")
    seq2seq = model.spec.seq2seq
    ids, padding = pad_rows(rows, tokenizer.pad_id, left=not seq2seq)  # sources: padded on the right, as in training
    if not seq2seq:
        out = greedy_decode(model, ids, args.max_new_tokens, eos_id=tokenizer.eos_id, prompt_padding=padding,
                            use_cache=not args.no_cache)
    else:
        out = greedy_decode(model, None, args.max_new_tokens, eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id,
                            source_ids=ids, source_padding=padding, use_cache=not args.no_cache)
    for prompt_ids, row in zip(rows, out.tolist(), strict=True):
        new = row[0 if seq2seq else ids.shape[1]:]
        if tokenizer.eos_id in new:  # the text ends at the model's EOS
            new = new[:new.index(tokenizer.eos_id)]
        print(tokenizer.decode(([] if seq2seq else prompt_ids) + new, skip_special_tokens=True))


def _attention_map(args: argparse.Namespace) -> None:
    import torch

    from meshformer.checkpointing.weights import load_for_inference
    from meshformer.model.inspect import attention_heatmap

    model, tokenizer = load_for_inference(args.weights, args.tokenizer)
    ids = tokenizer.encode(args.text)
    labels = [tokenizer.decode([i]) for i in ids]
    decoder_ids = decoder_labels = None
    if model.spec.seq2seq:
        target = [tokenizer.bos_id, *tokenizer.encode(args.target or args.text)]
        decoder_ids, decoder_labels = torch.tensor([target]), [tokenizer.decode([i]) for i in target]
    path = attention_heatmap(model, torch.tensor([ids]), args.out, layer=args.layer, head=args.head,
                             stack=args.stack, tokens=labels, decoder_input_ids=decoder_ids,
                             decoder_tokens=decoder_labels)
    print(f"wrote {path}")


def _grad_report(args: argparse.Namespace) -> None:
    import torch

    from meshformer.batch import model_inputs
    from meshformer.checkpointing.weights import load_weights, weights_tokenizer
    from meshformer.config import load_config
    from meshformer.data import build_loader, load_tokenizer
    from meshformer.loss.cross_entropy import count_tokens, cross_entropy_sum
    from meshformer.model import Transformer
    from meshformer.model.inspect import gradient_report

    cfg = load_config(args.config, [*args.set, "data.num_workers=0"])
    torch.manual_seed(cfg.train.seed)
    model = load_weights(args.weights) if args.weights else Transformer(cfg.model)
    # the batch is tokenized with data.tokenizer: it must be the one the weights were trained with
    tokenizer = (weights_tokenizer(args.weights, cfg.data.tokenizer, "data.tokenizer") if args.weights
                 else load_tokenizer(cfg.data.tokenizer))
    batch = next(iter(build_loader(cfg, tokenizer, "train", 0, 1)))
    loss = cross_entropy_sum(model(**model_inputs(batch)), batch["labels"]) / count_tokens(batch["labels"])
    loss.backward()
    text, _ = gradient_report(model, sort_by_norm=True)
    print(f"loss {loss.item():.4f} on one batch of {cfg.data.batch_size} sequences\n{text}")


def _bundled_config(name: str) -> Path:
    from meshformer.config import bundled_configs

    bundled = bundled_configs()
    if name not in bundled:
        hint = difflib.get_close_matches(name, bundled, n=1)
        raise UsageError(f"no bundled config named {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""),
                         f"choose one of {', '.join(bundled)}")
    return bundled[name]


def _size(n: float) -> str:
    """A parameter count to three significant digits: 1.33M, 15.7B, 1.03T."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def _config_list(args: argparse.Namespace) -> None:
    import tomllib

    from meshformer.config import bundled_configs, load_config
    from meshformer.config.load import config_description
    from meshformer.model.flops import count_params

    rows = []
    for name, path in bundled_configs().items():
        if "model" not in tomllib.loads(path.read_text()):  # continued pretraining: the model is the folder's
            size = "the --init-from folder's"
        else:
            counts = count_params(load_config(path).model)  # computed from the config, as `meshformer params`
            size = _size(counts["total"]) + (f" ({_size(counts['active'])} active)"
                                             if counts["active"] != counts["total"] else "")
        rows.append((name, size, config_description(path)))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, size, description in rows:
        print(f"{name:<{widths[0]}}  {size:<{widths[1]}}  {description}")


def _config_show(args: argparse.Namespace) -> None:
    print(_bundled_config(args.name).read_text(), end="")


def _config_keys(args: argparse.Namespace) -> None:
    from meshformer.config.reference import config_reference, sections

    tables = [name for name, _ in sections()]
    if args.table is not None and args.table not in tables:
        raise UsageError(f"no config table {args.table!r}", f"use one of {', '.join(tables)}")
    print(config_reference(args.table))


def _config_copy(args: argparse.Namespace) -> None:
    source = _bundled_config(args.name)
    dest = Path(args.dest or source.name)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.overwrite:
        raise UsageError(f"{dest} already exists", "pass --overwrite to replace it, or another DEST")
    dest.write_text(source.read_text())
    print(f"wrote {dest}; edit it, then: meshformer train {dest}")


class _VersionAction(argparse.Action):
    """--version: the installed package's version, read only when asked (importlib.metadata is slow to import)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print meshformer's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from importlib import metadata

        try:
            version = metadata.version("meshformer")
        except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
            version = "unknown (not installed)"
        print(f"meshformer {version}")
        parser.exit()


def _train_replica_groups(args: argparse.Namespace, overrides: list[str]) -> None:
    """`train --replica-groups N`: a Lighthouse and N fault-tolerant replica groups on this machine."""
    from meshformer.config import load_config
    from meshformer.launcher.replica_groups import check_replica_groups, launch_replica_groups, replica_overrides
    from meshformer.parallel_dims import validate_parallel
    from meshformer.runtime.fault_tolerance import require_torchft
    from meshformer.train.preflight import preflight, run_folders_claimed

    check_replica_groups(args.replica_groups)
    if args.nnodes > 1:
        raise UsageError("--replica-groups starts every group on this machine, so --nnodes must be 1",
                         "start groups on other nodes with `meshformer lighthouse` and one torchrun job per group")
    overrides = [*overrides, *replica_overrides(args.replica_groups)]
    cfg = load_config(args.config, overrides)
    require_torchft()
    validate_parallel(cfg, args.nproc_per_node)  # every group runs this layout
    with run_folders_claimed(cfg):  # the run folder; each group holds its own replica-<r> folder inside it
        preflight(cfg)  # the data is prepared once, here, not by N groups at once
        if args.debug:
            os.environ[DEBUG_ENV] = "1"
        sys.exit(launch_replica_groups(args.config, overrides, cfg, nproc_per_node=args.nproc_per_node))


def _lighthouse(args: argparse.Namespace) -> None:
    from meshformer.config import load_config
    from meshformer.launcher.replica_groups import serve_lighthouse

    serve_lighthouse(load_config(args.config, args.set), args.bind)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command`, only that command's group of LAZY_COMMANDS is imported (the
    others are listed by name and help only)."""
    description = ("Pretrain Transformers from a laptop CPU to GPU clusters: train, generate, inspect, prepare data, "
                   "convert checkpoints, plan memory.")
    parser = ArgumentParser(prog="meshformer", description=description)
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error (also {DEBUG_ENV}=1); anywhere on the command line")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a TOML config")
    train.add_argument("config", nargs="?", help=f"{CONFIG_HELP}; with --init-from it may be left out: the "
                       f"bundled {INIT_FROM_CONFIG!r} run, into runs/<HF_FOLDER's name>")
    train.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="e.g. train.steps=200")
    train.add_argument("--nproc-per-node", type=int, default=1, help="start torchrun with this many processes")
    train.add_argument("--nnodes", type=int, default=1, help="nodes of a multi-node torchrun launch")
    train.add_argument("--rdzv-endpoint", default="127.0.0.1:29500", help="host:port of the first node")
    train.add_argument("--init-from", metavar="HF_FOLDER",
                       help="start from a Hugging Face model folder (= --set checkpoint.init_from=hf:HF_FOLDER): "
                       "its model and tokenizer replace a bundled config's")
    train.add_argument("--max-restarts", type=int, default=0,
                       help="torchrun restarts after a worker failure (the job resumes from its latest checkpoint)")
    train.add_argument("--new-run", action="store_true",
                       help="start a fresh run in a new folder beside logging.run_dir (e.g. runs/tiny-gpt-2) when "
                       "that folder already holds a run; the earlier run is left as it is")
    train.add_argument("--replica-groups", type=int, default=0, metavar="N",
                       help="fault tolerance: start a Lighthouse and N replica groups of --nproc-per-node processes "
                       "each on this machine; a failed group restarts and heals from a live one "
                       "(docs/fault-tolerance.md)")
    train.set_defaults(func=_train)

    lighthouse = sub.add_parser("lighthouse", help="run the torchft Lighthouse that fault-tolerant replica groups "
                                "join (fault_tolerance.lighthouse)")
    lighthouse.add_argument("config", nargs="?", help=f"{CONFIG_HELP}: its [fault_tolerance] table sets "
                            "min_replicas and the timeouts")
    lighthouse.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    lighthouse.add_argument("--bind", default="[::]:29510", help="address and port to serve on")
    lighthouse.set_defaults(func=_lighthouse)

    params = sub.add_parser("params", help="parameter count and training FLOPs per token of a config")
    params.add_argument("config", help=CONFIG_HELP)
    params.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    params.add_argument("--json", action="store_true", help="print the counts as JSON")
    params.set_defaults(func=_params)

    gen = sub.add_parser("generate", help="greedy decoding (KV cache) from a run's final weights",
                         description="Greedy decoding (KV cache) from a run's final weights. An MoE generates\n"
                         "dropless: model.moe.capacity_factor applies to training only, so a prompt's continuation\n"
                         "does not depend on the other prompts of the batch or on the cache.")
    gen.add_argument("weights", help="folder with model.safetensors, e.g. runs/tiny-gpt/final")
    gen.add_argument("--prompt", action="append", help="text to continue; repeat for a batch (one output line each)")
    gen.add_argument("--prompts-file", help="more prompts, one a line (blank lines skipped)")
    gen.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt")
    gen.add_argument("--tokenizer", help=TOKENIZER_HELP)
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole prefix each step")
    gen.set_defaults(func=_generate)

    attn = sub.add_parser("attention-map", help="PNG heatmap of one attention head for an input text")
    attn.add_argument("weights", help="folder with model.safetensors, e.g. runs/tiny-gpt/final")
    attn.add_argument("--text", required=True, help="the text whose attention is drawn")
    attn.add_argument("--target", help="decoder text for encoder-decoder models (default: --text)")
    attn.add_argument("--layer", type=int, default=0, help="block index")
    attn.add_argument("--head", type=int, default=0, help="attention head index")
    attn.add_argument("--stack", choices=["encoder", "decoder", "cross"], help="default: the model's main stack")
    attn.add_argument("--out", default="attention.png", help="PNG file to write")
    attn.add_argument("--tokenizer", help=TOKENIZER_HELP)
    attn.set_defaults(func=_attention_map)

    grad = sub.add_parser("grad-report", help="per-parameter gradient norms on one training batch")
    grad.add_argument("config", help=CONFIG_HELP)
    grad.add_argument("--weights", help="folder with model.safetensors (default: fresh init from the config)")
    grad.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    grad.set_defaults(func=_grad_report)

    config = sub.add_parser("config", help="list the bundled configs, or write one out for reading or editing")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    config_sub.add_parser("list", help="the bundled configs: name, parameters, what each is").set_defaults(
        func=_config_list)
    show = config_sub.add_parser("show", help="print a bundled config's TOML")
    show.add_argument("name", help="e.g. tiny-gpt (`meshformer config list` lists them)")
    show.set_defaults(func=_config_show)
    keys = config_sub.add_parser("keys", help="every config key: its type, default and meaning (markdown)")
    keys.add_argument("table", nargs="?", help="only this table, e.g. checkpoint")
    keys.set_defaults(func=_config_keys)
    copy = config_sub.add_parser("copy", help="write a bundled config to a file to edit and train with")
    copy.add_argument("name", help="e.g. tiny-gpt (`meshformer config list` lists them)")
    copy.add_argument("dest", nargs="?", help="file or folder (default: NAME.toml here)")
    copy.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    copy.set_defaults(func=_config_copy)

    for name, (module, help_text) in LAZY_COMMANDS.items():  # `data prepare`, `convert ...`, `plan`
        if command is None or command == name:
            importlib.import_module(module).add_cli(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
        if name == "convert":
            launcher_cli.add_cli(sub)  # `submit` / `tensorboard` / `plot` / `diagnose`, listed after `convert`
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the command line, not only before the subcommand
    argv = [a for a in argv if a != "--debug"]
    command = next((a for a in argv if not a.startswith("-")), "")  # "": --help, --version, nothing
    args = build_parser(command).parse_args(["--debug"] * debug + argv)
    run_command(args.func, args, debug=args.debug)


if __name__ == "__main__":
    main()
