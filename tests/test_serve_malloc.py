"""The engine loop hands the heap's free pages back on a schedule (serve/malloc.py)."""

from __future__ import annotations

import platform

import pytest

from castspec.serve.malloc import HeapTrimmer

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_the_heap_is_trimmed_at_most_once_per_period(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("castspec.serve.malloc.time.monotonic", lambda: clock[0])
    trimmer = HeapTrimmer(every_s=2.0)
    assert trimmer.available
    assert not trimmer.maybe_trim()  # just made
    clock[0] += 1.9
    assert not trimmer.maybe_trim()
    clock[0] += 0.2
    assert trimmer.maybe_trim() and trimmer.trims == 1
    assert not trimmer.maybe_trim()  # the period starts again
    clock[0] += 2.0
    assert trimmer.maybe_trim() and trimmer.trims == 2
