"""The server fixes glibc's malloc thresholds (serve/malloc.py), unless the user's environment sets them."""

from __future__ import annotations

import ctypes.util
import os
import platform
import subprocess
import sys

import pytest

from castspec.serve.malloc import fix_malloc_thresholds

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

PROBE = """
from castspec.serve.malloc import fix_malloc_thresholds
print(fix_malloc_thresholds())
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_thresholds_are_fixed_on_glibc_and_left_to_the_environment_when_it_sets_them(monkeypatch):
    assert ctypes.util.find_library("c")
    run = [sys.executable, "-c", PROBE]  # a process of its own: the thresholds are process-wide
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    assert subprocess.run(run, capture_output=True, text=True, check=True, env=clean).stdout.strip() == "True"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "262144"}
    assert subprocess.run(run, capture_output=True, text=True, check=True, env=env).stdout.strip() == "False"
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    assert fix_malloc_thresholds() is False
