"""The decode loop: draft a tree, verify it in one target forward, accept, commit, repeat."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from castspec.drafters.base import Drafter
from castspec.drafting import DraftRecord, grow_trees
from castspec.policies import Policy, StepContext
from castspec.sampling import SamplingParams
from castspec.target import Target
from castspec.tree import DraftTree
from castspec.verify import accept


@dataclass
class StepStats:
    accepted: int  # tokens emitted by this step, bonus included (before any stop cut)
    tree_size: int  # drafted nodes verified (root excluded)
    draft_s: float
    verify_s: float
    context_length: int
    draft: DraftRecord = field(default_factory=DraftRecord)


class StopCondition:
    """Ends generation where plain decoding would: after an EOS token, after max_new_tokens, or after the
    token that completes a stop string."""

    def __init__(self, max_new_tokens: int, eos_ids: set[int], stop_strings: list[str], tokenizer) -> None:
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.stop_strings, self.tokenizer = [s for s in stop_strings if s], tokenizer
        self.window = max((len(s) for s in self.stop_strings), default=0) + 8
        self.reason: str | None = None

    def push(self, output: list[int], token: int) -> bool:
        output.append(token)
        if token in self.eos_ids:
            self.reason = "eos"
        elif self.stop_strings and any(s in self.tokenizer.decode(output[-self.window:]) for s in self.stop_strings):
            self.reason = "stop_string"
        elif len(output) >= self.max_new_tokens:
            self.reason = "max_new_tokens"
        return self.reason is not None


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def decode(
    target: Target, drafter: Drafter | None, policy: Policy | None, prompts: list[list[int]],
    stops: list[StopCondition], sampling: SamplingParams | None = None,
    generators: list[torch.Generator] | None = None,
) -> tuple[list[list[int]], list[list[StepStats]]]:
    """Decode a batch of prompts (row b: prompts[b], stops[b], generators[b]); returns each row's tokens and
    steps. Greedy (`sampling` None or temperature 0): every row is token-identical to decoding its prompt alone.
    Sampling: every row is distributed exactly as plain sampling. Finished rows leave the batch."""
    outputs: list[list[int]] = [[] for _ in prompts]
    steps: list[list[StepStats]] = [[] for _ in prompts]
    generators = generators or [None] * len(prompts)
    layers = drafter.feature_layers if drafter is not None else ()
    first, prompt_features = target.prefill(prompts, layers)
    roots = [accept(DraftTree.single(-1), first[b: b + 1], sampling, generators[b])[1] for b in range(len(prompts))]
    active = [b for b in range(len(prompts)) if not stops[b].push(outputs[b], roots[b])]
    unseen = {b: prompts[b] + [roots[b]] for b in active}  # accepted tokens the drafter has not absorbed yet
    features = {b: [prompt_features[b]] for b in active} if layers else {}  # target features before them
    target.keep_rows(active)
    if drafter is not None:
        drafter.reset(len(active))
    window = target.max_positions or 1 << 30
    while active:
        t0 = _clock(target.device)
        limits = [min(stops[b].max_new_tokens - len(outputs[b]), window - target.lengths[i]) - 1
                  for i, b in enumerate(active)]
        ctx = StepContext(len(active), target.length, max(limits), max(len(unseen[b]) for b in active))
        trees, record = [DraftTree.single(roots[b]) for b in active], DraftRecord()
        if drafter is not None and policy is not None and ctx.depth_limit > 0 and policy.should_draft(ctx):
            trees, record = grow_trees(drafter, policy, [unseen[b] for b in active], ctx,
                                       [torch.cat(features[b]) for b in active] if layers else None)
            trees = [t.subtree((t.depths <= limit).nonzero().flatten())  # rows nearer their end draft less deep
                     for t, limit in zip(trees, limits, strict=True)]
            unseen, features = {b: [] for b in active}, {b: [] for b in features}
        t1 = _clock(target.device)
        logits, verified_features = target.verify(trees, layers)
        results = [accept(tree, logits[i, : len(tree)], sampling, generators[b])
                   for i, (b, tree) in enumerate(zip(active, trees, strict=True))]
        t2 = _clock(target.device)
        going, emitted = [], 0
        for i, (b, tree, (path, bonus)) in enumerate(zip(active, trees, results, strict=True)):
            new_tokens = tree.tokens[path].tolist() + [bonus]
            emitted += len(new_tokens)
            steps[b].append(StepStats(len(new_tokens), len(tree) - 1, t1 - t0, t2 - t1, ctx.context_length, record))
            if policy is not None:
                policy.observe_tree(tree, path)
            if not any(stops[b].push(outputs[b], token) for token in new_tokens):
                going.append(i)
                unseen[b] += new_tokens
                if layers:
                    features[b].append(verified_features[i, [0, *path]])
                roots[b] = bonus
        if policy is not None:
            policy.observe(emitted / len(active), t2 - t0)
        if len(going) < len(active):
            target.keep_rows(going)
            if drafter is not None:
                drafter.keep_rows(going)
        if going:
            target.commit([[0, *results[i][0]] for i in going])
        active = [active[i] for i in going]
    return outputs, steps
