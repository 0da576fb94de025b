"""The target's ragged forward (decode/ragged.py, decode/target.py) on a tiny random Llama with grouped-query heads:
every row's logits, whatever else shares its forward (trees of other widths, prompt chunks of rows joining, rows
that left), equal the logits of its own sequence run alone through the stock model. Pure logic: random weights."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from castspec.decode.target import Target
from castspec.decode.tree import DraftTree


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def alone(model, tokens: list[int]) -> torch.Tensor:
    """The stock model's logits at every position of `tokens` (one causal forward, no cache)."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def random_tree(rng: random.Random, root: int, size: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return DraftTree.from_lists([root] + [rng.randrange(64) for _ in range(size - 1)], parents, [1.0] * size)


def path_to(tree: DraftTree, node: int) -> list[int]:
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = int(tree.parents[node])
    return nodes[::-1]


def test_trees_and_joining_chunks_in_one_forward_equal_each_sequence_alone(model):
    rng = random.Random(1)
    target = Target(model)
    histories = [[rng.randrange(64) for _ in range(n)] for n in (5, 17, 9)]
    first, _ = target.add_rows([h[:-1] for h in histories])
    for h, logits in zip(histories, first, strict=True):
        torch.testing.assert_close(logits, alone(model, h[:-1])[-1], rtol=1e-4, atol=1e-4)
    joining = [[rng.randrange(64) for _ in range(n)] for n in (23, 4)]
    prefills = target.start_rows(joining)
    for step in range(12):
        # a row's root is its next (not yet committed) token
        trees = [random_tree(rng, h[-1], rng.randint(1, 7)) for h in histories]
        logits, _, carried = target.forward(trees, prefills, 5)  # at most 5 prompt tokens a step
        assert carried == min(5, sum(p.left for p in prefills) + carried)
        for row, (tree, h) in enumerate(zip(trees, histories, strict=True)):
            for node in range(len(tree)):
                sequence = h[:-1] + tree.tokens[path_to(tree, node)].tolist()
                torch.testing.assert_close(logits[row][node], alone(model, sequence)[-1], rtol=1e-4, atol=1e-4)
        kept = [path_to(tree, rng.randrange(len(tree))) for tree in trees]
        target.commit(kept)
        for h, tree, nodes in zip(histories, trees, kept, strict=True):
            h[-1:] = tree.tokens[nodes].tolist() + [rng.randrange(64)]
        if step == 3:  # row 1 leaves; its slot is free for the prompts still joining
            target.keep_rows([r for r in range(target.rows) if r != 1])
            histories.pop(1)
        done = [p for p in prefills if p.complete]
        if done:
            for p in done:
                torch.testing.assert_close(p.first_logits, alone(model, p.prompt)[-1], rtol=1e-4, atol=1e-4)
            target.join_rows(done)
            histories += [p.prompt + [rng.randrange(64)] for p in done]
            prefills = [p for p in prefills if not p.complete]
    assert not prefills and target.rows == 4
    assert target.start_rows([[1, 2, 3]])[0].slot == 1  # the slot the row that left gave back
    assert target.lengths == [len(h) - 1 for h in histories]  # every committed entry, no holes


def test_a_prefix_hit_and_row_entries_round_trip(model):
    """A row's committed entries, written into a new slot as a prefix-cache hit, give the same logits as the
    prompt prefilled in full."""
    rng = random.Random(2)
    target = Target(model)
    prompt = [rng.randrange(64) for _ in range(30)]
    target.add_rows([prompt])
    count, entries = target.row_entries(0)
    assert count == 30 and entries.shape[:2] == (2, 2) and entries.shape[3] == 30

    class Hit:
        length, kv, features = 20, entries[:, :, :, :20], None

    longer = prompt + [rng.randrange(64) for _ in range(6)]
    prefills = target.start_rows([longer], [Hit()])
    assert prefills[0].done == 20
    target.forward([DraftTree.single(rng.randrange(64))], prefills, None)
    torch.testing.assert_close(prefills[0].first_logits, alone(model, longer)[-1], rtol=1e-4, atol=1e-4)
    target.keep_rows([])
    assert target.rows == 0 and target.cache.capacity > 0  # the prompt that did not join still holds its slot
    target.drop_prefills(prefills)
    assert target.cache.capacity == 0
