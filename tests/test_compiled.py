"""The compiled decode forward (`decode.compiled`) on the real SmolLM2-135M in fp32: its AR equals HF greedy, every
method's output equals its own AR (batched too), prompts carried by decode steps run in the compiled graph and a
forward of prompt chunks alone runs the eager path."""

from __future__ import annotations

import contextlib

import pytest
import torch
from synthetic import flat_costs

from castspec import Engine
from castspec.costs.table import setup_key
from castspec.decode import compiled as compiled_forward
from castspec.decode.row_linear import row_kernel
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.ngram import NgramDrafter
from castspec.models import load_model
from castspec.policies.base import ChainPolicy, Eagle2Policy

PROMPTS = [
    "def fibonacci(n):",
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat.",
    "Q: What is 17 * 23?\nA:",
    "Here is a list of fruits:\n- apple\n- banana\n-",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def compiled_smollm():
    """A model of its own (the session's `smollm` stays eager for the other tests), compiled once: two graphs."""
    lines = []
    model, tokenizer = load_model("smollm2-135m", "fp32", log=lines.append, compile=True)
    assert compiled_forward.is_compiled(model), lines
    assert any("decode forward compiled in" in line for line in lines), lines
    return model, tokenizer


def test_compiled_ar_matches_hf_greedy(compiled_smollm, smollm_reference):
    model, tokenizer = compiled_smollm
    engine = Engine(model, tokenizer)
    for prompt in PROMPTS:
        ids = engine.encode(prompt=prompt)
        assert engine.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS).output_ids == \
            smollm_reference(tuple(ids), NEW_TOKENS), prompt


def test_every_method_on_the_compiled_path_matches_its_ar_batched(compiled_smollm):
    from castspec.policies.cast import CastPolicy

    model, tokenizer = compiled_smollm
    ar = Engine(model, tokenizer)
    ids = [ar.encode(prompt=p) for p in PROMPTS]
    expected = [g.output_ids for g in ar.generate_batch(prompt_ids=ids, max_new_tokens=NEW_TOKENS)]
    engines = {
        "chain-ngram": Engine(model, tokenizer, NgramDrafter(), ChainPolicy(4)),
        "eagle2-ngram": Engine(model, tokenizer, NgramDrafter(), Eagle2Policy()),
        "eagle2-draft": Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy(2, 3, 6)),
        "cast-auto-ngram": Engine(model, tokenizer, NgramDrafter(), CastPolicy(flat_costs(), auto=True)),
    }
    for name, engine in engines.items():
        got = [g.output_ids for g in engine.generate_batch(prompt_ids=ids, max_new_tokens=NEW_TOKENS)]
        assert got == expected, name
        alone = engine.generate(prompt_ids=ids[1], max_new_tokens=NEW_TOKENS).output_ids
        assert alone == expected[1], name


def test_the_compiled_path_runs_decode_steps_and_keeps_its_own_cost_tables(compiled_smollm, monkeypatch):
    """Decode forwards go through the compiled forward, forwards of prompt tokens alone through the eager model; a
    compiled model's cost tables are not an eager one's."""
    model, tokenizer = compiled_smollm
    calls = {"compiled": 0}
    inner = model.castspec_compiled

    def counting(**kwargs):
        calls["compiled"] += 1
        assert kwargs["ragged"].has_trees  # a forward of prompt chunks alone never reaches the compiled graph
        return inner(**kwargs)

    monkeypatch.setattr(model, "castspec_compiled", counting)
    engine = Engine(model, tokenizer)
    engine.generate(prompt_ids=engine.encode(prompt=PROMPTS[0]), max_new_tokens=6)
    assert calls["compiled"] == 5  # the prompt's forward was eager, the 5 decode steps after it compiled
    assert setup_key(model)["forward"] == "compiled"
    with compiled_forward.eager(model):
        assert "forward" not in setup_key(model)
        engine.generate(prompt_ids=engine.encode(prompt=PROMPTS[0]), max_new_tokens=6)
    assert calls["compiled"] == 5


