"""Tree growth with a scripted drafter (pure logic, no model): policies, EAGLE-2 construction, invariants."""

import itertools

import torch

from castspec.decode.drafting import grow_tree
from castspec.drafters.base import Candidates, Drafter, top_candidates
from castspec.policies.base import ChainPolicy, Eagle2Policy, StepContext

V = 30


def child_logits(path: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash(path) % (2**31))
    return torch.randn(V, generator=gen) * 2.5


class ScriptedDrafter(Drafter):
    """Children distributions are a fixed function of the token path, so a reference can recompute them."""

    def __init__(self):
        self.calls = []

    def reset(self, batch_size=1):
        pass

    def keep_rows(self, rows):
        pass

    def add_rows(self, count):
        pass

    def begin(self, new_tokens, top_k, features=None):
        self.calls.append(("begin", len(new_tokens)))
        return [top_candidates(child_logits(())[None], top_k) for _ in new_tokens]

    def expand(self, pools, frontiers, top_k) -> list[Candidates]:
        self.calls.append(("expand", sum(len(f) for f in frontiers)))
        out = []
        for pool, frontier in zip(pools, frontiers, strict=True):
            rows = [child_logits(tuple(pool.tokens[i] for i in pool.path_to(n))) for n in frontier]
            out.append(top_candidates(torch.stack(rows), top_k) if rows else
                       Candidates(torch.zeros(0, top_k, dtype=torch.long), torch.zeros(0, top_k)))
        return out


def reference_eagle2(k: int, depth: int, total: int) -> set[tuple[int, ...]]:
    """EAGLE-2 written out directly over token paths: returns the verified nodes as paths."""
    def children(path):
        probs = torch.softmax(child_logits(path), -1)
        top = probs.topk(k)
        return [(path + (int(t),), float(p)) for t, p in zip(top.indices, top.values, strict=True)]

    scores = {(): 1.0}
    frontier = [()]
    pool = []
    for _layer in range(depth):
        cands = [(p, scores[parent] * q) for parent in frontier for p, q in children(parent)]
        for p, s in cands:
            scores[p] = s
        pool += [p for p, _ in cands]
        frontier = [p for p, _ in sorted(cands, key=lambda c: -c[1])[:k]]
    best = sorted(pool, key=lambda p: (-scores[p], len(p)))[: total - 1]
    return set(best)


def tree_paths(tree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(1, len(tree))}


def test_eagle2_matches_the_reference_construction():
    for k, depth, total in [(10, 5, 60), (2, 4, 9), (4, 3, 16), (3, 6, 200)]:
        tree, record = grow_tree(ScriptedDrafter(), Eagle2Policy(k, depth, total), [1, 2, 3], StepContext())
        assert tree_paths(tree) == reference_eagle2(k, depth, total)
        assert record.layer_sizes == [k] + [k * k] * (depth - 1)
        assert len(tree) == min(total, 1 + k + k * k * (depth - 1))


def test_eagle2_calls_the_drafter_once_per_layer_with_the_whole_frontier():
    drafter = ScriptedDrafter()
    grow_tree(drafter, Eagle2Policy(4, 3, 20), [5], StepContext())
    assert drafter.calls == [("begin", 1), ("expand", 4), ("expand", 4)]


def test_chain_drafts_the_top1_path():
    tree, record = grow_tree(ScriptedDrafter(), ChainPolicy(5), [9], StepContext())
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    path = ()
    for node in range(1, 6):
        assert int(tree.tokens[node]) == int(child_logits(path).argmax())
        path += (int(tree.tokens[node]),)
    assert record.depth == 5 and record.verify_budget == 5


def test_depth_limit_caps_every_policy():
    for policy in [ChainPolicy(8), Eagle2Policy(3, 6, 50)]:
        tree, _ = grow_tree(ScriptedDrafter(), policy, [1], StepContext(depth_limit=2))
        assert tree.max_depth <= 2


def test_verified_set_is_ancestor_closed_and_ranked():
    for k, depth, total in itertools.product([1, 2, 5], [1, 3, 5], [2, 7, 30]):
        tree, _ = grow_tree(ScriptedDrafter(), Eagle2Policy(k, depth, total), [0], StepContext())
        # subtree() already refuses an orphan; also every child scores no more than its parent
        parents = tree.parents[1:]
        assert bool((tree.scores[1:] <= tree.scores[parents] + 1e-9).all())


class EmptyDrafter(ScriptedDrafter):
    def begin(self, new_tokens, top_k, features=None):
        return [Candidates(torch.zeros(1, top_k, dtype=torch.long), torch.zeros(1, top_k)) for _ in new_tokens]


def test_a_drafter_with_nothing_to_say_gives_the_root_alone():
    tree, record = grow_tree(EmptyDrafter(), Eagle2Policy(), [4], StepContext())
    assert len(tree) == 1 and record.depth == 0
