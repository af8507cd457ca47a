"""`python -m meshformer.train CONFIG [--set key=value ...]`: the entry point torchrun launches on every rank."""

from __future__ import annotations

import argparse
import os

from meshformer.errors import ArgumentParser, run_command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="meshformer.train",
                            description="Train on this process: the command torchrun starts on every rank "
                                        "(`torchrun ... -m meshformer.train CONFIG`).")
    parser.add_argument("config", help="TOML config file, e.g. configs/tiny-gpt.toml")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="dotted overrides")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also MESHFORMER_DEBUG=1)")
    return parser.parse_args(argv)


def run(config_path: str, overrides: list[str]) -> None:
    """Train on this process; joins the process group first when launched by torchrun."""
    from meshformer.checkpointing.init_from import resolve_init_from
    from meshformer.config import load_config
    from meshformer.train.metrics import setup_console_logging
    from meshformer.train.preflight import preflight, run_folders_claimed
    from meshformer.train.replica_step import replica_config
    from meshformer.train.trainer import Trainer

    # validated before any process-group work; a replica group (fault_tolerance) runs in its own run folder
    cfg = replica_config(resolve_init_from(load_config(config_path, overrides)))
    with run_folders_claimed(cfg):  # one run per folder, before any work; rank 0 holds it for the job
        tokenizer = preflight(cfg)  # folders, disk space, tokenizer, data: before the process group and the model
        rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
        setup_console_logging(rank)
        distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
        dims = None  # one process: the trainer validates the layout
        if distributed:
            from meshformer.runtime.distributed import init_distributed, shutdown_distributed
            from meshformer.runtime.stop import die_with_parent

            die_with_parent()  # a launcher killed outright: this rank stops with a checkpoint, not as an orphan
            dims = init_distributed(cfg)
        try:
            result = Trainer(cfg, rank=rank, local_rank=local_rank, tokenizer=tokenizer, dims=dims).fit()
        finally:
            if distributed:
                shutdown_distributed()
    if result.stopped_by is not None:  # saved and stopped by a signal: the shell's 128+signal, for scripts
        from meshformer.runtime.stop import exit_status

        raise SystemExit(exit_status(result.stopped_by))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_command(run, args.config, args.set, debug=args.debug)  # one rank reports a mistake, in one line


if __name__ == "__main__":
    main()
