"""decode.prepack, on the real SmolLM2-135M: linear weights reordered once for the CPU's matrix units. The swap
keeps the model what it was (the stock modules call it, the parameter count that names the model is unchanged,
logits equal up to the kernels' rounding), decoding on the packed path is exact (packed in fp32 on purpose here:
every method's greedy output equals the same path's AR output, alone and batched), its cost tables are its own,
and gradients still flow through a packed layer (a head trained through the target's lm_head)."""

from __future__ import annotations

import pytest
import torch
from synthetic import flat_costs
from test_exactness import PROMPTS, engines
from torch import nn

from castspec import Engine
from castspec.costs.table import CostTable, model_identity, setup_key
from castspec.decode.prepack import (
    BUCKETS_PER_OCTAVE,
    PAD_ABOVE,
    PrepackedLinear,
    bucket_rows,
    can_prepack,
    is_prepacked,
    prepack,
)
from castspec.decode.row_linear import build_error, kernel_rows, row_kernel
from castspec.drafters.ngram import NgramDrafter
from castspec.errors import CastspecError
from castspec.models import load_model
from castspec.policies.cast import CastPolicy

NEW_TOKENS = 24


def linears(model: nn.Module) -> int:
    return sum(type(m) is nn.Linear for m in model.modules())


@pytest.fixture(scope="module")
def packed_fp32():
    """A second fp32 SmolLM, packed although fp32 is not packed by default: exactness is tested in fp32."""
    model, tokenizer = load_model("smollm2-135m", "fp32")
    assert not is_prepacked(model)  # the default leaves fp32 on aten's kernels, which HF's decoding runs
    count = linears(model)
    assert prepack(model, dtypes=(torch.float32,)) == count > 0
    assert linears(model) == 0 and sum(isinstance(m, PrepackedLinear) for m in model.modules()) == count
    return model, tokenizer


def test_bf16_is_packed_by_default_with_the_same_parameters_and_logits():
    stock, tokenizer = load_model("smollm2-135m", "bf16", prepack=False)
    if not can_prepack(stock):
        pytest.skip("this CPU's oneDNN has no native bf16 kernels: bf16 stays unpacked here")
    packed, _ = load_model("smollm2-135m", "bf16")
    assert is_prepacked(packed) and not is_prepacked(stock) and linears(packed) == 0
    assert model_identity(packed) == model_identity(stock)  # the same model, by the key that names it
    stock_key, packed_key = setup_key(stock), setup_key(packed)
    limit = packed.castspec_row_limit
    rows = "+row-kernel" + (f"-{limit}-rows" if limit > 1 else "") if limit else ""
    fused = "+fused" if packed.castspec_fused else ""
    assert packed_key.pop("linears") == "onednn-prepacked" + rows + fused and packed_key == stock_key
    ids = torch.tensor([tokenizer(PROMPTS[2] + PROMPTS[6]).input_ids])
    with torch.inference_mode():
        want, got = stock(ids).logits.float(), packed(ids).logits.float()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)  # bf16 rounding, nothing more
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95
    # the output layer keeps its dense weight (EAGLE heads and draft vocabularies slice it)
    assert torch.equal(packed.get_output_embeddings().weight, stock.get_output_embeddings().weight)


def test_every_method_on_the_packed_path_gives_its_own_ar_output(packed_fp32):
    model, tokenizer = packed_fp32
    made = dict(engines(model, tokenizer))
    made["cast-ngram"] = Engine(model, tokenizer, NgramDrafter(), CastPolicy(flat_costs(), auto=True))
    ar = made.pop("ar")
    for prompt in PROMPTS[:6] + PROMPTS[10:12]:
        expected = ar.generate(prompt=prompt, max_new_tokens=NEW_TOKENS).output_ids
        for name, engine in made.items():
            assert engine.generate(prompt=prompt, max_new_tokens=NEW_TOKENS).output_ids == expected, (name, prompt)


def test_batched_decoding_on_the_packed_path_gives_each_row_its_ar_output(packed_fp32):
    model, tokenizer = packed_fp32
    prompts = PROMPTS[:4]
    ar = Engine(model, tokenizer)
    expected = [ar.generate(prompt=p, max_new_tokens=NEW_TOKENS).output_ids for p in prompts]
    for engine in (ar, dict(engines(model, tokenizer))["eagle2-draft"]):
        assert [g.output_ids for g in engine.generate_batch(prompts, NEW_TOKENS)] == expected