def test_decode_steps_of_any_shape_reuse_the_two_warm_graphs(compiled_smollm):
    """Batches of 1 to 5 rows, rows leaving and joining, trees of 1 to 64 nodes, caches growing, the cost probe's
    shapes: no step traces a graph beyond the two that `compile_target` traced. (Sizes that happen to be equal
    tied together made the probe's first forwards trace again on the 1.5B target, whose 2 KV heads matched the
    warm-up's 2 rows, 10-53 s each; SmolLM2's 3 KV heads do not meet that tie, so this test guards the rest.)"""
    from torch._dynamo.utils import counters

    from castspec.costs.online import OnlineCostTable
    from castspec.costs.profile import time_target_forward
    from castspec.policies.cast import CastPolicy

    model, tokenizer = compiled_smollm
    graphs = counters["stats"]["unique_graphs"]
    engine = Engine(model, tokenizer, NgramDrafter(), CastPolicy(flat_costs(), auto=True))
    ar = Engine(model, tokenizer)
    ids = [ar.encode(prompt=p) for p in PROMPTS]
    engine.generate_batch(prompt_ids=ids, max_new_tokens=40)  # rows finish at different steps
    engine.generate_batch(prompt_ids=ids[:3], max_new_tokens=8)
    ar.generate_batch(prompt_ids=ids[1:3], max_new_tokens=8)
    ar.generate(prompt_ids=ids[0], max_new_tokens=8)
    probe_points = OnlineCostTable.probe.__defaults__[1]
    for batch in (1, 3):
        for context, tokens in probe_points:
            time_target_forward(model, batch, context, tokens, repeats=1, warmup=0)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("method", ["ar", "cast-ngram"])
def test_prompts_carried_by_decode_steps_run_compiled_and_decode_as_alone(compiled_smollm, smollm_reference,
                                                                          method, monkeypatch):
    """Prompts joining a running batch by chunks of 8 tokens: every step that carries them runs the compiled graph
    (no graph beyond the warm two), and every answer equals HF greedy."""
    from test_batch import LONG
    from test_prefix_cache import carried_chunks, join_while_running
    from torch._dynamo.utils import counters

    from castspec.policies.cast import CastPolicy

    model, tokenizer = compiled_smollm
    carrying = {"compiled": 0}
    inner = model.castspec_compiled

    def counting(**kwargs):
        carrying["compiled"] += int(kwargs["ragged"].chunks.bounds.numel() > 0)
        return inner(**kwargs)

    monkeypatch.setattr(model, "castspec_compiled", counting)
    graphs = counters["stats"]["unique_graphs"]
    engine = Engine(model, tokenizer) if method == "ar" else \
        Engine(model, tokenizer, NgramDrafter(), CastPolicy(flat_costs(), auto=True))
    prompts = [engine.encode(prompt=p) for p in (PROMPTS[0], LONG, PROMPTS[3], PROMPTS[1])]
    steps = join_while_running(engine.stepper(max_batch_size=3, prefill_chunk=8), smollm_reference, {
        0: [("a", prompts[0], 40)], 2: [("long", prompts[1], 12)], 4: [("c", prompts[2], 10), ("d", prompts[3], 10)]})
    assert len(carried_chunks(steps)) >= 4 and carrying["compiled"] == len(carried_chunks(steps))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.skipif(row_kernel() is None, reason="no row kernel on this CPU: no siblings are stacked")
def test_stacked_siblings_run_inside_the_compiled_graph(monkeypatch):
    """A bf16 model whose q/k/v and gate/up are stacked for the row kernel compiles with no new graph, its decode
    steps of a few rows take the stacked products inside the compiled graph, and their logits match the same
    model's eager forward (bf16: up to the fused norms' rounding; eager, stacked and alone are equal bit for bit,
    tests/test_prepack.py)."""
    import castspec.decode.prepack as prepack_module
    from castspec.decode.target import Target
    from castspec.decode.tree import DraftTree

    model, tokenizer = load_model("smollm2-135m", "bf16", compile=True)
    if not model.castspec_fused:
        pytest.skip("the row kernel did not pay for this model here: nothing is stacked")
    assert compiled_forward.is_compiled(model) and setup_key(model)["linears"].endswith("+fused")
    stacked = []
    kernel = prepack_module.row_kernel()
    monkeypatch.setattr(prepack_module, "row_kernel", lambda: lambda *a: stacked.append(a[1].shape) or kernel(*a))
    target = Target(model)
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:2]]
    logits = {}
    for name in ("compiled", "eager"):
        with contextlib.nullcontext() if name == "compiled" else compiled_forward.eager(model):
            target.prefill(prompts)
            stacked.clear()
            logits[name] = target.verify([DraftTree.chain([tokenizer.eos_token_id or 0])] * 2)
            assert len(stacked) >= 2 * len(model.model.layers), name  # q/k/v and gate/up stacked, every layer
            target.keep_rows([])
    got, want = (torch.cat(logits[name][0]).float() for name in ("compiled", "eager"))
    # compiled and eager bf16 forwards differ by the fused norms' rounding, stacked or not (measured: the very same
    # differences with each layer alone); wrong columns would leave the logits unrelated
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    centred = [t - t.mean(-1, keepdim=True) for t in (got, want)]
    assert (torch.nn.functional.cosine_similarity(*centred, dim=-1) > 0.99).all()
