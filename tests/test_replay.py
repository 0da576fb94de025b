"""Replay (castspec/bench/replay.py) and the tune grid: a replay against the target's greedy output must accept exactly
what real decoding accepts, step by step (fp32, real SmolLM2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from synthetic import flat_costs

from castspec.api import Engine
from castspec.bench.replay import accepted_path, reference_features, replay
from castspec.bench.tune import parse_grid, run_tune
from castspec.decode.tree import DraftTree
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.eagle_head import EagleHeadDrafter, load_eagle_head
from castspec.drafters.ngram import NgramDrafter
from castspec.errors import CastspecError
from castspec.policies.base import ChainPolicy, Eagle2Policy
from castspec.policies.cast import CastPolicy


def test_accepted_path_follows_the_reference_through_branches():
    #        0(root)
    #     1:a      2:b
    #   3:c  4:d     5:e
    tree = DraftTree.from_lists([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2], [1, .6, .4, .3, .3, .2])
    assert accepted_path(tree, [7, 9, 1, 4, 8], start=2) == [1, 4]
    assert accepted_path(tree, [7, 9, 2, 5], start=2) == [2, 5]  # the reference ends: no bonus left
    assert accepted_path(tree, [7, 9, 3], start=2) == []
    assert accepted_path(tree, [7, 9], start=2) == []


def test_parse_grid_products_and_refusals():
    points = parse_grid("eagle2", "top_k=2,4;depth=3;total_tokens=8,16,16")
    assert points == [{"top_k": 2, "depth": 3, "total_tokens": 8}, {"top_k": 2, "depth": 3, "total_tokens": 16},
                      {"top_k": 4, "depth": 3, "total_tokens": 8}, {"top_k": 4, "depth": 3, "total_tokens": 16}]
    assert len(parse_grid("eagle2", None)) == 4 * 6 * 4
    assert parse_grid("chain", "chain_length=1,3") == [{"chain_length": 1}, {"chain_length": 3}]
    for method, grid, message in [("eagle2", "chain_length=2", "not an option"), ("eagle2", "top_k=0", "positive"),
                                  ("eagle2", "top_k=a", "integers"), ("cast", None, "fixed trees"),
                                  ("eagle2", ";", "empty"), ("eagle2", "total_tokens=1", "at least 2")]:
        with pytest.raises(CastspecError, match=message):
            parse_grid(method, grid)


TRAINED_HEAD = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-eagle"  # drafts that get accepted
PROMPT = ("Copy this list exactly, twice: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. "
          "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu.")


@pytest.mark.parametrize("make", [
    lambda model: (NgramDrafter(), Eagle2Policy(top_k=4, depth=4, total_tokens=12)),
    lambda model: (NgramDrafter(), ChainPolicy(3)),
    lambda model: (NgramDrafter(), CastPolicy(flat_costs(), auto=False)),
    lambda model: (NgramDrafter(), CastPolicy(flat_costs(), auto=False, calibrate=True)),
    lambda model: (DraftModelDrafter(model), Eagle2Policy(top_k=2, depth=3, total_tokens=6)),
    lambda model: (EagleHeadDrafter(load_eagle_head(str(TRAINED_HEAD), model), model),
                   Eagle2Policy(top_k=4, depth=4, total_tokens=12)),
    lambda model: (EagleHeadDrafter(load_eagle_head(str(TRAINED_HEAD), model), model),
                   CastPolicy(flat_costs(), auto=False)),
], ids=["eagle2-ngram", "chain-ngram", "cast-paper-ngram", "cast-calibrated-ngram", "eagle2-draft-model",
        "eagle2-head", "cast-paper-head"])
def test_replay_accepts_exactly_what_decoding_accepts(smollm, make):
    model, tokenizer = smollm
    max_new = 40
    ar = Engine(model, tokenizer)
    ids = ar.encode(messages=[{"role": "user", "content": PROMPT}])
    reference = ar.generate(prompt_ids=ids, max_new_tokens=max_new + 16).output_ids
    drafter, policy = make(model)
    real = Engine(model, tokenizer, drafter, policy).generate(prompt_ids=ids, max_new_tokens=max_new)
    assert real.output_ids == reference[:max_new]
    drafter, policy = make(model)  # fresh state: CAST's depth ratios, the drafter's cache
    # a head reads the target's features: one forward over prompt + reference stands in for every verify pass
    features = reference_features(model, ids, reference, drafter.feature_layers) if drafter.feature_layers else None
    replayed = replay(drafter, policy, ids, reference, flat_costs(), max_new, features)
    accepted = [s.accepted for s in real.steps]
    # the last step may accept drafted tokens past an EOS, which the reference (it stopped there) cannot show
    assert replayed.accepted[:-1] == accepted[:-1] and replayed.accepted[-1] <= accepted[-1]
    assert replayed.tree_sizes == [s.tree_size for s in real.steps]
    assert replayed.depths == [s.draft.depth for s in real.steps]
    assert replayed.new_tokens == len(real.output_ids)
    assert max(replayed.accepted) > 1  # the drafts were accepted somewhere: the comparison is not vacuous
    assert replayed.verify_s > 0 and replayed.ar_s > 0


def test_replay_needs_the_features_a_drafter_reads():
    class FeatureDrafter(NgramDrafter):
        feature_layers = (-1,)

    with pytest.raises(CastspecError, match="reads target features: pass"):
        replay(FeatureDrafter(), ChainPolicy(2), [1, 2, 3], [4, 5], flat_costs(), 8)
    with pytest.raises(CastspecError, match="features cover 3 positions"):
        replay(FeatureDrafter(), ChainPolicy(2), [1, 2, 3], [4, 5], flat_costs(), 8, torch.zeros(3, 16))
    with pytest.raises(CastspecError, match="empty"):
        replay(NgramDrafter(), ChainPolicy(2), [1, 2, 3], [], flat_costs(), 8)


def test_tune_replays_a_head_on_the_targets_features(smollm):
    """`castspec tune --head`: the whole grid and CAST replay with the head fed the reference's features; the
    replayed head drafts trees that the reference accepts."""
    model, tokenizer = smollm
    head = load_eagle_head(str(TRAINED_HEAD), model)
    prompts = [{"id": "copy", "task": "copy", "messages": [{"role": "user", "content": PROMPT}]}]
    result = run_tune(model, tokenizer, None, "chain", "head", [{"chain_length": 2}, {"chain_length": 4}], prompts,
                      24, flat_costs(), lambda: EagleHeadDrafter(head, model), measure=0, head=(head, "trained"))
    rows = {r["method"]: r for r in result["replayed"]}
    assert set(rows) == {"chain:head:chain_length=2", "chain:head:chain_length=4", "cast:head",
                         "cast:head:calibrate=1", "cast:head:auto=0"}
    assert rows["chain:head:chain_length=4"]["mean_depth"] > rows["chain:head:chain_length=2"]["mean_depth"]
    # features line up: the head's drafts are accepted (calibrated CAST may rightly stop drafting for a weak head)
    assert all(r["tau"] > 1 for m, r in rows.items() if m != "cast:head:calibrate=1")
    assert result["measured"] is None
