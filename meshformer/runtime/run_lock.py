"""One training run per folder: an advisory lock on `<folder>/run.lock`, held for the whole run.

The lock is `flock` on an open file, so the operating system drops it when the holder exits, however it exits:
a crashed or killed run never leaves a lock behind that blocks its resume. The file names the holder (host,
pid, start time) for the one line that refuses a second run. Under torchrun only global rank 0 takes it: the
ranks of one job share the folder, and a refused rank 0 ends the whole job.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshformer.errors import MeshformerError

LOCK_FILE = "run.lock"
# A filesystem without lock support (some network mounts) answers these: the run goes on, unguarded, with a warning.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunFolderInUseError(MeshformerError, RuntimeError):
    """Another process is training in this folder."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']} on host {info['host']} (started {info['started']})"
    except (OSError, ValueError, KeyError, TypeError):  # the holder is between taking the lock and naming itself
        return "another process"


@contextmanager
def run_folder_lock(folder: Path, key: str, another_run: bool = False) -> Iterator[None]:
    """Hold `folder`'s lock until the block ends; another holder is refused in one line naming it and `key`
    (the config option that chooses the folder). another_run: this config is not the holder's (waiting would
    not help: the folder then holds another run), so a folder of its own is the first suggestion."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if _lock(fd, path, key, another_run):
            os.ftruncate(fd, 0)
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode())
        yield
    finally:
        os.close(fd)  # drops the lock


def _lock(fd: int, path: Path, key: str, another_run: bool) -> bool:
    """True when locked; False when the filesystem has no locks (warned about)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        fix = (f"set {key} to a folder of its own (this config is not that run's), or wait for it to finish"
               if another_run else f"wait for it to finish, or set {key} to another folder")
        raise RunFolderInUseError(f"{path.parent} is in use by {_holder(path)}", fix) from None
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
        print(f"warning: cannot lock {path} ({err.strerror}): nothing stops a second run from using {path.parent} "
              "at the same time", file=sys.stderr)
        return False