def test_cost_tables_of_packed_and_unpacked_setups_are_kept_apart(packed_fp32, smollm, tmp_path):
    packed_model, _ = packed_fp32
    stock_model, _ = smollm
    table = flat_costs()
    table.meta = {"target": setup_key(stock_model)}
    table.save(tmp_path / "stock.json")
    assert CostTable.load(tmp_path / "stock.json", expect=setup_key(stock_model))
    with pytest.raises(CastspecError, match="linears: table None, here 'onednn-prepacked'"):
        CostTable.load(tmp_path / "stock.json", expect=setup_key(packed_model))
    table.meta = {"target": setup_key(packed_model)}
    table.save(tmp_path / "packed.json")
    with pytest.raises(CastspecError, match="linears: table 'onednn-prepacked', here None"):
        CostTable.load(tmp_path / "packed.json", expect=setup_key(stock_model))


@pytest.mark.skipif(row_kernel() is None, reason=f"no row kernel on this CPU ({build_error or 'no AVX512-BF16'})")
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("out_features, in_features", [(96, 576), (1536, 8960), (37, 33), (8, 70)])
def test_the_row_kernel_rounds_the_exact_dot_product_once(out_features, in_features, rows):
    """A few rows through a bf16 layer by castspec's kernel: each output the fp32 product and bias rounded once to
    bf16, for widths that fill the 32-lane loads and ones that end in a partial load, output tiles of 8 and 6
    and short last ones, and row counts that fill the four-row chunks or leave a remainder."""
    torch.manual_seed(out_features + rows)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    x = torch.randn(1, rows, in_features, dtype=torch.bfloat16)
    exact = nn.functional.linear(x.double(), weight.double(), bias.double())
    got = row_kernel()(x, weight, bias)
    assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
    # fp32 accumulation in another order than float64's: at most one bf16 step from the exact value
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all()
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.97
    no_bias = nn.functional.linear(x.double(), weight.double())
    assert ((row_kernel()(x, weight, None).double() - no_bias).abs() <= no_bias.abs() * 2**-7 + 1e-3).all()
    # a row's result does not depend on the rows beside it
    assert torch.equal(row_kernel()(x[:, -1:], weight, bias), got[:, -1:])


@pytest.mark.skipif(row_kernel() is None, reason=f"no row kernel on this CPU ({build_error or 'no AVX512-BF16'})")
def test_a_packed_layer_sends_up_to_its_row_limit_to_the_row_kernel_and_more_to_onednn():
    torch.manual_seed(0)
    plain = nn.Linear(64, 40).to(torch.bfloat16)
    packed = PrepackedLinear(plain)
    packed.row_weight, packed.row_limit = plain.weight.detach(), 4
    with torch.inference_mode():
        for rows in (1, 4, 5):
            x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
            by_layer = packed(x)
            want = (row_kernel()(x, plain.weight, plain.bias) if rows <= 4 else
                    torch.ops.mkldnn._linear_pointwise(x, packed._packed, plain.bias, "none", [], ""))
            assert torch.equal(by_layer, want)
            torch.testing.assert_close(by_layer.float(), plain(x).float(), atol=0.05, rtol=0.02)


def test_the_kernel_takes_every_row_count_up_to_the_largest_that_paid_and_all_below_it():
    assert kernel_rows({1: 1.3, 2: 1.2, 4: 1.1, 8: 0.9}) == 4
    assert kernel_rows({1: 1.3, 2: 1.01, 4: 1.2, 8: 1.2}) == 1  # a count that did not pay ends the run
    assert kernel_rows({1: 0.98, 2: 1.3}) == 0
    assert kernel_rows({8: 1.2, 1: 1.2, 4: 1.2, 2: 1.2}) == 8


def test_row_counts_are_rounded_to_a_bounded_set_that_wastes_at_most_an_eighth():
    counts = range(1, 8193)
    buckets = [bucket_rows(rows) for rows in counts]
    assert buckets[:PAD_ABOVE] == list(range(1, PAD_ABOVE + 1))  # decode steps keep their exact shapes
    most = 1 + 1 / BUCKETS_PER_OCTAVE
    assert all(rows <= padded <= rows * most for rows, padded in zip(counts, buckets, strict=True))
    assert buckets == sorted(buckets) and all(bucket_rows(b) == b for b in buckets)
    assert len(set(buckets)) < PAD_ABOVE + 13 * BUCKETS_PER_OCTAVE  # ~100 shapes for every prompt chunk up to 8k


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this CPU's oneDNN has no native bf16 kernels: bf16 weights are not packed here")
def test_a_padded_row_count_gives_each_row_what_onednn_gives_it_at_the_bucket():
    torch.manual_seed(0)
    plain = nn.Linear(64, 40).to(torch.bfloat16)
    packed = PrepackedLinear(plain)
    with torch.inference_mode():
        for rows in (17, 33, 100):
            x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
            got = packed(x)
            assert got.shape == (1, rows, 40) and bucket_rows(rows) > rows
            wide = torch.cat([x[0], x.new_zeros(bucket_rows(rows) - rows, 64)])
            want = torch.ops.mkldnn._linear_pointwise(wide, packed._packed, plain.bias, "none", [], "")[:rows]
            assert torch.equal(got[0], want)
            torch.testing.assert_close(got.float(), plain(x).float(), atol=0.05, rtol=0.02)


