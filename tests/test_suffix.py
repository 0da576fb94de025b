"""The suffix-tree drafter: its trie against brute-force counts, its proposals, the shared tree's budget, and
lossless decoding on the real SmolLM2-135M (fp32, against HF greedy) alone, batched and merged."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from castspec.api import Engine
from castspec.decode.engine import RequestError, RequestParams, StepEngine
from castspec.decode.tree import TreePool
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.eagle_head import EagleHeadDrafter
from castspec.drafters.suffix import SharedSuffixTrie, SuffixDrafter, SuffixTrie
from castspec.drafters.with_ngram import NgramAugmentedDrafter
from castspec.errors import CastspecError
from castspec.policies.base import ChainPolicy, Eagle2Policy
from castspec.policies.cast import CastPolicy
from tests.synthetic import flat_costs

REPEATS = ("def area(width, height):\n    return width * height\n\n"
           "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
           "Rewrite both functions with type hints, otherwise unchanged:\n\n")
PROMPTS = [REPEATS, "def fibonacci(n):", "The capital of France is Paris. The capital of France is",
           "1, 2, 3, 4, 5, 6, 7, 8,"]
NEW_TOKENS = 32


def substring_counts(tokens: list[int], max_depth: int) -> Counter:
    return Counter(tuple(tokens[i:j]) for i in range(len(tokens)) for j in range(i + 1, min(len(tokens), i +
                                                                                            max_depth) + 1))


def trie_counts(trie: SuffixTrie) -> Counter:
    out, stack = Counter(), [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in (trie.children[node] or {}).items():
            out[path + (token,)] = trie.counts[child]
            stack.append((child, path + (token,)))
    return out


def test_trie_counts_every_substring_up_to_its_depth_and_remove_undoes_add():
    rng = random.Random(0)
    first, second = [rng.randrange(4) for _ in range(60)], [rng.randrange(4) for _ in range(40)]
    trie = SuffixTrie(5)
    trie.add(first)
    assert trie_counts(trie) == substring_counts(first, 5)
    trie.add(second)
    assert trie_counts(trie) == substring_counts(first, 5) + substring_counts(second, 5)
    trie.remove(first)
    assert trie_counts(trie) == substring_counts(second, 5)
    assert len(trie) == 1 + len(substring_counts(second, 5))  # the freed nodes are really gone


def test_proposals_are_the_continuations_of_the_longest_match_scored_by_count_and_length():
    drafter = SuffixDrafter(max_depth=8)
    # "7 1 2" is the longest match of the suffix "... 7 1 2"; it was followed by 3 twice and by 4 once
    history = [7, 1, 2, 3, 9, 7, 1, 2, 3, 5, 7, 1, 2, 4, 6, 7, 1, 2]
    (cands,) = drafter.begin([history], 4)
    tokens, probs = cands.tokens[0].tolist(), cands.probs[0].tolist()
    assert tokens[:2] == [3, 4]
    assert probs[0] == pytest.approx(2 / 4 * 3 / 4) and probs[1] == pytest.approx(1 / 4 * 3 / 4)
    assert probs[2:] == [0, 0]
    assert cands.matched == [3]  # the match's length goes with the candidates (CAST calibrates by it)
    # a node's path extends the match: after "... 7 1 2 3" come 9 and 5, one each, behind a 4-token match
    pool = TreePool.from_lists([2, 3, 4], [-1, 0, 0])
    (expanded,) = drafter.expand([pool], [[1, 2]], 4)
    assert sorted(expanded.tokens[0, :2].tolist()) == [5, 9]
    assert expanded.probs[0, 0] == pytest.approx(1 / 3 * 4 / 5)
    assert expanded.tokens[1, 0] == 6  # "7 1 2 4" was followed by 6
    assert expanded.matched == [4, 4]
    drafter.end_step()
    # single-token matches count too: nothing longer than "9" matches after a new 9
    (cands,) = drafter.begin([[9]], 4)
    assert cands.tokens[0, 0] == 7 and cands.probs[0, 0] == pytest.approx(1 / 2 * 1 / 2)
    assert cands.matched == [1]


def test_shared_tree_keeps_finished_outputs_within_its_budget_and_only_for_rows_that_opt_in():
    shared = SharedSuffixTrie(max_tokens=10, max_depth=4)
    drafter = SuffixDrafter(4, shared)
    drafter.reset(2)
    drafter.set_sharing([0], [True])
    drafter.begin([[1, 2, 10, 11, 12, 13], [1, 2, 20, 21, 22, 23]], 4)  # prompts [1 2 x y z] + first token
    drafter.end_step()
    drafter.keep_rows([])
    assert list(shared.outputs) == [[13]]  # row 0's output only; row 1 did not opt in
    drafter.reset(1)
    drafter.set_sharing([0], [True])
    drafter.begin([[5, 30]], 4)
    drafter.begin([list(range(31, 40))], 4)
    drafter.keep_rows([])
    assert shared.tokens == 10 and list(shared.outputs) == [list(range(30, 40))]  # the oldest evicted
    reader = SuffixDrafter(4, shared, share=True)
    (cands,) = reader.begin([[99, 32, 33]], 4)
    assert cands.tokens[0, 0] == 34  # found only in the shared tree
    (alone,) = SuffixDrafter(4, shared, share=False).begin([[99, 32, 33]], 4)
    assert float(alone.probs.sum()) == 0


def test_sharing_needs_a_shared_tree():
    with pytest.raises(CastspecError, match="shared"):
        SuffixDrafter(share=True)
    with pytest.raises(CastspecError, match="no history shared"):
        SuffixDrafter().set_sharing([0], [True])
    with pytest.raises(CastspecError, match="token budget"):
        SharedSuffixTrie(0)
    with pytest.raises(CastspecError, match="depth"):
        SuffixDrafter(max_depth=0)


def test_suffix_cost_per_step_at_8k_context_is_measured_and_small_beside_a_forward():
    """Not a timing assertion: the 8k-token history must be absorbed and a 60-node layer expanded; the numbers
    themselves are reported by bench/scripts/suffix_cost.py."""
    rng = random.Random(1)
    history = [rng.randrange(500) for _ in range(8192)]
    drafter = SuffixDrafter()
    drafter.begin([history], 8)
    pool = TreePool.from_lists([history[-1]] + history[:60], [-1] + [0] * 60)
    (cands,) = drafter.expand([pool], [list(range(1, 61))], 8)
    assert cands.tokens.shape == (60, 8)
    assert len(drafter.rows[0].trie) > 8192


# --- the real model ----------------------------------------------------------------------------------------------

def suffix_engines(model, tokenizer, random_head):
    yield "chain-suffix", Engine(model, tokenizer, SuffixDrafter(), ChainPolicy(6))
    yield "eagle2-suffix", Engine(model, tokenizer, SuffixDrafter(), Eagle2Policy(4, 6, 24))
    yield "cast-calibrated-suffix", Engine(model, tokenizer, SuffixDrafter(),
                                           CastPolicy(flat_costs(), auto=True, calibrate=True))
    yield "cast-paper-suffix", Engine(model, tokenizer, SuffixDrafter(), CastPolicy(flat_costs(), 1.0, 1.0, 0.5))
    yield "eagle2-draft+suffix", Engine(model, tokenizer, NgramAugmentedDrafter(DraftModelDrafter(model),
                                                                                SuffixDrafter()),
                                        Eagle2Policy(4, 4, 16))
    yield "cast-head+suffix", Engine(model, tokenizer, NgramAugmentedDrafter(EagleHeadDrafter(random_head, model),
                                                                             SuffixDrafter()),
                                     CastPolicy(flat_costs(), 1.0, 1.0, 0.5, calibrate=True, payoff=False))


def test_every_policy_and_merge_over_the_suffix_drafter_matches_hf_greedy(smollm, smollm_reference, random_head):
    model, tokenizer = smollm
    drafted = Counter()
    for name, engine in suffix_engines(model, tokenizer, random_head):
        for prompt in PROMPTS:
            ids = engine.encode(prompt=prompt)
            got = engine.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
            assert got.output_ids == smollm_reference(tuple(ids), NEW_TOKENS), (name, prompt)
            drafted[name] += sum(s.accepted - 1 for s in got.steps)
    assert all(drafted[name] > 0 for name, _ in suffix_engines(model, tokenizer, random_head)), drafted


def test_batched_suffix_decoding_matches_each_prompt_alone(smollm, smollm_reference):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, SuffixDrafter(), CastPolicy(flat_costs(), 1.0, 1.0, 0.5, calibrate=True,
                                                                  payoff=False))
    ids = [engine.encode(prompt=p) for p in PROMPTS]
    got = engine.generate_batch(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
    for row, prompt_ids in zip(got, ids, strict=True):
        assert row.output_ids == smollm_reference(tuple(prompt_ids), NEW_TOKENS)
    assert max(max(s.accepted for s in row.steps) for row in got) > 1


def test_a_shared_tree_makes_a_repeated_request_faster_and_stays_exact(smollm, smollm_reference):
    """Requests join and leave a stepping engine; the ones that opt in read and extend one shared tree, so the
    same request again is drafted from the first one's output."""
    model, tokenizer = smollm
    shared = SharedSuffixTrie(4096)
    engine = StepEngine(Engine(model, tokenizer).target, SuffixDrafter(shared=shared), Eagle2Policy(4, 8, 32),
                        tokenizer, set(), max_batch_size=2)
    prompt = tokenizer("A short story about a robot who learns to paint:")["input_ids"]
    reference = smollm_reference(tuple(prompt), 48)
    taus = []
    for request in ("first", "second"):
        engine.add_request(request, prompt, RequestParams(max_tokens=48, share_history=True))
        engine.add_request(request + "-alone", prompt, RequestParams(max_tokens=48))
        done = {}
        for _ in range(200):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            if not engine.has_unfinished():
                break
        for rid in (request, request + "-alone"):
            assert done[rid].output_ids == reference, rid
        taus.append(48 / len(done[request].steps))
    assert shared.tokens >= 48
    assert taus[1] > taus[0] + 1, taus


