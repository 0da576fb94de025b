"""The prefix cache and chunked prefill. The block store's bookkeeping on small tensors; then exactness on real
SmolLM2 fp32: conversations whose later turns hit the cache, for every method and drafter, batched, a cache
filled by speculative requests read by plain ones and the reverse, chunked prefill of prompts joining a running
batch, and a seeded sample unchanged by a hit."""

from __future__ import annotations

import itertools

import pytest
import torch
from synthetic import flat_costs
from test_batch import LONG
from test_exactness import PROMPTS
from test_stepping import run_schedule

from castspec import Engine
from castspec.costs.prefill import FIRST_TOKENS
from castspec.decode.engine import RequestParams, StepEngine
from castspec.decode.prefix_cache import PrefixCache
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.eagle_head import EagleHeadDrafter
from castspec.drafters.ngram import NgramDrafter
from castspec.drafters.suffix import SuffixDrafter
from castspec.policies.base import ChainPolicy, Eagle2Policy
from castspec.policies.cast import CastPolicy

# --- the block store ---------------------------------------------------------------------------------------------


def entries_of(tokens: list[int]) -> torch.Tensor:
    """Stand-in KV [layers=2, 2, heads=1, n, dim=1] whose entry j holds tokens[j] (so a hit shows what it holds)."""
    kv = torch.tensor(tokens, dtype=torch.float)[None, None, None, :, None]
    return kv.expand(2, 2, 1, len(tokens), 1).clone()


