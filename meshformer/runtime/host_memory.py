"""Let a CPU training process reuse the memory it frees, instead of page-faulting it back in every step.

glibc's malloc hands large blocks (above a threshold of at most 32 MiB) to fresh `mmap`s and unmaps them on
free, and trims the top of its heap once a few dozen MiB there are free. A training step allocates and frees
the same activations, gradients and logits every step, so on CPU each step pays first-touch page faults on
all of them: on 2 cores at the S shape (4L d256, B16 T256, bf16) ~50k faults, about 15% of the step. With
mmap off and trimming off, freed blocks go back to malloc's free lists and the next step reuses them (0
faults a step); the process keeps its high-water mark, which a training run reaches every step anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest threshold it can hold (2 GiB)

_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Make glibc keep freed memory in this process (once per process); False where malloc is not glibc's."""
    global _applied
    if _applied is None:
        _applied = _mallopt()
    return _applied


def _mallopt() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  # glibc only (musl has no tunable mallopt)
    except (OSError, AttributeError):
        return False
    # Trimming first: with mmap off, large blocks come from the heap, which must then not shrink.
    return bool(libc.mallopt(M_TRIM_THRESHOLD, _NEVER_TRIM)) and bool(libc.mallopt(M_MMAP_MAX, 0))
