"""One error surface for every command: a user's mistake ends as one line, `error: <what> — <how to fix>`.

Every meshformer error type (config, data, tokenizer, shard, manifest, checkpoint, conversion, launch)
derives from `MeshformerError`. The commands' entry points run through `run_command`, which turns such an
error (and an OSError: a missing file, a full disk, a denied permission) into that line on stderr and a
non-zero exit status, without a traceback. `--debug` or MESHFORMER_DEBUG=1 re-raises it with its traceback;
any other exception is a bug and keeps its traceback.

Under torchrun every rank runs the same checks, so a mistake usually fails on all of them at once, and some
failures (a shard missing on one node) hit only some ranks. Exactly one rank per node reports: the first
to create a marker file in the folder torchrun's agent keeps for this attempt (beside the ranks' error
files). It needs no process group (which may not exist yet, or be broken), does not depend on rank 0
failing too (a shard missing on one node fails only that node's ranks), and the others exit non-zero in
silence. With several nodes, each node whose ranks fail prints the line once (their agents' folders differ).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any

DEBUG_ENV = "MESHFORMER_DEBUG"
INTERRUPTED_EXIT = 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)
# What a training rank takes as "save and stop" (meshformer.runtime.stop); SIGUSR1/2 are what SLURM's --signal sends.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
REPORTED_MARKER = "meshformer-error-reported"  # in torchrun's attempt folder: a rank of it printed the line
PEER_LOST_MARKER = "meshformer-peer-lost"  # in torchrun's attempt folder: a rank of it lost a peer, and left the line
# Set by meshformer's torchrun agent for its ranks: it reports a lost peer itself, naming the signal that killed it.
AGENT_REPORTS_ENV = "MESHFORMER_AGENT_REPORTS"


class MeshformerError(Exception):
    """A problem the user can fix: `what` is wrong, `fix` says how (or the message says both, "what; fix")."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        super().__init__(what if fix is None else f"{what}; {fix}")
        self.what, self.fix = (what, fix) if fix is not None else _split(_from_worker(what))

    def one_line(self) -> str:
        return _flat(f"{self.what} — {self.fix}" if self.fix else self.what)


class ConfigError(MeshformerError, ValueError):
    """A configuration problem, phrased as what is wrong and how to fix it."""


class UsageError(MeshformerError, ValueError):
    """A command-line option out of range or contradicting another one."""


class DivergenceError(MeshformerError, RuntimeError):
    """Training cannot go on: every recent step's gradient was inf/nan."""


class SubmitError(MeshformerError, RuntimeError):
    """A job that cannot be submitted (SLURM training runs, `data submit-prepare`): the problem and its fix."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (the commands' docstrings), and every option's help ending with its default, where
    it has one worth saying and the text does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default == [] or \
            action.default is argparse.SUPPRESS
        if action.option_strings and not quiet and "default" not in text:
            text += " (default: %(default)s)"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """Command-line usage mistakes in the same one-line form (subcommands' parsers are of this class too), and
    help that gives each option's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} — see `{self.prog} --help`\n")


def _from_worker(message: str) -> str:
    """torch's DataLoader re-raises a worker's error as `type("Caught X in DataLoader worker ...\\nOriginal
    Traceback ...\\nmodule.X: message")`: keep the message."""
    if not message.startswith("Caught ") or "\nOriginal Traceback" not in message:
        return message
    last = message.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def _split(message: str) -> tuple[str, str | None]:
    what, sep, fix = message.partition("; ")
    return (what, fix) if sep else (message, None)


def _flat(text: str) -> str:
    return " ".join(text.split())


_OS_FIXES = {
    errno.ENOSPC: "free disk space there or point the output at a larger filesystem",
    errno.EACCES: "check the permissions, or choose a folder you can write",
    errno.EPERM: "check the permissions, or choose a folder you can write",
    errno.EROFS: "the filesystem is read-only; choose a writable folder",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file; choose another path",
    errno.EISDIR: "pass a file, not a folder",
    errno.EEXIST: "remove it or choose another path",
}


def describe(err: BaseException) -> str:
    """The one line (without "error: ") for a meshformer error or an OSError."""
    if isinstance(err, MeshformerError):
        return err.one_line()
    if isinstance(err, OSError) and err.errno is not None:
        where = f": {err.filename}" if err.filename else ""
        fix = _OS_FIXES.get(err.errno, "check the path and the disk")
        return _flat(f"{err.strerror or err}{where} — {fix}")
    return MeshformerError(str(err)).one_line()  # an OSError raised with a written message


def debug_enabled(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def run_command(func: Callable[..., Any], *args: Any, debug: bool = False) -> Any:
    """Call a command; a user-fixable error becomes SystemExit("error: ...") (exit status 1), or a silent
    SystemExit(1) on a rank that leaves the report to another one."""
    try:
        return func(*args)
    except (MeshformerError, OSError) as err:
        if debug_enabled(debug):
            raise
        raise SystemExit(f"error: {describe(err)}" if _this_rank_reports() else 1) from None
    except Exception as err:
        # Another rank failed first and left: this one's collective broke. Its traceback would bury the line that
        # says why, so it exits in silence when a rank of this node reported, and in one line otherwise.
        if debug_enabled(debug) or int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not _peer_lost(err):
            raise
        if os.environ.get(AGENT_REPORTS_ENV) and _attempt_marker(PEER_LOST_MARKER, exclusive=False):
            raise SystemExit(1) from None  # the agent names what ended the peer: a signal, or the line it printed
        if _this_rank_reports():
            raise SystemExit(f"error: {peer_lost_line(os.environ.get('RANK', '?'))}") from None
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever the interrupt landed
        if debug_enabled(debug):
            raise
        if _this_rank_reports():
            print("interrupted (Ctrl-C)", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT) from None


# What gloo and NCCL say when a peer process is gone (exited or killed) in the middle of a collective.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "ncclremoteerror",
              "remote process exited")


def _peer_lost(err: BaseException) -> bool:
    return any(marker in str(err).lower() for marker in _PEER_LOST)


def peer_lost_line(rank: str | int) -> str:
    """What a rank whose collective broke because another rank ended says (without "error: ")."""
    return (f"rank {rank} lost its connection to another rank, which stopped first — that rank's own error line, "
            "or the signal that ended it, is in the output of its node")


def _this_rank_reports() -> bool:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    claimed = _attempt_marker(REPORTED_MARKER, exclusive=True)
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 if claimed is None else claimed


def _attempt_marker(name: str, *, exclusive: bool) -> bool | None:
    """Create `name` in this attempt's folder of torchrun's agent (beside the ranks' error files): whether this rank
    created it (exclusive: False when another rank of the node and attempt did first); None when it cannot."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # <agent log dir>/<run id>/attempt_<n>/<rank>/error.json
    if error_file:
        marker = os.path.join(os.path.dirname(os.path.dirname(error_file)), name)
    elif not exclusive:
        return None
    else:  # launched without torchrun's agent: key the marker by the job and the parent process
        key = "-".join(os.environ.get(name, "") for name in ("TORCHELASTIC_RUN_ID", "MASTER_PORT"))
        marker = os.path.join(tempfile.gettempdir(), f"meshformer-error-{key}-{os.getppid()}")
    try:
        os.close(os.open(marker, os.O_CREAT | (os.O_EXCL if exclusive else 0) | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False  # a rank of this node and attempt already reported
    except OSError:
        return None  # no temp folder
    return True