def test_hits_are_whole_blocks_of_the_longest_shared_prefix():
    cache = PrefixCache(1 << 20, block_tokens=4)
    assert cache.match([1, 2, 3, 4, 5]) is None
    first = list(range(10))  # two whole blocks stored, the last 2 tokens are not
    assert cache.insert(first, entries_of(first)) == 2 and len(cache) == 2
    hit = cache.match([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert hit.length == 8 and hit.kv[0, 0, 0, :, 0].tolist() == list(range(8))
    assert cache.match([0, 1, 2, 3, 4, 5, 6, 99]).length == 4  # the second block differs
    assert cache.match([9, 1, 2, 3]) is None  # same tokens at other positions are another block
    assert cache.match(first, limit=7).length == 4  # a prompt keeps its last token to prefill
    assert (cache.queries, cache.hits) == (5 + 11 + 8 + 4 + 10, 8 + 4 + 4)
    # a branch shares the first block and adds its own second one
    branch = [0, 1, 2, 3, 7, 7, 7, 7]
    assert cache.insert(branch, entries_of(branch)) == 1 and len(cache) == 3
    assert cache.match(branch + [1]).kv[0, 1, 0, 4:, 0].tolist() == [7, 7, 7, 7]


def test_eviction_takes_least_recently_used_leaves_and_keeps_the_bound():
    one_block = entries_of([0] * 4).numel() * 4  # bytes of one 4-token block
    cache = PrefixCache(3 * one_block, block_tokens=4)
    a, b = [1] * 4 + [2] * 4, [1] * 4 + [3] * 4  # share their first block
    cache.insert(a, entries_of(a))
    cache.insert(b, entries_of(b))
    assert len(cache) == 3 and cache.nbytes == 3 * one_block
    cache.match(a + [0])  # a's leaf is now newer than b's
    c = [5] * 8
    cache.insert(c, entries_of(c))  # needs two blocks: b's leaf goes, then the oldest leaf left
    assert cache.nbytes <= 3 * one_block and cache.evictions == 2
    assert cache.match(c + [0]).length == 8
    assert cache.match(b + [0]) is None or cache.match(b + [0]).length == 4
    # a parent never goes before its children: every held block's parent is held
    held = {block.id for block in cache._blocks.values()}
    assert all(block.parent is None or block.parent.id in held for block in cache._blocks.values())


# --- exactness on SmolLM2 fp32 -----------------------------------------------------------------------------------


def engines(model, tokenizer, head):
    yield "ar", Engine(model, tokenizer)
    yield "chain-draft", Engine(model, tokenizer, DraftModelDrafter(model), ChainPolicy(3))
    yield "eagle2-ngram", Engine(model, tokenizer, NgramDrafter(), Eagle2Policy(4, 4, 12))
    yield "cast-ngram", Engine(model, tokenizer, NgramDrafter(), CastPolicy(flat_costs(), auto=True))
    yield "cast-draft", Engine(model, tokenizer, DraftModelDrafter(model), CastPolicy(flat_costs(), 4.0, 3.0, 2.5))
    yield "cast-suffix", Engine(model, tokenizer, SuffixDrafter(), CastPolicy(flat_costs(), auto=True))
    yield "eagle2-head", Engine(model, tokenizer, EagleHeadDrafter(head, model), Eagle2Policy(3, 3, 8))


def answer(stepper: StepEngine, requests: list[tuple[str, list[int], int]], params=None) -> dict[str, list[int]]:
    """Run these requests together to the end; their outputs by id."""
    for request_id, ids, n in requests:
        stepper.add_request(request_id, ids, params or RequestParams(max_tokens=n))
    out = {}
    for _ in range(2000):
        if not stepper.has_unfinished():
            return out
        for o in stepper.step():
            out[o.request_id] = o.output_ids
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("method", ["ar", "chain-draft", "eagle2-ngram", "cast-ngram", "cast-draft", "cast-suffix",
                                    "eagle2-head"])
def test_conversation_turns_that_hit_the_cache_decode_as_without_it(smollm, smollm_reference, random_head, method):
    model, tokenizer = smollm
    engine = dict(engines(model, tokenizer, random_head))[method]
    cache = PrefixCache(1 << 30)
    stepper = engine.stepper(max_batch_size=3)
    stepper.prefix_cache = cache
    first = [engine.encode(prompt=p) for p in (PROMPTS[1], LONG)]
    turn1 = answer(stepper, [("a1", first[0], 20), ("b1", first[1], 12)])
    assert cache.hits == 0 and len(cache) > 0
    # turn 2 resends each history (prompt and answer) plus more; a third, new request shares the batch
    second = [first[0] + turn1["a1"] + engine.encode(prompt="\n# now with tests\n"),
              first[1] + turn1["b1"] + engine.encode(prompt=" Summarise it."),
              engine.encode(prompt=PROMPTS[7])]
    turn2 = answer(stepper, [("a2", second[0], 16), ("b2", second[1], 10), ("c2", second[2], 14)])
    assert cache.hits >= (len(first[0]) + len(first[1])) // 16 * 16 - 32  # most of both histories came from it
    for request_id, ids, n in [("a1", first[0], 20), ("b1", first[1], 12), ("a2", second[0], 16),
                               ("b2", second[1], 10), ("c2", second[2], 14)]:
        got = turn1.get(request_id) or turn2[request_id]
        assert got == smollm_reference(tuple(ids), n), (method, request_id)


def test_speculative_and_plain_requests_read_each_others_cached_prefixes(smollm, smollm_reference):
    model, tokenizer = smollm
    cache = PrefixCache(1 << 30)
    plain = Engine(model, tokenizer).stepper(max_batch_size=2)
    speculative = Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy(3, 3, 8)).stepper(2)
    plain.prefix_cache = speculative.prefix_cache = cache
    base = Engine(model, tokenizer).encode(prompt=PROMPTS[2])
    by_spec = answer(speculative, [("s", base, 40)])["s"]
    follow = base + by_spec + Engine(model, tokenizer).encode(prompt=" # again")
    hits = cache.hits
    assert answer(plain, [("p", follow, 20)])["p"] == smollm_reference(tuple(follow), 20)
    assert cache.hits - hits >= (len(base) + 40) // 16 * 16 - 16  # the speculative answer's KV was reused
    by_plain = answer(plain, [("p2", follow + [13], 24)])["p2"]
    again = follow + [13] + by_plain
    hits = cache.hits
    assert answer(speculative, [("s2", again, 16)])["s2"] == smollm_reference(tuple(again), 16)
    assert cache.hits - hits >= len(again) // 16 * 16 - 32


def join_while_running(stepper: StepEngine, smollm_reference, schedule: dict) -> list[list[tuple[str, int]]]:
    """Run `schedule` (the first request running, the others joining by chunks), check every answer against HF
    greedy, and return each step's (kind, prompt tokens) records."""
    steps = []
    got = run_schedule(stepper, schedule, {}, check=lambda e: steps.append(
        [(i.kind, i.prompt_tokens) for i in e.step_infos]))
    for request_id, ids, n in (r for batch in schedule.values() for r in batch):
        assert got[request_id] == smollm_reference(tuple(ids), n), request_id
    return steps


def carried_chunks(steps: list[list[tuple[str, int]]]) -> list[int]:
    return [tokens for step in steps for kind, tokens in step if kind == "decode" and tokens]


@pytest.mark.parametrize("method", ["ar", "cast-ngram", "cast-draft", "eagle2-head"])
def test_prompts_joining_by_chunks_decode_as_alone_and_the_running_rows_go_on(smollm, smollm_reference, random_head,
                                                                                method):
    model, tokenizer = smollm
    engine = dict(engines(model, tokenizer, random_head))[method]
    prompts = [engine.encode(prompt=p) for p in (PROMPTS[0], LONG, PROMPTS[3], PROMPTS[11])]
    steps = join_while_running(engine.stepper(max_batch_size=3, prefill_chunk=8), smollm_reference, {
        0: [("a", prompts[0], 60)], 2: [("long", prompts[1], 12)], 4: [("c", prompts[2], 10), ("d", prompts[3], 10)]})
    # the long prompt took several chunks while "a" ran, each inside a decode step of the running rows (one
    # forward), never a forward of its own while rows were running, and never more than the chunk
    carried = carried_chunks(steps)
    assert len(carried) >= 3 and max(carried) <= 8
    assert all(sum(kind in ("decode", "prefill_chunk") for kind, _ in step) <= 1 for step in steps)  # one forward


@pytest.mark.parametrize("method", ["ar", "cast-ngram"])
def test_chunks_sized_by_time_decode_as_alone_and_grow_at_most_twofold(smollm, smollm_reference, random_head,
                                                                       method):
    model, tokenizer = smollm
    engine = dict(engines(model, tokenizer, random_head))[method]
    stepper = engine.stepper(max_batch_size=3, prefill_chunk="auto", prefill_at_once=0)  # every prompt by chunks
    assert stepper.prefill_chunk.tokens == FIRST_TOKENS
    prompts = [engine.encode(prompt=p) for p in (PROMPTS[0], LONG, PROMPTS[3])]
    carried = carried_chunks(join_while_running(stepper, smollm_reference, {
        0: [("a", prompts[0], 60)], 3: [("long", prompts[1], 12)], 5: [("c", prompts[2], 10)]}))
    assert carried[0] == FIRST_TOKENS and len(carried) >= 2
    assert all(later <= 2 * earlier for earlier, later in itertools.pairwise(carried))
    assert stepper.prefill_chunk.token_s is not None  # it priced the carried tokens from the steps' times


def test_a_prompt_that_costs_a_few_decode_steps_joins_in_one_step_and_decodes_as_alone(smollm, smollm_reference):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer)
    stepper = engine.stepper(max_batch_size=3, prefill_chunk="auto", prefill_at_once=1e6)  # any priced prompt
    prompts = [engine.encode(prompt=p) for p in (PROMPTS[0], LONG, PROMPTS[3])]
    carried = carried_chunks(join_while_running(stepper, smollm_reference, {
        0: [("a", prompts[0], 60)], 3: [("long", prompts[1], 12)], 40: [("c", prompts[2], 10)]}))
    # the first chunk of "long" went before any price was known, its rest at once; "c" whole, in one step beside "a"
    assert carried == [FIRST_TOKENS, len(prompts[1]) - FIRST_TOKENS, len(prompts[2])]


