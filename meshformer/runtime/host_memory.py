"""Host-memory hygiene for CPU-device runs on glibc: freed tensors go back to the OS instead of staying in the heap.

glibc's malloc serves requests below its mmap threshold from the heap and raises that threshold (up to 32 MiB)
each time a large mapped block is freed, so FSDP's per-unit all-gather and gradient buffers, freed every block,
end up in the heap and stay resident (docs/benchmarks/parallel.md, `bench/scale_memory.py`; a
`malloc_trim` after materialisation alone does not help).
A fixed threshold (which also turns glibc's adjustment off) maps every tensor of a MiB or more and unmaps it
on free, as jemalloc and tcmalloc do; `malloc_trim` hands back what a large transient
phase (materialisation, gathering the final weights) left free in the heap.

By default only for multi-process runs on CPU devices. On an accelerator the large tensors live in device
memory (host staging buffers are pinned by the device runtime, not malloc'd). One process holds no FSDP buffers,
and there mapping costs speed: every large activation is then page-faulted in afresh each step.
Elsewhere (musl, macOS, Windows) these are no-ops.
`MESHFORMER_MMAP_THRESHOLD` sets the threshold in bytes for any CPU run; 0 leaves glibc's default.

One CPU process goes the other way (`reuse_freed_host_memory`): glibc still maps blocks above its (at most
32 MiB) threshold afresh and trims its heap top, so every step page-faults its logits and largest activations
back in (docs/benchmarks/parallel.md). With mapping and trimming off,
freed blocks stay on malloc's free lists and the next step reuses them (0 faults a step); the process keeps
its high-water mark, which a training step reaches every step anyway. Not when MESHFORMER_MMAP_THRESHOLD is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

from meshformer.errors import UsageError

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt parameter numbers in glibc's malloc.h
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest trim threshold it holds (2 GiB)
DEFAULT_MMAP_THRESHOLD = 1 << 20  # 1 MiB: per-token activations of toy models stay in the heap, weights do not
ENV_MMAP_THRESHOLD = "MESHFORMER_MMAP_THRESHOLD"


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def mmap_threshold(world_size: int) -> int:
    """The threshold to set: MESHFORMER_MMAP_THRESHOLD if given (0: leave glibc alone), else 1 MiB for a
    multi-process run and 0 for one process."""
    text = os.environ.get(ENV_MMAP_THRESHOLD, "").strip()
    try:
        return int(text) if text else (DEFAULT_MMAP_THRESHOLD if world_size > 1 else 0)
    except ValueError:
        raise UsageError(f"{ENV_MMAP_THRESHOLD}={text!r} is not a number of bytes",
                         "unset it, or give e.g. 1048576 (0 leaves glibc's default)") from None


def map_large_host_tensors(device_type: str, world_size: int) -> bool:
    """Before the model is built: tensors of `mmap_threshold()` bytes or more are mapped, so freeing one returns
    it to the OS. True if set (CPU device, glibc, threshold not 0)."""
    libc = _glibc()
    threshold = mmap_threshold(world_size)
    if device_type != "cpu" or libc is None or threshold <= 0:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold)))


def reuse_freed_host_memory(device_type: str, world_size: int) -> bool:
    """One CPU process, no MESHFORMER_MMAP_THRESHOLD: freed blocks stay in the heap for the next step to reuse
    (no mapping, no trimming). True if set."""
    libc = _glibc()
    if device_type != "cpu" or world_size != 1 or libc is None or os.environ.get(ENV_MMAP_THRESHOLD, "").strip():
        return False
    # Trimming off first: with mapping off, large blocks come from the heap, which must then not shrink.
    return bool(libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(NEVER_TRIM))) and bool(libc.mallopt(M_MMAP_MAX,
                                                                                              ctypes.c_int(0)))


def apply_host_memory_policy(device_type: str, world_size: int) -> str:
    """Before any large tensor: the one allocator policy of this run (see the module docstring); says which."""
    if map_large_host_tensors(device_type, world_size):
        return "large blocks mapped"
    return "freed blocks reused" if reuse_freed_host_memory(device_type, world_size) else "default"


def release_free_host_memory() -> None:
    """Return the heap's free pages to the OS (glibc's malloc_trim); a no-op without glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(ctypes.c_size_t(0))