def test_gradients_flow_through_a_packed_layer_as_through_nn_linear():
    torch.manual_seed(0)
    plain = nn.Linear(32, 16)
    packed = PrepackedLinear(plain, keep_dense=True)
    x = torch.randn(3, 5, 32, requires_grad=True)
    plain(x).square().sum().backward()
    want = x.grad.clone()
    x.grad = None
    packed(x).square().sum().backward()
    torch.testing.assert_close(x.grad, want)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x.detach()), plain(x.detach()), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(row_kernel() is None, reason=f"no row kernel on this CPU ({build_error or 'no AVX512-BF16'})")
def test_siblings_reading_one_input_share_one_row_kernel_product_and_give_what_each_gives_alone(monkeypatch):
    """For the row kernel, q/k/v and gate/up weights are stacked (one product per group in a forward of a few
    rows; oneDNN keeps a packed weight per layer): logits equal bit for bit those of the same model with each
    layer alone, at every row count, and the parameters are the same."""
    import castspec.decode.prepack as prepack_module

    fused, tokenizer = load_model("smollm2-135m", "bf16")
    monkeypatch.setenv("CASTSPEC_FUSE_LINEARS", "0")
    alone, _ = load_model("smollm2-135m", "bf16")
    limit, layers = fused.castspec_row_limit, len(fused.model.layers)
    if not limit:
        pytest.skip("the row kernel did not pay for this model here: nothing is stacked")
    assert fused.castspec_fused == 5 * layers and alone.castspec_fused == 0
    assert model_identity(fused) == model_identity(alone) and setup_key(fused)["linears"].endswith("+fused")
    products = []
    kernel = row_kernel()
    monkeypatch.setattr(prepack_module, "row_kernel", lambda: lambda *a: products.append(a[1].shape) or kernel(*a))
    ids = torch.tensor([tokenizer(PROMPTS[2] + PROMPTS[6]).input_ids])
    alone.castspec_row_limit = limit
    for module in alone.modules():
        if isinstance(module, PrepackedLinear):
            module.row_limit = limit  # both at the same limit (each load timed its own)
    with torch.inference_mode():
        for rows in (*range(1, limit + 1), limit + 1, ids.shape[1]):
            products.clear()
            got = fused(ids[:, :rows]).logits
            if rows <= limit:  # qkv, o, gate/up, down a layer, then the output layer
                assert len(products) == 4 * layers + 1
            assert torch.equal(got, alone(ids[:, :rows]).logits), rows


@pytest.mark.skipif(row_kernel() is None, reason=f"no row kernel on this CPU ({build_error or 'no AVX512-BF16'})")
def test_a_stacked_sibling_called_alone_or_on_another_input_computes_its_own_columns():
    torch.manual_seed(0)
    plain = [nn.Linear(48, out).to(torch.bfloat16) for out in (32, 8, 8)]
    q, k, v = PrepackedLinear.fuse(plain)
    for layer in (q, k, v):
        layer.row_limit = 4
    x, y = torch.randn(2, 48, dtype=torch.bfloat16), torch.randn(2, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = [[row_kernel()(t, layer.weight, layer.bias) for layer in plain] for t in (x, y)]
        assert torch.equal(q(x), want[0][0])
        assert torch.equal(k(y), want[1][1])  # a new input while x's product is kept: y's own product
        assert torch.equal(v(x), want[0][2])
        assert torch.equal(v(x), want[0][2])  # again, after every sibling was served: computed again
        assert all(torch.equal(a, b) for a, b in zip([q(y), k(y), v(y)], want[1], strict=True))
        wide = torch.randn(6, 48, dtype=torch.bfloat16)  # past the row limit: oneDNN over each layer's own weight
        torch.testing.assert_close(k(wide), plain[1](wide), atol=0.05, rtol=0.02)
    assert torch.equal(k.weight, plain[1].weight)
    assert sum(p.numel() for layer in (q, k, v) for p in layer.parameters()) == sum(
        p.numel() for layer in plain for p in layer.parameters())


def test_free_memory_counts_the_page_cache_the_system_can_drop():
    """The row kernel's memory bound reads what the system can hand out (MemAvailable), not free pages alone: a
    page cache full of model files once turned the kernel off with ~20 GB available."""
    import os

    from castspec.decode.prepack import _free_bytes

    assert _free_bytes() >= 0.99 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