def test_an_aborted_half_prefilled_request_leaves_and_the_others_go_on(smollm, smollm_reference):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, NgramDrafter(), Eagle2Policy(3, 3, 8))
    stepper = engine.stepper(max_batch_size=3, prefill_chunk=8)
    prompts = [engine.encode(prompt=p) for p in (PROMPTS[0], LONG, PROMPTS[5])]
    schedule = {0: [("a", prompts[0], 30)], 2: [("gone", prompts[1], 12), ("c", prompts[2], 10)]}
    got = run_schedule(stepper, schedule, {4: "gone"})
    assert got["a"] == smollm_reference(tuple(prompts[0]), 30)
    assert got["c"] == smollm_reference(tuple(prompts[2]), 10)
    assert got["gone"] == []


def test_a_seeded_sample_is_the_same_with_a_cache_hit(smollm):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, NgramDrafter(), Eagle2Policy(3, 3, 8))
    prompt = engine.encode(prompt=LONG)
    params = RequestParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    cold = answer(engine.stepper(1), [("s", prompt, 24)], params)["s"]
    stepper = engine.stepper(1, prefix_cache_gb=1.0)
    answer(stepper, [("warm", prompt + [13], 4)])
    warm = answer(stepper, [("s", prompt, 24)], params)["s"]
    assert stepper.prefix_cache.hits >= len(prompt) // 16 * 16 - 16 and warm == cold


