"""The decode loop: draft a tree, verify it in one target forward, accept, commit, repeat."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from castspec.drafters.base import Drafter
from castspec.drafting import DraftRecord, grow_tree
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
    target: Target, drafter: Drafter | None, policy: Policy | None, prompt_ids: list[int], stop: StopCondition,
    sampling: SamplingParams | None = None, generator: torch.Generator | None = None,
) -> tuple[list[int], list[StepStats]]:
    """Greedy when `sampling` is None or has temperature 0; otherwise every emitted token is distributed
    exactly as plain sampling with `sampling` would draw it, using `generator` for every random choice."""
    output: list[int] = []
    steps: list[StepStats] = []
    _, root = accept(DraftTree.single(-1), target.prefill(prompt_ids)[None], sampling, generator)
    if stop.push(output, root):
        return output, steps
    unseen = prompt_ids + [root]  # accepted tokens the drafter has not absorbed yet (it may skip steps)
    if drafter is not None:
        drafter.reset()
    window = target.max_positions or 1 << 30
    while True:
        t0 = _clock(target.device)
        ctx = StepContext(1, target.length, min(stop.max_new_tokens - len(output), window - target.length) - 1)
        tree, record = DraftTree.single(root), DraftRecord()
        if drafter is not None and policy is not None and ctx.depth_limit > 0 and policy.should_draft(ctx):
            tree, record = grow_tree(drafter, policy, unseen, ctx)
            unseen = []
        t1 = _clock(target.device)
        logits, _ = target.verify(tree)
        path, bonus = accept(tree, logits, sampling, generator)
        t2 = _clock(target.device)
        new_tokens = tree.tokens[path].tolist() + [bonus]
        steps.append(StepStats(len(new_tokens), len(tree) - 1, t1 - t0, t2 - t1, ctx.context_length, record))
        if policy is not None:
            policy.observe(len(new_tokens), t2 - t0)
        if any(stop.push(output, token) for token in new_tokens):
            return output, steps
        target.commit([0, *path])
        unseen += new_tokens
        root = bonus
