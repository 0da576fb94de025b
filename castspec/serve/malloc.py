"""A server's heap that stays flat over thousands of requests (issue 39: RSS flat with the prefix cache at its bound).

glibc's malloc raises its mmap threshold to the size of every large block it frees (up to 32 MiB), so after the
first prefix-cache hit, tensors of a few MiB (a hit's KV gathered for its slot, a leaving row's entries, verify
logits) come from the heap in sizes that change with every prompt, and freed pages inside the heap stay with the
process: measured through `castspec serve` (SmolLM2 bf16, CAST over suffix, 0.25 GiB prefix cache, 4
conversations at a time), RSS grew 385 MiB over turns 160-320 with the cache already at its bound. Fixing the
thresholds (MALLOC_MMAP_THRESHOLD_=131072) kept it flat but makes every block over 128 KiB a fresh mapping: a
4.8 MB tensor (16 verify rows' logits) then cost 1.8 ms to allocate and fill instead of 54 us, dozens of times a
step. So the heap keeps glibc's defaults and the engine loop hands its free pages back every TRIM_EVERY_S seconds
(`malloc_trim`) instead (bench/prefix-cache)."""

from __future__ import annotations

import ctypes
import ctypes.util
import time

TRIM_EVERY_S = 2.0


def _libc_trim():
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """`maybe_trim()` returns the heap's free pages to the system when TRIM_EVERY_S seconds have passed since
    the last time (a few ms each time, measured in the engine loop); a no-op where the C library is not glibc."""

    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self.every_s = every_s
        self._trim = _libc_trim()
        self._last = time.monotonic()
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> bool:
        now = time.monotonic()
        if self._trim is None or now - self._last < self.every_s:
            return False
        self._trim(0)
        self._last = time.monotonic()
        self.trims += 1
        return True
