"""A few tokens' rows through a bf16 linear layer, by a kernel of our own where it streams the weights faster.

A decode step sends a few rows through every linear layer (one at batch 1, one per row of a batch, a tree's nodes):
its time is the weights' bytes over the rate the kernel reads them. On a 2-core AMD EPYC with AVX512-BF16 (no
AMX), oneDNN's bf16 linear over pre-packed weights read the 1.5B target's shapes at 17-25 GB/s for one row, where
a plain AVX512-BF16 dot product over the dense [out, in] weight, eight output rows at a time, read them at 28-38
GB/s (bench/forward-profile/row-kernel-*). The kernel reads each weight block from memory once for all the rows
it is given (`row_linear.cpp`), so a few rows cost about what one does; from some row count on oneDNN's blocked
kernel, which re-uses each block across many rows in its matrix tiles, is faster again.

The kernel is compiled once per machine with torch's extension builder (into torch's extension cache, ~25 s) and
only on a CPU with AVX512-BF16; `CASTSPEC_ROW_KERNEL=0` turns it off. Up to how many rows it is used for a model
is measured at load on that model's own first layer (`rows_pay`, `kernel_rows`), not assumed from the CPU's name."""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from castspec.decode.cpp_kernels import build

SOURCE = Path(__file__).with_name("row_linear.cpp")


@functools.cache
def row_kernel() -> Callable | None:
    """The compiled kernel's function, or None: no AVX512-BF16 here, turned off, or the build failed (why is
    kept in `build_error`)."""
    if os.environ.get("CASTSPEC_ROW_KERNEL", "1") == "0" or not torch.cpu._is_avx512_bf16_supported():
        return None
    return build("castspec_row_linear", SOURCE, ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
                 "row_linear", build_error, load_seconds)


build_error: list[str] = []
load_seconds: list[float] = []  # compiling it the first time on a machine takes ~25 s; loading it after, ~0.1 s


# the row counts timed at load; the kernel takes every count up to the largest one that paid, and all below it.
# Not 4: the load-time timing said 1.07-1.13x at 4 rows in three loads of the 1.5B on the AMD EPYC, yet a 4-row
# step through the kernel took 166 ms against oneDNN's 131 (compiled, in process) and 4 clients served at 0.77x
# vLLM against 0.82-1.07x without it; alone, the kernel read the large weights at 4 rows at 23-25 GB/s against
# oneDNN's 32 (bench/forward-profile/row-kernel-rows-*)
ROW_COUNTS = (1, 2, 3)
# the kernel is kept for a row count where it was at least this much faster than oneDNN's
MIN_SPEEDUP = 1.05


def kernel_rows(speedups: dict[int, float], least: float = MIN_SPEEDUP) -> int:
    """The most rows a forward may have for the kernel to take it: the largest timed count up to which every
    timed count paid (0: none did)."""
    limit = 0
    for rows in sorted(speedups):
        if speedups[rows] < least:
            break
        limit = rows
    return limit


@torch.inference_mode()  # with autograd on, oneDNN's op takes a slow path for a bias that requires grad
def rows_pay(layers: list, rows: int = 1, rounds: int = 7) -> float:
    """Time `rows` rows through `layers` (PrepackedLinears holding their dense weights), oneDNN's packed kernel
    and the row kernel in turn over `rounds`; returns how many times faster the row kernel was (medians)."""
    kernel = row_kernel()
    x = {layer.in_features: torch.randn(rows, layer.in_features, dtype=torch.bfloat16) for layer in layers}
    # the row kernel's products: one per layer, or one per group of siblings stacked (`PrepackedLinear.fuse`)
    products = {id(lay.row_weight): (lay.in_features, lay.row_weight, lay.row_bias if lay.part else lay.bias)
                for lay in layers}.values()
    onednn, ours = [], []
    for round_ in range(-1, rounds):  # round -1 untimed: oneDNN makes its kernels for a new shape at first use
        for times, calls in ((onednn, [lambda lay=lay: torch.ops.mkldnn._linear_pointwise(
                x[lay.in_features], lay._packed, lay.bias, "none", [], "") for lay in layers]),
                             (ours, [lambda p=p: kernel(x[p[0]], p[1], p[2]) for p in products])):
            start = time.perf_counter()
            for call in calls:
                call()
            if round_ >= 0:
                times.append(time.perf_counter() - start)
    return statistics.median(onednn) / statistics.median(ours)
