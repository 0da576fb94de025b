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
