"""castspec's own C++ kernels, compiled once per machine with torch's extension builder (into torch's extension
cache; later processes load the built library in ~0.1 s)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path


def build(name: str, source: Path, isa_flags: list[str], function: str, errors: list[str],
          seconds: list[float]) -> Callable | None:
    """`function` of the extension `name` built from `source` with the CPU's instruction flags `isa_flags`; None
    where it cannot be built (no compiler, no ninja: why is appended to `errors`). The build's seconds are
    appended to `seconds` (a first build takes up to a minute on 2 cores: the loader says so)."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # the `ninja` wheel's binary sits beside this Python, maybe not on PATH
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    start = time.perf_counter()
    try:
        module = load(name, [str(source)], verbose=False, extra_cflags=["-O3", "-fopenmp", *isa_flags],
                      extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - the callers fall back to aten's / oneDNN's kernels
        errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None
    seconds.append(time.perf_counter() - start)
    return getattr(module, function)
