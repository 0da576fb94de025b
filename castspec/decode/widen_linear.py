"""bf16 linear layers on a CPU with no bf16 arithmetic (AVX2 only), by a kernel of our own.

On such a CPU (no AVX512-BF16, no AMX) oneDNN has no native bf16 kernels, so aten's bf16 `linear` takes a slow
generic path: on a 2-core AMD EPYC with AVX2 it read the 1.5B target's weight shapes at 13.6-16.8 GB/s for one
row but at 4-5 GB/s for four rows and 1.2 GB/s for sixteen (its time growing with every row), where this
kernel read them at 21.6 GB/s for one row (bench/forward-profile/widen-*). fp32 weights avoid that path but
double the bytes every decode step reads. This kernel keeps the bf16 weights (their bytes) and
does the arithmetic in fp32: each weight vector is widened in registers (a bf16 value is the top half of an fp32
one), multiplied and summed in fp32, and each output rounded to bf16 once (`widen_linear.cpp`). It serves every
row count: four rows cost 1.2-1.5x one row (each weight block is read from memory once for all of them), and a
prompt's many rows reuse each block from L2.

Every output is the same fp32 sum in the same order however many rows come with it, so a tree's verification or
a batch computes each row exactly as a one-row step would (batch-invariant linears).

The kernel is compiled once per machine with torch's extension builder (into torch's extension cache, ~1 min the
first time) and only on a CPU with AVX2 and FMA whose oneDNN lacks native bf16; `--no-prepack` leaves the layers
as loaded (aten's path)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from castspec.decode.cpp_kernels import build

SOURCE = Path(__file__).with_name("widen_linear.cpp")

build_error: list[str] = []
load_seconds: list[float] = []  # compiling it the first time on a machine takes ~1 min; loading it after, ~0.1 s


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return set(next(line for line in cpuinfo if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def needs_widening() -> bool:
    """Whether bf16 arithmetic is missing here but AVX2 and FMA are present (the CPUs this kernel is for)."""
    flags = _cpu_flags()
    return {"avx2", "fma"} <= flags and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.cache
def build_kernel() -> Callable | None:
    """The compiled kernel's function wherever the CPU has AVX2 and FMA (else None; a failed build says why in
    `build_error`)."""
    if not {"avx2", "fma"} <= _cpu_flags():
        return None
    return build("castspec_widen_linear", SOURCE, ["-mavx2", "-mfma"], "widen_linear", build_error, load_seconds)


def widen_kernel() -> Callable | None:
    """The kernel where bf16 models should take it (`needs_widening`), else None."""
    return build_kernel() if needs_widening() else None


class WidenedLinear(nn.Module):
    """`nn.Linear` whose bf16 forward takes the widening kernel. It holds the linear's own weight and bias
    parameters (a tied output layer stays tied; the model's parameters are unchanged)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.requires_grad and torch.is_grad_enabled()) or x.dtype != torch.bfloat16:
            # no backward through the kernel (a head trained through the target's lm_head), and bf16 only
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.castspec.widened_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.library.custom_op("castspec::widened_linear", mutates_args=())
def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The widening kernel as one opaque op, so that a compiled forward calls it as the eager one does."""
    return build_kernel()(x, weight if weight.is_contiguous() else weight.contiguous(), bias)


@widened_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def can_widen(model: nn.Module, anywhere: bool = False) -> bool:
    """Whether `widen` would swap this model's linears: bf16 CPU weights, and the kernel built for this CPU,
    which lacks bf16 arithmetic (`anywhere`: any CPU with AVX2, as the tests run it)."""
    param = next(model.parameters())
    kernel = build_kernel() if anywhere else widen_kernel()
    return param.device.type == "cpu" and param.dtype == torch.bfloat16 and kernel is not None


@torch.no_grad()
def widen(model: nn.Module, anywhere: bool = False) -> int:
    """Swap every bf16 `nn.Linear` of a CPU model for a `WidenedLinear` in place; returns how many were swapped
    (0 where `can_widen` says no). Marks the model (`is_widened`): its forwards take less time than the same
    model's as loaded, so its cost tables are its own."""
    if is_widened(model) or not can_widen(model, anywhere):
        return 0
    linears = [(name, module) for name, module in model.named_modules()
               if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16]
    for name, linear in linears:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, WidenedLinear(linear))
    model.castspec_widened = True
    return len(linears)


def is_widened(model: nn.Module) -> bool:
    return bool(getattr(model, "castspec_widened", False))
