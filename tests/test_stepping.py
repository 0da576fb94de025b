"""The stepping engine: requests join a running batch and leave it (finished or aborted) between steps.
Exactness on real SmolLM2 fp32 against HF greedy of each prompt alone; KV bookkeeping (joins, compaction,
freeing); a sampling distribution test with rows joining and leaving around the sampled row."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from synthetic import flat_costs
from test_batch import BATCH, LONG
from test_exactness import PROMPTS
from test_sampling import ALPHA, PROMPT, chi_square_p_value, exact_joint, tiny_llama

from castspec import Engine
from castspec.decode import kv
from castspec.decode.engine import RequestError, RequestParams, StepEngine
from castspec.decode.target import Target
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.ngram import NgramDrafter
from castspec.policies.base import ChainPolicy, Eagle2Policy
from castspec.policies.cast import CastPolicy

# --- KV helpers, on a stand-in cache (keys/values per layer are all they touch) --------------------------------


def fake_cache(keys: torch.Tensor) -> SimpleNamespace:
    layer = SimpleNamespace(keys=keys.clone(), values=-keys.clone())
    return SimpleNamespace(layers=[layer])


def entries(cache, row: int, valid: torch.Tensor) -> list[float]:
    return cache.layers[0].keys[row, 0, valid[row], 0].tolist()


def test_compact_keeps_each_rows_entries_in_order_and_drops_the_holes():
    valid = torch.tensor([[1, 0, 1, 0, 0, 1, 0, 1], [0, 0, 1, 1, 0, 0, 0, 0], [0] * 8], dtype=torch.bool)
    keys = torch.arange(3 * 8, dtype=torch.float).reshape(3, 1, 8, 1)
    cache = fake_cache(keys)
    before = [entries(cache, r, valid) for r in range(3)]
    new_valid = kv.compact(cache, valid)
    assert new_valid.shape == (3, 4) and new_valid.sum(1).tolist() == [4, 2, 0]
    assert new_valid[:, -1].tolist() == [True, True, False]  # right-aligned: the last column is every row's last
    assert [entries(cache, r, new_valid) for r in range(3)] == before
    assert cache.layers[0].values[0, 0, :, 0].tolist() == [-v for v in before[0]]


def test_append_rows_left_pads_the_narrower_side_with_holes():
    cache = fake_cache(torch.ones(2, 1, 3, 1))
    valid = torch.tensor([[1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    other = fake_cache(torch.full((1, 1, 5, 1), 2.0))
    other_valid = torch.ones(1, 5, dtype=torch.bool)
    joined, joined_valid = kv.append_rows(cache, valid, other, other_valid)
    assert joined_valid.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [1] * 5]
    assert joined.layers[0].keys[:, 0, :, 0].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [2] * 5]
    # rows with no entries yet (a drafter's newcomers): holes as wide as the cache
    joined, joined_valid = kv.append_rows(joined, joined_valid, None, torch.zeros(2, 0, dtype=torch.bool))
    assert joined_valid.shape == (5, 5) and not joined_valid[3:].any()


def test_needs_compaction_only_when_holes_pile_up():
    valid = torch.ones(2, 100, dtype=torch.bool)
    assert not kv.needs_compaction(valid)
    valid[1, :] = False
    valid[1, -10:] = True
    assert not kv.needs_compaction(valid)  # row 0 fills the width: nothing to free
    assert kv.needs_compaction(torch.cat([valid, torch.zeros(2, 60, dtype=torch.bool)], dim=1))
    assert kv.needs_compaction(torch.zeros(0, 5, dtype=torch.bool)) and not kv.needs_compaction(
        torch.zeros(0, 0, dtype=torch.bool))


# --- exactness with joins and leaves, real SmolLM2 fp32 ----------------------------------------------------------


def stepping_engines(model, tokenizer):
    yield "ar", Engine(model, tokenizer)
    yield "chain-draft", Engine(model, tokenizer, DraftModelDrafter(model), ChainPolicy(3))
    yield "eagle2-ngram", Engine(model, tokenizer, NgramDrafter(), Eagle2Policy(4, 4, 12))
    yield "cast-ngram", Engine(model, tokenizer, NgramDrafter(), CastPolicy(flat_costs(), auto=True))
    yield "cast-draft", Engine(model, tokenizer, DraftModelDrafter(model), CastPolicy(flat_costs(), 4.0, 3.0, 2.5))


def run_schedule(engine: StepEngine, schedule: dict[int, list[tuple[str, list[int], int]]], aborts: dict[int, str],
                 check=None) -> dict[str, list[int]]:
    """Step the engine; before step k, add schedule[k]'s requests and abort aborts[k]. Returns every request's
    tokens, checking that outputs only ever extend a request's tokens and that finish comes once."""
    got: dict[str, list[int]] = {}
    finished: set[str] = set()
    step = 0
    while engine.has_unfinished() or step <= max(schedule):
        for request_id, ids, n in schedule.get(step, []):
            engine.add_request(request_id, ids, RequestParams(max_tokens=n, temperature=0))
        if step in aborts:
            engine.abort(aborts[step])
        for out in engine.step():
            assert out.request_id not in finished
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert got[out.request_id] == out.output_ids
            if out.finished:
                finished.add(out.request_id)
        if check is not None:
            check(engine)
        step += 1
        assert step < 2000
    assert finished == set(got)
    return got


