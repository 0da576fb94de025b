"""A server's heap that stays flat over thousands of requests (issue 39: RSS flat with the prefix cache at its bound).

glibc's malloc raises its mmap threshold to the size of every large block it frees (up to 32 MiB), so after the
first prefix-cache hit, tensors of a few MiB (a hit's KV gathered for its slot, a leaving row's entries, verify
logits) come from the heap, in sizes that change with every prompt, and the heap fragments: measured through
`castspec serve` (SmolLM2 bf16, CAST over suffix, 0.25 GiB prefix cache, 4 conversations at a time), RSS grew
385 MiB over turns 160-320 with the cache already at its bound, and 21 MiB with the thresholds fixed as below
(bench/prefix-cache). Fixed thresholds send every block above 128 KiB to its own mapping, returned to the system
when freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, kept from moving


def fix_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds for this process at THRESHOLD_BYTES (True), unless the environment
    sets them itself (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_) or the C library is not glibc (False)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, macOS: no mallopt, and no dynamic threshold to fix
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))
