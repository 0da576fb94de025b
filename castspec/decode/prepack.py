"""Linear layers with their weights pre-packed for the CPU's matrix units (oneDNN's blocked layout).

A decode forward reads every weight once, so its time is weight bytes over the rate the matmul kernel streams
them. On the AMX Xeon, aten's bf16 `linear` (oneDNN's AMX matmul over the plain [out, in] weight) streamed the
1.5B target's weights at 13-17 GB/s where the machine reads 20-24 GB/s; the same kernel over weights reordered
once into oneDNN's blocked layout streamed them at 18-24 GB/s (bench/forward-profile). Nothing else changes:
stock `transformers` modules call the swapped layers as they called `nn.Linear` (the swap is done in place, the
way quantisation libraries replace linears; no model code is copied).

Only bf16 and fp16 weights on a CPU whose oneDNN has native kernels for them are packed; fp32 keeps aten's
kernels, which are the ones Hugging Face's own greedy decoding runs (the exactness tests compare against it)."""

from __future__ import annotations

import os

import torch
from torch import nn

from castspec.decode.row_linear import ROW_COUNTS, kernel_rows, row_kernel, rows_pay

# the batch size oneDNN lays the blocks out for; a packed weight serves any number of rows, and 16 (a tree's
# verify) was as fast as 1 at one row and faster from four rows on
PACK_FOR_ROWS = 16
PACKABLE = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
# oneDNN keeps state for every row count it has multiplied (its kernels are generated per shape), and a server
# sees a new count with every prompt chunk and tree size: measured in process (SmolLM2 bf16, CAST over suffix, 4
# conversations at a time), RSS grew 0.48 MiB a turn over turns 120-240 with 90 -> 119 row counts seen, and was
# flat (+3 MiB over the same turns) with the counts rounded up as below (bench/prefix-cache). Counts up to
# PAD_ABOVE stay exact (decode steps, whose time is the weights' read); above, each octave has BUCKETS_PER_OCTAVE
# counts, so a padded forward does at most 1/BUCKETS_PER_OCTAVE more work and a server sees ~100 counts in all.
PAD_ABOVE = 16
BUCKETS_PER_OCTAVE = 8


class PrepackedLinear(nn.Module):
    """`nn.Linear` over a weight in oneDNN's blocked layout. The packed weight takes the place of the dense one
    among the model's parameters (so the parameter count, which names the model in cost tables, is unchanged);
    `weight` reads it back densely. An output layer keeps its dense weight as its parameter (EAGLE heads and
    draft vocabularies read it every step; a tied one stays the input embedding) and the packed copy beside it."""

    def __init__(self, linear: nn.Linear, keep_dense: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_ROWS)
        if keep_dense:
            self.dense = linear.weight  # the same parameter object: a tied weight stays tied, counted once
            self._packed = packed  # a plain attribute: the parameter above already counts these weights
        else:
            self.register_parameter("dense", None)
            self._packed = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        # the dense weight again, for forwards of up to `row_limit` rows, which the row kernel streams faster
        # (`prepack` keeps it only where that was measured; decode/row_linear.py)
        self.row_weight: torch.Tensor | None = None
        self.row_limit = 0

    @property
    def weight(self) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        return self.row_weight if self.row_weight is not None else self._packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            # oneDNN's packed op has no backward: a loss through this layer (an EAGLE head trained through the
            # target's lm_head) takes aten's linear over the dense weight
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.castspec.packed_linear(x, self._packed, self.bias, self.row_weight, self.row_limit)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.library.custom_op("castspec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  row_weight: torch.Tensor | None, row_limit: int) -> torch.Tensor:
    """oneDNN's linear over a packed weight, or for up to `row_limit` rows the row kernel over `row_weight` where
    one is kept, as one opaque op: a compiled forward calls the same kernels (Inductor has no lowering of
    oneDNN's for shapes that change), and which one runs is decided per call by the row count."""
    if row_weight is not None and x.numel() <= row_limit * x.shape[-1]:
        return row_kernel()(x, row_weight, bias)
    rows, width = x.numel() // x.shape[-1], x.shape[-1]
    padded = bucket_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    wide = torch.cat([x.reshape(rows, width), x.new_zeros(padded - rows, width)])
    out = torch.ops.mkldnn._linear_pointwise(wide, packed, bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], packed.shape[0])


