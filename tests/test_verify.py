import torch

from castspec.decode.tree import DraftTree
from castspec.decode.verify import greedy_accept

V = 20


def logits_choosing(choices: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(choices), V)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return logits


# root(5) -> 1:a=7 -> 3:c=9 ; root -> 2:b=8 -> 4:d=3
TREE = DraftTree.from_lists([5, 7, 8, 9, 3], [-1, 0, 0, 1, 2], [1, .5, .4, .3, .2])


def test_accepts_the_matching_branch_and_adds_the_bonus():
    path, bonus = greedy_accept(TREE, logits_choosing([8, 0, 3, 0, 11]))
    assert path == [2, 4] and bonus == 11


def test_rejects_at_the_root():
    path, bonus = greedy_accept(TREE, logits_choosing([4, 9, 3, 1, 1]))
    assert path == [] and bonus == 4


def test_stops_inside_a_branch():
    path, bonus = greedy_accept(TREE, logits_choosing([7, 2, 0, 0, 0]))
    assert path == [1] and bonus == 2


def test_the_emitted_tokens_follow_the_target_argmax_chain():
    torch.manual_seed(0)
    for _ in range(50):
        tree = DraftTree.from_lists([1] + torch.randint(0, 3, (12,)).tolist(),
                                    [-1] + [int(torch.randint(0, i, ())) for i in range(1, 13)], [1.0] * 13)
        logits = torch.randn(13, 3)
        path, bonus = greedy_accept(tree, logits)
        node = 0
        for nxt in path:  # each accepted token is the target's argmax at its parent
            assert tree.parents[nxt] == node and tree.tokens[nxt] == logits[node].argmax()
            node = nxt
        assert bonus == int(logits[node].argmax())
        assert all(int(tree.tokens[c]) != bonus for c in tree.children(node))
