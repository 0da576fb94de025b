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

import contextlib
import itertools
import os
import threading

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
# linears that stock `transformers` decoder layers (Llama, Qwen2, Mistral, SmolLM, ...) call on the same input one
# after another: attention's q, k and v, the MLP's gate and up. For the row kernel their dense weights are stacked,
# so that a forward of a few rows reads them in one call (the small k and v weights stream slower alone): the
# compiled 1.5B's one-row step took 4-6% less time than with each alone (2-core AMD EPYC, in-process A/B, both load
# orders). oneDNN's path keeps a packed weight per layer: stacked, it took ~2% longer at 4-16 rows.
# `CASTSPEC_FUSE_LINEARS=0` keeps each alone.
SHARED_INPUT_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PrepackedLinear(nn.Module):
    """`nn.Linear` over a weight in oneDNN's blocked layout. The packed weight takes the place of the dense one
    among the model's parameters (so the parameter count, which names the model in cost tables, is unchanged);
    `weight` reads it back densely. An output layer keeps its dense weight as its parameter (EAGLE heads and
    draft vocabularies read it every step; a tied one stays the input embedding) and the packed copy beside it."""

    def __init__(self, linear: nn.Linear, keep_dense: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # with `fuse`: the layer's columns start:end of the row kernel's product over its siblings' stacked dense
        # weights (`row_weight`); None: the layer's own product
        self.part: tuple[int, int, int, int] | None = None  # (product's number, start, end, siblings sharing it)
        self.row_bias: torch.Tensor | None = None  # with `part`: the siblings' biases stacked like `row_weight`
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

    @classmethod
    def fuse(cls, siblings: list[nn.Linear]) -> list[PrepackedLinear]:
        """Layers for `siblings` (linears called on the same input), each over its own packed weight (oneDNN's
        path is as for layers alone), whose dense weights for the row kernel are stacked into one: in a forward
        the row kernel takes, the first sibling to run computes the product for all and each takes its own
        columns (`packed_linear_part`). The stacked bias is a plain attribute beside each layer's own bias
        parameter, so the model's parameters are those of layers packed alone."""
        product = next(_products)
        stacked = torch.cat([s.weight.detach() for s in siblings])
        stacked_bias = torch.cat([s.bias.detach() for s in siblings]) if siblings[0].bias is not None else None
        layers, start = [], 0
        for sibling in siblings:
            layer = cls(sibling)
            layer.part = (product, start, start + sibling.out_features, len(siblings))
            layer.row_weight, layer.row_bias = stacked, stacked_bias
            layers.append(layer)
            start += sibling.out_features
        return layers

    @property
    def weight(self) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        if self.row_weight is None:
            return self._packed.to_dense()
        return self.row_weight if self.part is None else self.row_weight[self.part[1]:self.part[2]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            # oneDNN's packed op has no backward: a loss through this layer (an EAGLE head trained through the
            # target's lm_head) takes aten's linear over the dense weight
            return nn.functional.linear(x, self.weight, self.bias)
        if self.part is None or self.row_weight is None:
            return torch.ops.castspec.packed_linear(x, self._packed, self.bias, self.row_weight, self.row_limit)
        product, start, end, parts = self.part
        return torch.ops.castspec.packed_linear_part(x, self._packed, self.bias, self.row_weight, self.row_bias,
                                                     self.row_limit, product, start, end, parts)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.library.custom_op("castspec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  row_weight: torch.Tensor | None, row_limit: int) -> torch.Tensor:
    """oneDNN's linear over a packed weight, or for up to `row_limit` rows the row kernel over `row_weight` where
    one is kept, as one opaque op: a compiled forward calls the same kernels (Inductor has no lowering of
    oneDNN's for shapes that change), and which one runs is decided per call by the row count."""
    return _linear(x, packed, bias, row_weight, row_limit)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, row_weight: torch.Tensor | None,
            row_limit: int) -> torch.Tensor:
    if row_weight is not None and x.numel() <= row_limit * x.shape[-1]:
        return row_kernel()(x, row_weight, bias)
    rows, width = x.numel() // x.shape[-1], x.shape[-1]
    padded = bucket_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    wide = torch.cat([x.reshape(rows, width), x.new_zeros(padded - rows, width)])
    out = torch.ops.mkldnn._linear_pointwise(wide, packed, bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], packed.shape[0])


@torch.library.custom_op("castspec::packed_linear_part", mutates_args=())
def packed_linear_part(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, row_weight: torch.Tensor,
                       row_bias: torch.Tensor | None, row_limit: int, product: int, start: int, end: int,
                       parts: int) -> torch.Tensor:
    """A layer stacked with its siblings (`PrepackedLinear.fuse`): for more than `row_limit` rows oneDNN's linear
    over its own packed weight; for up to `row_limit`, columns start:end of the row kernel's product with the
    dense weight stacked from `parts` siblings' (`product` numbers it). The siblings run one after another on the
    same input, so the first computes the whole product and keeps it until all `parts` have taken their columns.
    A kept product is reused only for an input equal bit for bit to the one it was computed from (the product is
    a function of the values: reuse can never change a result; an input that differs, or a sibling called alone,
    computes the product again)."""
    if x.numel() > row_limit * x.shape[-1]:
        return _linear(x, packed, bias, None, 0)
    kept = _kept_product.__dict__
    if kept.get("product") == product and _same_bits(kept["x"], x):
        whole = kept["whole"]
        kept["left"] -= 1
    else:
        whole = row_kernel()(x, row_weight, row_bias)
        kept.update(product=product, x=x.clone(), whole=whole, left=parts - 1)
    if kept["left"] <= 0:  # every sibling served: nothing kept
        kept.update(product=None, x=None, whole=None)
    # a copy: Inductor lays a custom op's outputs out contiguously (views of the product failed its stride check)
    return whole[..., start:end].contiguous()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (equal values give equal products, and equal bits equal values),
    compared as 64-bit words where the layout allows: 2-4x faster than comparing bf16 values."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_contiguous() and b.is_contiguous() and a.numel() * a.element_size() % 8 == 0:
        return torch.equal(a.view(-1).view(torch.int64), b.view(-1).view(torch.int64))
    return torch.equal(a, b)


_kept_product = threading.local()  # the last stacked product, per thread (engines may decode in threads)
_products = itertools.count()  # numbers every stacked weight made in this process


@packed_linear_part.register_fake
def _(x, packed, bias, row_weight, row_bias, row_limit, product, start, end, parts):
    return x.new_empty(*x.shape[:-1], end - start)


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
    # siblings are stacked for the row kernel only: through oneDNN's kernel, q/k/v and gate/up stacked took
    # ~2% longer at 4-16 rows than each alone (in-process A/B of the compiled 1.5B, both load orders)
    swapped = dict(_fused(model, linears, output)) if rows and fuse_linears() else {}
    packed = []
    for name, linear in linears:
        parent, _, leaf = name.rpartition(".")
        if name in swapped:
            packed.append(swapped[name])
        else:
            packed.append(PrepackedLinear(linear, keep_dense=linear is output))
            if rows:
                packed[-1].row_weight = linear.weight.detach().contiguous()
        setattr(model.get_submodule(parent), leaf, packed[-1])
    model.castspec_prepacked = True
    model.castspec_row_limit = 0
    model.castspec_fused = 0
    if rows:
        # timed on the products of the first quarter of the layers (weights well beyond the caches: one layer's
        # timings swung 0.84-1.49x between products and loads of the 1.5B at 4 rows)
        first = [m for m in packed[:max(7, len(packed) // 4)] if m.dense is None]
        speedups = row_speedups or {count: rows_pay(first, count) for count in ROW_COUNTS}
        model.castspec_row_speedups = speedups
        timed = {count: speedup for count, speedup in speedups.items() if count in ROW_COUNTS}  # (older files: 4)
        limit = kernel_rows(timed) if _free_bytes() > ROW_KERNEL_MIN_FREE else 0
        model.castspec_row_limit = limit
        for module in packed:
            module.row_limit = limit
            if not limit:  # the dense copies go: oneDNN's packed kernel serves every row
                module.row_weight = module.row_bias = module.part = None
    model.castspec_fused = sum(m.part is not None for m in packed)
    return len(linears)


def fuse_linears() -> bool:
    return os.environ.get("CASTSPEC_FUSE_LINEARS", "1") != "0"


def _fused(model: nn.Module, linears: list[tuple[str, nn.Linear]],
           output: nn.Module | None) -> list[tuple[str, PrepackedLinear]]:
    """(name, layer) for every linear that is one of SHARED_INPUT_SIBLINGS under one parent, all of one input
    width, dtype and bias presence (the output layer is never fused)."""
    by_name = dict(linears)
    fused = []
    for parent, _ in model.named_modules():
        for names in SHARED_INPUT_SIBLINGS:
            full = [f"{parent}.{name}" if parent else name for name in names]
            siblings = [by_name.get(name) for name in full]
            if (any(s is None or s is output for s in siblings)
                    or len({(s.in_features, s.weight.dtype, s.bias is None) for s in siblings}) != 1):
                continue
            fused += zip(full, PrepackedLinear.fuse(siblings), strict=True)
    return fused


# the row kernel is kept where keeping the dense weights beside the packed ones leaves this much memory free
ROW_KERNEL_MIN_FREE = 2 << 30


def _free_bytes() -> int:
    """Memory the system can still hand out: Linux's MemAvailable (free pages plus the page cache it can drop).
    Free pages alone were below the bound whenever the page cache held model files (a vLLM server up beside
    castspec's, bench/peer-vllm): the row kernel was turned off with ~20 GB available."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as meminfo:
            line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def is_prepacked(model: nn.Module) -> bool:
    return bool(getattr(model, "castspec_prepacked", False))
