"""Let a single-process CPU training run reuse the memory it frees instead of page-faulting it back every step.

glibc's malloc hands large blocks (above a threshold of at most 32 MiB) to fresh `mmap`s and unmaps them on
free, and trims the top of its heap once a few dozen MiB there are free. A training step allocates and frees
the same activations, gradients and logits every step, so on CPU each step pays first-touch page faults on
them: on 2 cores at the S shape (4L d256, B16 T256, bf16) ~50k faults, ~10% of the step (7% at M). With mmap
and trimming off, freed blocks go back to malloc's free lists and the next step reuses them (0 faults a step);
the process keeps its high-water mark, which a training run reaches every step anyway.

Multi-rank CPU runs (gloo) want the opposite, freed FSDP buffers leaving RSS: there, and whenever
MESHFORMER_MMAP_THRESHOLD is set, this leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

# glibc's mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest threshold it holds (2 GiB)
ENV_MMAP_THRESHOLD = "MESHFORMER_MMAP_THRESHOLD"  # an explicit allocator choice for CPU runs wins


@functools.cache
def reuse_freed_host_memory(device_type: str, world_size: int) -> bool:
    """Keep freed memory in this process (single-process CPU runs on glibc); True if set."""
    if device_type != "cpu" or world_size != 1 or os.environ.get(ENV_MMAP_THRESHOLD, "").strip():
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    # Trimming off first: with mmap off, large blocks come from the heap, which must then not shrink.
    return bool(libc.mallopt(M_TRIM_THRESHOLD, _NEVER_TRIM)) and bool(libc.mallopt(M_MMAP_MAX, 0))