def bucket_rows(rows: int) -> int:
    """The row count a packed linear of `rows` rows runs at: `rows` up to PAD_ABOVE, else rounded up to one of
    BUCKETS_PER_OCTAVE counts per power of two (a bounded set of shapes for oneDNN to keep kernels for)."""
    if rows <= PAD_ABOVE:
        return rows
    step = max(1, (1 << (rows.bit_length() - 1)) // BUCKETS_PER_OCTAVE)  # the octave [2^k, 2^(k+1)) in equal steps
    return -(-rows // step) * step


@packed_linear.register_fake
def _(x, packed, bias, row_weight, row_limit):
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def can_prepack(model: nn.Module, dtypes: tuple[torch.dtype, ...] = tuple(PACKABLE)) -> bool:
    """Whether `prepack` would pack this model: CPU weights in one of `dtypes` that this CPU's oneDNN has native
    kernels for (fp32 always has them)."""
    param = next(model.parameters())
    check = PACKABLE.get(param.dtype)
    native = param.dtype == torch.float32 or (check is not None and bool(getattr(torch.ops.mkldnn, check)()))
    return param.device.type == "cpu" and param.dtype in dtypes and torch.backends.mkldnn.is_available() and native


@torch.no_grad()
def prepack(model: nn.Module, dtypes: tuple[torch.dtype, ...] = tuple(PACKABLE),
            row_speedups: dict[int, float] | None = None) -> int:
    """Swap every `nn.Linear` of a CPU model whose weights are in one of `dtypes` (by default bf16 and fp16: fp32
    stays on the kernels Hugging Face's own decoding runs) for a `PrepackedLinear` in place; returns how many
    were swapped (0 where `can_prepack` says no). The output layer keeps its dense weight too: EAGLE heads and
    draft vocabularies read it, and a tied one is the input embedding anyway. Marks the model (`is_prepacked`),
    whose cost tables are then its own: its forwards take less time than the same model's unpacked. With the row
    kernel on this CPU, a bf16 model keeps its dense weights for it, for forwards of up to `castspec_row_limit`
    rows: `kernel_rows` of `row_speedups` (the kernel's speed over oneDNN's per row count; timed now on the first
    layer when not given, kept in `castspec_row_speedups`). The loader passes the first timing on this machine,
    so that a setup's cost key does not change with a later timing's noise."""
    if is_prepacked(model) or not can_prepack(model, dtypes):
        return 0
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    rows = row_kernel() is not None and next(model.parameters()).dtype == torch.bfloat16
    packed = []
    for name, linear in linears:
        parent, _, leaf = name.rpartition(".")
        packed.append(PrepackedLinear(linear, keep_dense=linear is output))
        if rows:
            packed[-1].row_weight = linear.weight.detach().contiguous()
        setattr(model.get_submodule(parent), leaf, packed[-1])
    model.castspec_prepacked = True
    model.castspec_row_limit = 0
    if rows:
        # timed on the first layer's linears (a decoder layer's worth of weights, beyond the caches)
        first = [m for m in packed if m.dense is None][:7]
        speedups = row_speedups or {count: rows_pay(first, count) for count in ROW_COUNTS}
        model.castspec_row_speedups = speedups
        limit = kernel_rows(speedups) if _free_bytes() > ROW_KERNEL_MIN_FREE else 0
        model.castspec_row_limit = limit
        for module in packed:
            module.row_limit = limit
            if not limit:
                module.row_weight = None  # the dense copies go: oneDNN's packed kernel serves every row
    return len(linears)


# the row kernel is kept where keeping the dense weights beside the packed ones leaves this much memory free
ROW_KERNEL_MIN_FREE = 2 << 30


def _free_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def is_prepacked(model: nn.Module) -> bool:
    return bool(getattr(model, "castspec_prepacked", False))
