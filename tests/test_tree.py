import pytest
import torch

from castspec.decode.tree import DraftTree

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
TREE = DraftTree.from_lists([10, 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3], [1, .6, .3, .4, .1, .2, .3])


def test_depths_and_positions():
    assert TREE.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert TREE.position_ids(100).tolist() == [100, 101, 101, 102, 102, 102, 103]
    assert TREE.max_depth == 3


def test_ancestor_mask_is_exactly_self_and_ancestors():
    mask = TREE.ancestor_mask()
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 3, 6}}
    for i, ancestors in expected.items():
        assert set(mask[i].nonzero().flatten().tolist()) == ancestors


def test_attention_mask_sees_the_whole_prefix():
    mask = TREE.attention_mask(5)
    assert mask.shape == (1, 1, 7, 12) and mask.dtype == torch.bool
    assert bool(mask[0, 0, :, :5].all())
    assert torch.equal(mask[0, 0, :, 5:], TREE.ancestor_mask())


def test_paths_children_leaves():
    assert TREE.children(1) == [3, 4]
    assert TREE.leaves() == [4, 5, 6]
    assert TREE.paths() == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    assert TREE.path_to(6) == [1, 3, 6] and TREE.path_to(0) == []


def test_subtree_reindexes_parents():
    sub = TREE.subtree([0, 1, 3, 6, 2])
    assert sub.tokens.tolist() == [10, 11, 12, 13, 16]
    assert sub.parents.tolist() == [-1, 0, 0, 1, 3]
    assert sub.depths.tolist() == [0, 1, 1, 2, 3]


def test_subtree_refuses_orphans_and_rootless_sets():
    with pytest.raises(ValueError):
        TREE.subtree([0, 3])
    with pytest.raises(ValueError):
        TREE.subtree([1, 3])


def test_chain_links_each_token_to_the_one_before():
    chain = DraftTree.chain([7, 8, 9])
    assert chain.parents.tolist() == [-1, 0, 1] and chain.depths.tolist() == [0, 1, 2]
    assert chain.tokens.tolist() == [7, 8, 9] and chain.max_depth == 2


def test_from_lists_refuses_bad_parents():
    with pytest.raises(ValueError):
        DraftTree.from_lists([1, 2], [-1, 1], [1, 1])
    with pytest.raises(ValueError):
        DraftTree.from_lists([1, 2], [0, 0], [1, 1])


def test_single_is_the_ar_tree():
    t = DraftTree.single(7)
    assert len(t) == 1 and t.attention_mask(3).all()