def test_speculative_requests_leave_the_same_blocks_in_the_cache_as_plain_ones(smollm, random_head):
    """Accepted tokens enter the cache as plain decoding's would, the last step's included: the same conversation
    leaves the same blocks and later turns find the same hits, whatever the method."""
    model, tokenizer = smollm
    seen = {}
    for method, engine in engines(model, tokenizer, random_head):
        cache = PrefixCache(1 << 30, block_tokens=4)  # small blocks: a missing tail token would show
        stepper = engine.stepper(max_batch_size=2)
        stepper.prefix_cache = cache
        first = engine.encode(prompt=PROMPTS[11])
        turn1 = answer(stepper, [("a", first, 21), ("b", engine.encode(prompt=PROMPTS[4]), 9)])
        answer(stepper, [("a2", first + turn1["a"] + [13], 5)])
        seen[method] = (len(cache), cache.hits, cache.queries)
    assert len(set(seen.values())) == 1, seen


def test_the_server_counts_hits_splits_ttft_and_resets_its_cache(smollm, smollm_reference):
    """In-process server: a second turn hits the cache (vLLM's prefix_cache_queries / hits meaning), TTFT is split
    into queue and prefill, POST /reset_prefix_cache empties it, and a server without one says so with a 400."""
    from fastapi.testclient import TestClient

    from castspec.serve.app import Server, build_app
    from castspec.serve.loop import EngineLoop
    from castspec.serve.metrics import ServerMetrics

    def value(text: str, name: str) -> float:
        return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.split("{")[0].split(" ")[0] == name)

    model, tokenizer = smollm
    engine = Engine(model, tokenizer, NgramDrafter(), CastPolicy(flat_costs(), auto=True))
    loop = EngineLoop(engine.stepper(prefix_cache_gb=0.5, prefill_chunk=64), ServerMetrics("m"))
    with TestClient(build_app(Server(loop, tokenizer, "m", 8192, 8))) as http:
        first = [{"role": "user", "content": LONG}]
        r1 = http.post("/v1/chat/completions", json={"model": "m", "messages": first, "max_tokens": 12,
                                                     "temperature": 0}).json()
        second = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "Shorter, please."}]
        r2 = http.post("/v1/chat/completions", json={"model": "m", "messages": second, "max_tokens": 12,
                                                     "temperature": 0}).json()
        ids = engine.encode(messages=second)
        metrics = http.get("/metrics").text
        queries, hits = value(metrics, "castspec:prefix_cache_queries_total"), value(
            metrics, "castspec:prefix_cache_hits_total")
        assert queries == len(engine.encode(messages=first)) + len(ids)
        assert hits >= len(engine.encode(messages=first)) // 16 * 16 - 16 and value(
            metrics, "castspec:prefix_cache_blocks") > 0
        assert value(metrics, "castspec:request_queue_time_seconds_count") == 2
        assert value(metrics, "castspec:request_prefill_time_seconds_count") == 2
        assert http.post("/reset_prefix_cache").status_code == 200
        assert value(http.get("/metrics").text, "castspec:prefix_cache_blocks") == 0
        text = r2["choices"][0]["message"]["content"]
        assert text == tokenizer.decode(smollm_reference(tuple(ids), 12), skip_special_tokens=True)
    plain = EngineLoop(engine.stepper(), ServerMetrics("m"))
    with TestClient(build_app(Server(plain, tokenizer, "m", 8192, 8))) as http:
        r = http.post("/reset_prefix_cache")
        assert r.status_code == 400 and "prefix cache" in r.json()["error"]["message"]
