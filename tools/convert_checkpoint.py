"""Convert checkpoints without installing the `meshformer` command: same arguments as `meshformer convert`.

    python tools/convert_checkpoint.py to-safetensors runs/tiny-gpt/checkpoints runs/tiny-gpt/export
    python tools/convert_checkpoint.py export-hf runs/tiny-gpt/export hf/tiny-gpt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshformer.checkpointing.cli import add_cli


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="convert_checkpoint")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", *(sys.argv[1:] if argv is None else argv)])
    args.func(args)


if __name__ == "__main__":
    main()
