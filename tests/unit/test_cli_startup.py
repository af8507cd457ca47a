"""`meshformer --help` and `--version` start without importing torch (#24): the command groups that need it are
imported only when the command line names them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from helpers.common import ROOT

from meshformer.cli import LAZY_COMMANDS, build_parser

PROBE = """
import sys
from meshformer.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = ("torch", "numpy", "meshformer.config", "meshformer.data.prepare", "meshformer.checkpointing.hf")
print("imported:", sorted(m for m in heavy if m in sys.modules))
"""


def _probe(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["submit", "--help"]])
def test_help_and_version_import_no_torch(argv):
    out = _probe(*argv)
    assert "imported: []" in out.stdout, out.stdout + out.stderr
    if argv == ["--version"]:
        assert out.stdout.startswith("meshformer ")
    if argv == ["--help"]:
        assert all(name in out.stdout for name in ("train", "config", "data", "convert", "plan", "--version"))


def test_a_lazy_command_still_gets_its_whole_parser():
    out = _probe("data", "prepare", "--help")
    assert "--out" in out.stdout and "imported: []" in out.stdout, out.stdout + out.stderr


def _command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [path, *(p for sub in subs for name, child in sub.choices.items() for p in _command_paths(child,
                                                                                                    (*path, name)))]


@pytest.mark.parametrize("path", _command_paths(build_parser()), ids=" ".join)
def test_every_help_answers_without_importing_torch(path):
    """Each `meshformer ... --help` answers at once: torch (seconds to import) is loaded only when a command runs."""
    out = _probe(*path, "--help")
    assert out.stdout.startswith("usage: meshformer") and "imported: []" in out.stdout, out.stdout + out.stderr


def _parser_at(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("path", _command_paths(build_parser()), ids=" ".join)
def test_every_help_text_is_written_for_users(path):
    """A command's description is prose for its users, not a module's docstring (which names files and functions)."""
    description = _parser_at(path).description or ""
    docstrings = {module.__doc__ for module in list(sys.modules.values()) if getattr(module, "__doc__", None)}
    assert description not in docstrings, f"`meshformer {' '.join(path)} --help` prints a module docstring"
    for internal in ("add_cli", "registered", ".py", "subparsers"):
        assert internal not in description, (path, internal, description)


def test_the_rank_entry_point_help_imports_no_torch():
    code = ("import runpy, sys\nsys.argv = ['meshformer.train', '--help']\ntry:\n    runpy.run_module("
            "'meshformer.train', run_name='__main__')\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert "usage: meshformer.train" in out.stdout and out.stdout.strip().endswith("False"), out.stdout + out.stderr


def _command_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {choice.dest: choice.help or "" for choice in commands._choices_actions}


def test_the_lazy_listing_says_what_the_commands_themselves_say():
    full, light = _command_help(build_parser()), _command_help(build_parser(""))
    assert list(full) == list(light)  # the same commands, in the same order
    assert {name: full[name] for name in LAZY_COMMANDS} == {name: help for name, (_, help) in LAZY_COMMANDS.items()}


def test_every_option_of_every_command_says_what_it_is_and_its_default():
    import argparse

    from meshformer.cli import build_parser

    def options(parser: argparse.ArgumentParser, path: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from options(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction):
                yield path, action, parser

    seen = 0
    for path, action, parser in options(build_parser(), "meshformer"):
        seen += 1
        assert action.help, f"{path} {'/'.join(action.option_strings) or action.dest} has no help"
        if action.option_strings and isinstance(action.default, (int, float, str)) and action.default is not False:
            flat = " ".join(parser.format_help().split())  # argparse wraps lines
            assert str(action.default) in flat, f"{path} {action.option_strings[0]}: default not in its help"
    assert seen > 100
