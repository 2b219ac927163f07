"""Keep freed memory in the process, so CPU forwards and steps stop paying page faults for their tensors.

glibc's malloc serves a large block (above its "mmap threshold", 128 KiB to 32 MiB, adjusted as it
goes) with a fresh `mmap` and gives it back to the kernel on `free`; it also trims free memory at the
top of its heap back to the kernel. A loop of forwards allocates and frees the same activations every
time, so the kernel may hand out fresh zeroed pages again and again, one page fault per 4 KiB.
Raising both thresholds makes freed blocks stay in the heap for the next forward to reuse; the cost
is memory that stays with the process until it exits.

Evaluation and inference gain most, since a forward allocates as much as a training step's and
computes less. `vitscope train`'s own loop faults half as often (glibc raises its threshold after
freeing larger blocks), so there the gain is small against the memory kept, and training keeps it only
when the run sets `keep_freed_memory`. Measurements: docs/performance.md, "Freed memory kept in the process".

This is process-wide and has no undo; `vitscope eval | predict | explain | caption | translate` call it, and so does
`vitscope train --keep-freed-memory true`. Other allocators (jemalloc or tcmalloc through
LD_PRELOAD, or a non-glibc libc) are left alone. In your own scripts, call
`vitscope.kernels.allocator.keep_freed_memory()` once at the start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

# mallopt parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Blocks below this come from the heap and are reused; glibc versions that cap the threshold (at half
# their 64 MiB heap size) refuse it, and the cap is used instead.
MMAP_THRESHOLD = 1 << 30
MMAP_THRESHOLD_CAPPED = 32 << 20
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept before any is given back

_applied: int | None = None  # the mmap threshold set, once it has been


def _glibc():
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload or "tcmalloc" in preload or "mimalloc" in preload:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def keep_freed_memory() -> int | None:
    """Raise glibc's mmap and trim thresholds for this process; the mmap threshold set, or None where
    the allocator is not glibc's malloc (nothing is changed then). Calling it again changes nothing."""
    global _applied
    if _applied is not None:
        return _applied
    libc = _glibc()
    if libc is None:
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for threshold in (MMAP_THRESHOLD, MMAP_THRESHOLD_CAPPED):
        if mallopt(M_MMAP_THRESHOLD, threshold) == 1:
            break
    else:
        return None
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    _applied = threshold
    return threshold


def applied() -> int | None:
    """The mmap threshold `keep_freed_memory` set in this process, or None if it has not."""
    return _applied
