import torch

from castspec.decode.tree import TreePool
from castspec.drafters.ngram import NgramDrafter


def test_proposes_what_followed_the_longest_matching_suffix():
    d = NgramDrafter(max_n=3, min_n=1)
    cands = d.begin([[1, 2, 3, 4, 1, 2, 3, 5, 9, 1, 2, 3]], top_k=4)[0]
    # "1 2 3" was followed by 4 once and by 5 once
    assert sorted(cands.tokens[0, :2].tolist()) == [4, 5]
    assert torch.allclose(cands.probs[0, :2], torch.tensor([0.5, 0.5]))
    assert cands.probs[0, 2:].sum() == 0


def test_expand_follows_the_path_of_each_node():
    d = NgramDrafter(max_n=2, min_n=2)
    d.begin([[7, 8, 9, 7, 8]], top_k=2)  # "7 8" -> 9
    pool = TreePool.from_lists([8, 9], [-1, 0])
    cands = d.expand([pool], [[1]], top_k=2)[0]  # "8 9" -> 7
    assert cands.tokens[0, 0] == 7 and cands.probs[0, 0] == 1.0


def test_no_match_gives_empty_rows_and_reset_forgets():
    d = NgramDrafter()
    assert d.begin([[1, 2, 3]], top_k=3)[0].probs.sum() == 0
    d.begin([[1, 2]], top_k=3)
    assert d.begin([[3, 1, 2]], top_k=3)[0].probs[0, 0] == 1.0
    d.reset()
    assert d.begin([[1, 2]], top_k=3)[0].probs.sum() == 0


def test_rows_keep_separate_histories():
    d = NgramDrafter(max_n=2, min_n=2)
    d.reset(2)
    first, second = d.begin([[1, 2, 3, 1, 2], [1, 2, 7, 1, 2]], top_k=1)
    assert first.tokens[0, 0] == 3 and second.tokens[0, 0] == 7
    d.keep_rows([1])
    assert d.begin([[9, 1, 2]], top_k=1)[0].tokens[0, 0] == 7


def test_each_node_reports_how_far_its_context_agrees_with_the_earlier_text():
    """The match length goes beyond the n-gram: "5 6" ends a 4-token agreement with "3 4 5 6" before it, and a
    node's path extends it; a copy longer than the cap reads as the cap."""
    from castspec.drafters.base import MATCH_CAP

    d = NgramDrafter(max_n=2, min_n=2)
    (cands,) = d.begin([[1, 2, 3, 4, 5, 6, 9, 3, 4, 5, 6]], top_k=2)
    assert cands.tokens[0, 0] == 9 and cands.matched == [4]
    pool = TreePool.from_lists([6, 9], [-1, 0])
    (expanded,) = d.expand([pool], [[1]], top_k=2)  # "3 4 5 6 9" agrees with the text before the 3
    assert expanded.tokens[0, 0] == 3 and expanded.matched == [5]
    d.reset()
    span = list(range(100, 130))
    (copied,) = d.begin([span + [7] + span[:25]], top_k=2)
    assert copied.tokens[0, 0] == span[25] and copied.matched == [MATCH_CAP]
    assert d.begin([[1, 2, 3]], top_k=2)[0].matched == [0]  # no match
