"""Replaying greedy speculative decoding without the target model.

Greedy decoding is lossless, so every step starts from a prefix of the target's own greedy output, and what a
step accepts depends only on that prefix and the drafted tree: walk the tree from the root, following the child
whose token is the reference's next token. Given the reference output (one AR run), any drafter + policy can be
replayed exactly: the drafter really drafts (its time is measured), the verify forward is not run but priced
from the measured cost table. `castspec tune` uses this to search a whole EAGLE-2 grid for the price of its
drafting. Exact in fp32; in bf16 a tree-masked forward may flip a near-tie that the reference did not, so the
replayed tau is the one an fp32-exact target would give.

A drafter that reads target features (an EAGLE head) gets them from one forward of the target over prompt +
reference (`reference_features`): the features a verify pass computes at accepted positions are those of the
same prefix, so one pass serves every replay of that prompt."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from castspec.costs.table import CostTable
from castspec.decode.drafting import grow_trees
from castspec.decode.target import join_features
from castspec.decode.tree import DraftTree
from castspec.decode.verify import child_index
from castspec.drafters.base import Drafter
from castspec.errors import CastspecError
from castspec.policies.base import Policy, StepContext


@dataclass
class ReplayResult:
    accepted: list[int]  # tokens accepted per decoding step (bonus included, before the max_new_tokens cut)
    tree_sizes: list[int]  # drafted nodes verified per step
    depths: list[int]  # draft layers per step
    draft_s: float  # measured drafting time
    verify_s: float  # verify forwards priced by the cost table
    ar_s: float  # the same tokens' AR steps priced by the cost table
    new_tokens: int = 0  # tokens generated (the first, from the prefill, included)

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s


def accepted_path(tree: DraftTree, reference: list[int], start: int) -> list[int]:
    """Nodes a greedy target accepts when reference[start:] is what it would generate after the root."""
    child_of = child_index(tree)  # the greedy verifier's walk, with the reference as the target's argmax
    path, node, position = [], 0, start
    while position < len(reference) and (node, reference[position]) in child_of:
        node = child_of[(node, reference[position])]
        path.append(node)
        position += 1
    return path


def reference_features(model, prompt: list[int], reference: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The target's features ([len(prompt) + len(reference), F], `layers` side by side as a verify pass gives
    them) at every position of prompt + reference, for replaying a drafter that reads them."""
    ids = torch.tensor([prompt + reference], device=model.device)
    with torch.inference_mode():  # logits_to_keep=1: the hidden states are wanted, not a logit per position
        out = model(ids, output_hidden_states=True, logits_to_keep=1)
    return join_features(out, layers)[0]


def replay(drafter: Drafter | None, policy: Policy | None, prompt: list[int], reference: list[int], costs: CostTable,
           max_new_tokens: int, features: torch.Tensor | None = None) -> ReplayResult:
    """Decode `prompt` again as the engine would at batch size 1, with `reference` (the target's greedy output)
    standing in for the target's verdicts. A reference longer than `max_new_tokens` lets the last step count
    what it would accept beyond the cut, as the engine's step statistics do. A drafter that reads target
    features needs `features` (`reference_features` of this prompt and reference)."""
    if not reference:
        raise CastspecError("the reference output is empty")
    reads_features = drafter is not None and bool(drafter.feature_layers)
    if reads_features and features is None:
        raise CastspecError(f"the {drafter.name} drafter reads target features: pass the target's features of "
                            "prompt + reference (castspec.bench.replay.reference_features)")
    if reads_features and features.shape[0] < len(prompt) + len(reference) - 1:
        raise CastspecError(f"features cover {features.shape[0]} positions; prompt + reference needs at least "
                            f"{len(prompt) + len(reference) - 1}")
    given = 0  # positions whose features the drafter has received
    if drafter is not None:
        drafter.reset(1)
    emitted, unseen = 1, prompt + reference[:1]
    request = object()  # this replay's row key: a new request, as each prompt is to the engine
    result = ReplayResult([], [], [], 0.0, 0.0, 0.0)
    end = min(len(reference), max_new_tokens)
    while emitted < end:
        context = len(prompt) + emitted - 1  # the KV cache holds everything before the root
        ctx = StepContext(1, context, max_new_tokens - emitted - 1, len(unseen), (request,))
        tree, depth = DraftTree.single(reference[emitted - 1]), 0
        start = time.perf_counter()
        if drafter is not None and policy is not None and ctx.depth_limit > 0 and policy.should_draft(ctx):
            # every absorbed token comes with the feature of the position before it; the root's own is not known
            # until it is verified
            fed = [features[given: context]] if reads_features else None
            trees, record = grow_trees(drafter, policy, [unseen], ctx, fed)
            tree, depth, unseen, given = trees[0], record.depth, [], context
        draft_s = time.perf_counter() - start
        path = accepted_path(tree, reference, emitted)
        new_tokens = reference[emitted: emitted + len(path) + 1]
        verify_s = costs.f_target(1, context, len(tree))
        result.draft_s += draft_s
        result.verify_s += verify_s
        result.ar_s += sum(costs.f_target(1, context + i, 1) for i in range(min(len(new_tokens), end - emitted)))
        result.accepted.append(len(new_tokens))
        result.tree_sizes.append(len(tree) - 1)
        result.depths.append(depth)
        if policy is not None:
            policy.observe_tree(tree, path, request)
            policy.observe(len(new_tokens), draft_s + verify_s)
        emitted += len(new_tokens)
        unseen += new_tokens
    result.new_tokens = min(emitted, end)
    return result