@pytest.mark.parametrize("method", ["ar", "chain-draft", "eagle2-ngram", "cast-ngram", "cast-draft"])
def test_requests_joining_mid_generation_decode_as_alone(smollm, smollm_reference, method):
    model, tokenizer = smollm
    engine = dict(stepping_engines(model, tokenizer))[method]
    stepper = engine.stepper(max_batch_size=3)
    prompts = [engine.encode(prompt=p) for p in [*BATCH, PROMPTS[3], PROMPTS[7]]]
    lengths = [24, 6, 14, 20, 3, 16]
    # two at once, one a few steps later, three more while the batch is full (they wait for a free row)
    schedule = {0: [("a", prompts[0], lengths[0]), ("b", prompts[1], lengths[1])],
                3: [("c", prompts[2], lengths[2])],
                5: [("d", prompts[3], lengths[3]), ("e", prompts[4], lengths[4]), ("f", prompts[5], lengths[5])]}
    got = run_schedule(stepper, schedule, {})
    for request_id, ids, n in (r for batch in schedule.values() for r in batch):
        assert got[request_id] == smollm_reference(tuple(ids), n), (method, request_id)
    assert stepper.target.rows == 0 and stepper.target.cache.capacity == 0  # every slot freed, memory given back


def test_aborted_requests_leave_and_free_their_kv(smollm, smollm_reference):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy(3, 3, 8))
    stepper = engine.stepper(max_batch_size=4)
    prompts = [engine.encode(prompt=p) for p in [PROMPTS[0], LONG, PROMPTS[5], PROMPTS[9]]]
    schedule = {0: [(str(i), p, 48) for i, p in enumerate(prompts)]}
    rows = []
    got = run_schedule(stepper, schedule, {2: "1", 3: "3"}, check=lambda e: rows.append(len(e.running)))
    assert rows[:2] == [4, 4] and rows[2:4] == [3, 2]  # the aborted rows left the batch at once
    for request_id in ("0", "2"):
        ids = prompts[int(request_id)]
        assert got[request_id] == smollm_reference(tuple(ids), 48)
    assert len(got["1"]) < 48 and len(got["3"]) < 48
    assert stepper.target.rows == 0 and stepper.target.cache.capacity == 0
    assert stepper.drafter.valid.shape[0] == 0 and stepper.drafter.lengths == []
    stepper.abort("no-such-request")  # ignored
    assert stepper.step() == []


def test_a_long_lived_rows_kv_stays_bounded_while_neighbours_come_and_go(smollm, smollm_reference):
    """Row "long" accepts about one token per step while short, repetitive neighbours accept many and come and go:
    the target's cache keeps each row's entries without holes, reuses the slots of rows that left, and holds at
    most about twice the longest row's columns."""
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, NgramDrafter(), Eagle2Policy(2, 6, 12))
    stepper = engine.stepper(max_batch_size=3)
    long_ids = engine.encode(prompt=PROMPTS[1])
    repetitive = engine.encode(prompt=PROMPTS[11])
    schedule = {0: [("long", long_ids, 90)]}
    for k in range(1, 60, 6):
        schedule[k] = [(f"n{k}", repetitive, 12)]
    sizes = []

    def check(e):
        if e.target.lengths:
            longest = max(e.target.lengths)
            sizes.append((e.target.cache.slots, e.target.cache.capacity))
            assert e.target.cache.slots <= 3
            assert e.target.cache.capacity <= 2 * (longest + 16) + 128
            assert e.target.lengths == [len(s.prompt) + len(s.output) - 1 for s in e.running]  # no holes

    got = run_schedule(stepper, schedule, {}, check=check)
    assert got["long"] == smollm_reference(tuple(long_ids), 90)
    assert all(got[f"n{k}"] == smollm_reference(tuple(repetitive), 12) for k in range(1, 60, 6))
    assert len(sizes) > 40