def test_share_history_needs_a_drafter_with_a_shared_tree(smollm):
    model, tokenizer = smollm
    engine = StepEngine(Engine(model, tokenizer).target, SuffixDrafter(), ChainPolicy(3), tokenizer, set())
    with pytest.raises(RequestError, match="suffix-shared-tokens") as e:
        engine.add_request(None, [1, 2, 3], RequestParams(share_history=True))
    assert e.value.param == "share_history"
    with pytest.raises(RequestError, match="true or false"):
        RequestParams(share_history="yes")


def test_engine_load_defaults_calibration_on_for_the_suffix_drafter(tmp_path):
    table = tmp_path / "flat.json"
    flat_costs().save(table)
    engine = Engine.load("smollm2-135m", "cast", drafter="suffix", dtype="fp32", cost_model="fixed",
                         cost_table=str(table), force_table=True, suffix_shared_tokens=1000)
    assert engine.policy.calibration is not None and engine.drafter.name == "suffix"
    assert engine.drafter.can_share
    with pytest.raises(CastspecError, match="with_suffix"):
        Engine.check_options("cast", drafter="suffix", with_suffix=True)
    with pytest.raises(CastspecError, match="kept by the suffix drafter"):
        Engine.check_options("cast", drafter="ngram", suffix_shared_tokens=100)
    assert torch.is_tensor(engine.drafter.begin([[1, 2, 1, 2]], 4)[0].tokens)
    ngram = Engine.load("smollm2-135m", "cast", drafter="ngram", dtype="fp32", cost_model="fixed",
                        cost_table=str(table), force_table=True)
    assert ngram.policy.calibration is not None  # the n-gram drafter's 1.0 scores are calibrated too
