"""decode.widen_linear: bf16 linears on a CPU with no bf16 arithmetic, by castspec's AVX2 kernel (bf16 weights
widened to fp32 in registers). The kernel rounds the exact dot product once, gives every row what it gives that
row alone (batch-invariant), and the swap keeps the model what it was (the same parameter objects, a tied output
layer still tied, logits as close to fp32's as aten's bf16 path gives, cost tables of its own). Exactness is
an fp32 matter (tests/test_exactness.py) and fp32 layers are never widened: in bf16 the linears alone being
batch-invariant did not make speculative output equal AR's (a chain over the model itself differed on an HTML
prompt: ops other than the linears, attention among them, need not round a tree as a one-row step). The kernel is
built wherever the CPU has AVX2 (every machine this project runs on), so these tests run on CPUs with native bf16
too (`anywhere=True`), where the loader itself keeps oneDNN's kernels."""

from __future__ import annotations

import pytest
import torch
from test_exactness import PROMPTS
from torch import nn

from castspec.costs.table import model_identity, setup_key
from castspec.decode.widen_linear import (
    WidenedLinear,
    build_error,
    build_kernel,
    is_widened,
    needs_widening,
    widen,
)
from castspec.models import load_model

pytestmark = pytest.mark.skipif(build_kernel() is None, reason=f"no AVX2 kernel here ({build_error or 'no AVX2'})")


@pytest.fixture(scope="module")
def widened_bf16():
    model, tokenizer = load_model("smollm2-135m", "bf16", prepack=False)
    count = sum(type(m) is nn.Linear for m in model.modules())
    assert widen(model, anywhere=True) == count > 0 and is_widened(model)
    assert not any(type(m) is nn.Linear for m in model.modules())
    return model, tokenizer


@pytest.mark.parametrize(("out_features", "in_features", "rows"),
                         [(24, 64, 1), (50, 100, 3), (7, 9, 5), (96, 1536, 4), (33, 200, 17)])
def test_the_widening_kernel_rounds_the_exact_dot_product_once(out_features, in_features, rows):
    torch.manual_seed(out_features * rows)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    got = build_kernel()(x, weight, bias)
    exact = x.double() @ weight.double().T + bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # one bf16 rounding (half an ulp: 2^-9 of the value) of an fp32 sum (its error far below that)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3 * in_features**0.5).all()
    no_bias = build_kernel()(x, weight, None).double()
    assert ((no_bias - (exact - bias.double())).abs() <= (exact - bias.double()).abs() * 2**-8 + 0.05).all()


def test_each_row_gets_what_it_gets_alone_whatever_the_rows_beside_it():
    torch.manual_seed(0)
    weight = torch.randn(75, 136, dtype=torch.bfloat16)
    bias = torch.randn(75, dtype=torch.bfloat16)
    x = torch.randn(2, 13, 136, dtype=torch.bfloat16)  # any leading shape: rows are the product of the rest
    together = build_kernel()(x, weight, bias)
    assert together.shape == (2, 13, 75)
    alone = torch.stack([torch.stack([build_kernel()(row[None], weight, bias)[0] for row in batch]) for batch in x])
    assert torch.equal(together, alone)  # bit for bit: a tree's nodes and a batch's rows as one-row steps


def test_a_widened_model_keeps_its_parameters_and_logits_and_its_own_cost_tables(widened_bf16):
    widened, tokenizer = widened_bf16
    stock, _ = load_model("smollm2-135m", "bf16", prepack=False)
    assert not is_widened(stock) and model_identity(widened) == model_identity(stock)
    assert sum(p.numel() for p in widened.parameters()) == sum(p.numel() for p in stock.parameters())
    if stock.config.tie_word_embeddings:  # the output layer still reads the input embedding's parameter
        assert widened.get_output_embeddings().weight is widened.get_input_embeddings().weight
    stock_key, widened_key = setup_key(stock), setup_key(widened)
    assert widened_key.pop("linears") == "widened-avx2" and "linears" not in stock_key and widened_key == stock_key
    # bf16 rounding through 30 layers moves logits by ~0.15 either way, so both are held against fp32's: the
    # widened model is as close to it as aten's bf16 path is (it was a little closer: 0.146 against 0.159)
    exact_model, _ = load_model("smollm2-135m", "fp32")
    ids = torch.tensor([tokenizer(PROMPTS[2] + PROMPTS[6]).input_ids])
    with torch.inference_mode():
        exact = exact_model(ids).logits.float()
        want, got = stock(ids).logits.float(), widened(ids).logits.float()
    assert (got - exact).abs().mean() <= 1.1 * (want - exact).abs().mean()
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


def test_gradients_flow_through_a_widened_layer_as_through_nn_linear():
    torch.manual_seed(1)
    plain = nn.Linear(16, 8, dtype=torch.bfloat16)
    layer = WidenedLinear(plain)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    want = x.grad.clone()
    x.grad = None
    plain(x).float().sum().backward()
    assert torch.equal(x.grad, want) and plain.weight.grad is not None


def test_the_loader_widens_bf16_exactly_where_this_cpu_has_no_bf16_arithmetic():
    model, _ = load_model("smollm2-135m", "bf16")
    assert is_widened(model) == needs_widening()
    fp32, _ = load_model("smollm2-135m", "fp32")
    assert not is_widened(fp32)  # fp32 stays on aten's kernels, which HF's own decoding runs