def test_greedy_and_sampled_rows_share_a_batch(smollm, smollm_reference):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, NgramDrafter(), Eagle2Policy(3, 3, 8))
    stepper = engine.stepper(max_batch_size=4)
    greedy = engine.encode(prompt=PROMPTS[2])
    sampled = engine.encode(prompt=PROMPTS[4])
    stepper.add_request("g", greedy, RequestParams(max_tokens=20))
    stepper.add_request("s1", sampled, RequestParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=5))
    stepper.add_request("s2", sampled, RequestParams(max_tokens=20, temperature=1.3, top_k=20, seed=5))
    outputs = {}
    while stepper.has_unfinished():
        for out in stepper.step():
            outputs[out.request_id] = out.output_ids
    assert outputs["g"] == smollm_reference(tuple(greedy), 20)
    # the same seed and settings repeat the same sample, whoever shares the batch
    again = engine.stepper(max_batch_size=1)
    again.add_request("s1", sampled, RequestParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=5))
    while again.has_unfinished():
        for out in again.step():
            repeat = out.output_ids
    assert repeat == outputs["s1"]


def test_bad_requests_are_refused_with_the_parameter_named(smollm):
    model, tokenizer = smollm
    stepper = Engine(model, tokenizer).stepper(max_batch_size=1, max_waiting=1)
    cases = [
        (lambda: RequestParams(max_tokens=0), "max_tokens"),
        (lambda: RequestParams(temperature=-1.0), "temperature"),
        (lambda: RequestParams(top_p=0.0), "top_p"),
        (lambda: RequestParams(top_k=-3), "top_k"),
        (lambda: stepper.add_request("x", [], RequestParams()), "prompt"),
        (lambda: stepper.add_request("x", [10 ** 9], RequestParams()), "prompt"),
        (lambda: stepper.add_request("x", [1] * 8192, RequestParams()), "input_tokens"),
        (lambda: stepper.add_request("x", [1] * 10, RequestParams(max_tokens=8190)), "max_tokens"),
    ]
    for make, param in cases:
        with pytest.raises(RequestError) as info:
            make()
        assert info.value.param == param
    stepper.add_request("a", [1, 2, 3], RequestParams(max_tokens=2))
    with pytest.raises(RequestError) as info:
        stepper.add_request("a", [1, 2, 3], RequestParams(max_tokens=2))
    assert info.value.param == "request_id"
    with pytest.raises(RequestError) as info:
        stepper.add_request("b", [1, 2, 3], RequestParams(max_tokens=2))
    assert info.value.param == "queue"


def test_stop_strings_cut_the_text_and_partial_stops_are_held_back(smollm):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer)
    ids = engine.encode(prompt=PROMPTS[0])
    full = engine.generate(prompt_ids=ids, max_new_tokens=30).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    stepper = engine.stepper()
    stepper.add_request("r", ids, RequestParams(max_tokens=30, stop=(stop,)))
    streamed, final = "", None
    while stepper.has_unfinished():
        for out in stepper.step():
            streamed += out.text
            assert stop not in streamed
            final = out
    assert final.finish_reason == "stop_string" and final.full_text == streamed
    assert streamed == full[: full.find(stop)]


# --- sampling stays exact while rows join and leave around the sampled one ---------------------------------------


def test_sampling_distribution_with_rows_joining_and_leaving():
    target_model, draft_model = tiny_llama(0), tiny_llama(1, noise=0.08)
    params = dict(temperature=1.0, top_p=0.95)
    stepper = StepEngine(Target(target_model), DraftModelDrafter(draft_model), Eagle2Policy(3, 3, 8),
                         max_batch_size=4)
    rng = random.Random(0)
    draws, started, samples = 1500, 0, {}
    with torch.inference_mode():
        while len(samples) < draws:
            while started < draws and stepper.num_waiting + stepper.num_running < 4:
                if rng.random() < 0.3:  # a neighbour: another prompt, greedy or sampled, of random length
                    neighbour = [rng.randrange(12) for _ in range(rng.randrange(2, 14))]
                    stepper.add_request(f"n{started}-{rng.random()}", neighbour,
                                        RequestParams(max_tokens=rng.randrange(1, 9),
                                                      temperature=rng.choice([0.0, 0.7, 1.4]),
                                                      seed=rng.randrange(10 ** 6)))
                else:
                    stepper.add_request(f"p{started}", PROMPT, RequestParams(max_tokens=3, seed=started, **params))
                    started += 1
            for out in stepper.step():
                if out.finished and out.request_id.startswith("p"):
                    samples[out.request_id] = tuple(out.output_ids[:2])
    from castspec.decode.sampling import SamplingParams

    exact = exact_joint(target_model, PROMPT, 2, SamplingParams(**params))
    assert chi_square_p_value(list(samples.values()), exact) > ALPHA
