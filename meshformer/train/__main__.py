"""`python -m meshformer.train CONFIG [--set key=value ...]`: the entry point torchrun launches on every rank."""

from __future__ import annotations

import argparse
import os
import sys

from meshformer.config import ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshformer.train", description=__doc__)
    parser.add_argument("config", help="TOML config file, e.g. configs/tiny-gpt.toml")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="dotted overrides")
    return parser.parse_args(argv)


def run(config_path: str, overrides: list[str]) -> None:
    """Train on this process; joins the process group first when launched by torchrun."""
    from meshformer.train.metrics import setup_console_logging
    from meshformer.train.trainer import Trainer

    cfg = load_config(config_path, overrides)  # validated before any process-group work
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    setup_console_logging(rank)
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if distributed:
        from meshformer.runtime.distributed import init_distributed, shutdown_distributed

        init_distributed(cfg)
    try:
        Trainer(cfg, rank=rank, local_rank=local_rank).fit()
    finally:
        if distributed:
            shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        run(args.config, args.set)
    except ConfigError as err:
        sys.exit(f"config error: {err}")


if __name__ == "__main__":
    main()
