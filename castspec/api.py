"""The library entry point: load a target (and a drafter), then generate."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from castspec.costs.prefill import PREFILL_AT_ONCE, PREFILL_SLACK, prefill_schedule
from castspec.costs.probe import MODEL_FREE, find_cost_table, online_cost_model
from castspec.costs.table import CostTable, model_identity, setup_key
from castspec.decode.constraints import GrammarCompiler, grammar_from_response_format
from castspec.decode.engine import StepEngine, StepStats, StopCondition, decode
from castspec.decode.prefix_cache import PrefixCache, gigabytes
from castspec.decode.sampling import SamplingParams
from castspec.decode.target import Target
from castspec.drafters.base import Drafter
from castspec.drafters.draft_model import DraftModelDrafter, check_compatible
from castspec.drafters.eagle_head import EagleHeadDrafter, load_eagle_head
from castspec.drafters.ngram import NgramDrafter
from castspec.drafters.suffix import SharedSuffixTrie, SuffixDrafter
from castspec.drafters.with_ngram import NgramAugmentedDrafter
from castspec.errors import CastspecError
from castspec.models import load_model
from castspec.policies.base import ChainPolicy, Eagle2Policy, Policy
from castspec.policies.cast import CastPolicy

METHODS = ("ar", "chain", "eagle2", "cast")
COST_MODELS = ("online", "fixed")
DRAFTERS = MODEL_FREE
CAST_MAX_DEPTH = 8
# CAST's depth cap over a model-free drafter alone (n-gram, suffix): a layer costs microseconds, and copied spans
# run long (chain-16 over n-gram accepted 12.6 tokens a step on HumanEval where CAST, capped at 8, could not)
MODEL_FREE_MAX_DEPTH = 24
# CAST calibrates these drafters' scores by default: an n-gram or suffix match says 1.0 (or a count ratio) where the
# target takes 40-70 % of such nodes (bench/serve-load); under load, where every verified node is paid for, trees
# sized on those scores were larger than they earned (CAST over n-gram at c = 8: 0.80x AR uncalibrated, 0.89x
# calibrated, same run)
CALIBRATED_DRAFTERS = ("ngram", "suffix")


def calibrated_by_default(drafter: str | None, with_suffix: bool = False) -> bool:
    """Whether CAST calibrates this drafter's scores unless told otherwise: the model-free drafters' counts are not
    acceptance probabilities. A model drafter's are, also merged with n-gram (draft+ngram, head+ngram); merged
    with the suffix tree (draft+suffix), whose copied spans dominate the tree, it is calibrated too."""
    return drafter in CALIBRATED_DRAFTERS or with_suffix or (drafter or "").endswith("suffix")


def make_policy(method: str, chain_length: int = 4, top_k: int = 10, depth: int = 5, total_tokens: int = 60,
                cost_table: CostTable | None = None, cast_c1: float = 4.0, cast_c2: float = 3.0,
                cast_c3: float = 2.5, cast_r: int = 8, cast_max_depth: int | None = None, cast_auto: bool = True,
                cast_top_k: int = 8, cast_calibrate: bool | None = False, cast_payoff: bool | None = None
                ) -> Policy | None:
    if method == "cast":
        if cost_table is None:
            raise CastspecError("method 'cast' with a fixed cost model needs a cost table: --cost-table TABLE.json "
                                "(make one with castspec profile), one saved under $CASTSPEC_HOME/costs, or "
                                "--cost-model online (learns the costs as it decodes)")
        max_depth = CAST_MAX_DEPTH if cast_max_depth is None else cast_max_depth
        return CastPolicy(cost_table, cast_c1, cast_c2, cast_c3, cast_r, max_depth, cast_top_k,
                          auto=cast_auto, calibrate=bool(cast_calibrate), payoff=cast_payoff)
    if method == "ar":
        return None
    if method == "chain":
        return ChainPolicy(chain_length)
    if method == "eagle2":
        return Eagle2Policy(top_k, depth, total_tokens)
    raise CastspecError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def drafter_identity(draft_model=None, head_source: str | None = None, model_free: str = "ngram") -> str:
    if head_source is not None:
        return f"eagle-head:{Path(head_source).name}"
    return model_identity(draft_model) if draft_model is not None else model_free


def model_free_drafter(name: str, suffix_depth: int = 16, shared: SharedSuffixTrie | None = None,
                       share: bool = False, **ngram_sizes) -> Drafter:
    """A model-free drafter by name: 'ngram' (n-gram sizes max_n, min_n) or 'suffix' (trie depth, optional
    shared tree over earlier requests' outputs)."""
    if name == "ngram":
        return NgramDrafter(**ngram_sizes)
    if name == "suffix":
        return SuffixDrafter(suffix_depth, shared, share)
    raise CastspecError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTERS)}")


def stop_token_ids(model, tokenizer) -> set[int]:
    """Every token that ends a generation: the model's generation config's and the tokenizer's end-of-sequence."""
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return {int(e) for e in eos} | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def encode_text(tokenizer, prompt: str | None = None, messages: list[dict] | None = None,
                tools: list[dict] | None = None) -> list[int]:
    """Token ids of a plain prompt, or of chat messages through the tokenizer's chat template (generation prompt
    added; `tools`, OpenAI function tools, shown to the model as its template shows them), as the engine
    decodes them."""
    if (prompt is None) == (messages is None):
        raise CastspecError("give exactly one of a prompt or chat messages")
    if messages is not None:
        if not messages or not all(isinstance(m, dict) and "role" in m and ("content" in m or "tool_calls" in m)
                                   for m in messages):
            raise CastspecError("chat messages must be a non-empty list of {'role': ..., 'content': ...}")
        if tokenizer.chat_template is None:
            raise CastspecError("this model's tokenizer has no chat template: give a plain prompt")
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        if not isinstance(prompt, str) or not prompt:
            raise CastspecError("the prompt is empty")
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise CastspecError("the prompt encodes to no tokens")
    return list(ids)


@dataclass
class Generation:
    text: str
    output_ids: list[int]
    prompt_length: int
    stop_reason: str
    wall_s: float
    steps: list[StepStats] = field(default_factory=list)

    @property
    def accept_lengths(self) -> list[int]:
        return [s.accepted for s in self.steps]

    @property
    def mean_accepted(self) -> float:
        """tau: new tokens per target forward (the prefill's token counts against the prefill)."""
        return (len(self.output_ids) - 1) / len(self.steps) if self.steps else float(len(self.output_ids))

    def to_json(self) -> dict:
        return {
            "output_ids": self.output_ids,
            "text": self.text,
            "prompt_length": self.prompt_length,
            "stop_reason": self.stop_reason,
            "steps": len(self.steps),
            "accept_lengths": self.accept_lengths,
            "tree_sizes": [s.tree_size for s in self.steps],
            "depths": [s.draft.depth for s in self.steps],
            "mean_accepted": round(self.mean_accepted, 4),
            "draft_s": round(sum(s.draft_s for s in self.steps), 4),
            "verify_s": round(sum(s.verify_s for s in self.steps), 4),
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(len(self.output_ids) / self.wall_s, 3) if self.wall_s > 0 else None,
        }


def default_choice(method: str | None, draft: str | None, drafter: str | None,
                   head: str | None) -> tuple[str, str | None, str]:
    """The method and drafter a load uses when the caller leaves them out (CAST; the n-gram drafter, which
    needs nothing but the target), and one line that says what was chosen and how to choose otherwise."""
    chosen_method = method or "cast"
    if chosen_method == "ar":
        return chosen_method, drafter, "method ar: plain autoregressive decoding"
    given = ("draft model " + draft if draft else "EAGLE head " + head if head else
             f"{drafter} drafter" if drafter else None)
    chosen_drafter = drafter if given else "ngram"
    source = given or "the n-gram drafter (prompt lookup; --draft or --head for a model drafter)"
    default = "" if method else " (the default; --method ar for plain decoding)"
    return chosen_method, chosen_drafter, f"method {chosen_method}{default} over {source}"


class Engine:
    """A target model, an optional drafter and a tree policy, ready to generate."""

    def __init__(self, model, tokenizer, drafter: Drafter | None = None, policy: Policy | None = None) -> None:
        if (drafter is None) != (policy is None):
            raise CastspecError("a drafter and a policy go together: give both (speculative) or neither (AR)")
        self.model, self.tokenizer = model, tokenizer
        self.target = Target(model)
        self.drafter, self.policy = drafter, policy
        self.eos_ids = stop_token_ids(model, tokenizer)
        self._grammars: GrammarCompiler | None = None
        self.choice = "method ar" if drafter is None else f"method {policy.name} over the {drafter.name} drafter"

    @staticmethod
    def check_options(method: str | None = None, draft: str | None = None, drafter: str | None = None,
                      head: str | None = None, with_ngram: bool = False, cost_model: str = "online",
                      with_suffix: bool = False, suffix_depth: int = 16, suffix_shared_tokens: int = 0,
                      **policy_options) -> None:
        """What `load` refuses before it loads anything (a server checks this before it starts replicas)."""
        method, drafter, _ = default_choice(method, draft, drafter, head)
        if method not in METHODS:
            raise CastspecError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        if sum(x is not None for x in (draft, drafter, head)) > 1:
            raise CastspecError("give one drafter: a draft model, an EAGLE head or --drafter, not several")
        for merged, flag in (("ngram", with_ngram), ("suffix", with_suffix)):
            if flag and draft is None and head is None:
                raise CastspecError(f"with_{merged} merges {merged} proposals into a draft model's or an EAGLE "
                                    f"head's trees: give --draft or --head too (--drafter {merged} alone is the "
                                    f"{merged} drafter)")
        if with_ngram and with_suffix:
            raise CastspecError("merge one model-free drafter into the trees: with_ngram or with_suffix, not both")
        suffix_used = drafter == "suffix" or with_suffix
        if suffix_shared_tokens and not suffix_used:
            raise CastspecError("a shared suffix tree is kept by the suffix drafter: give --drafter suffix or "
                                "--with-suffix")
        if suffix_used:
            SuffixDrafter(suffix_depth, SharedSuffixTrie(suffix_shared_tokens, suffix_depth)
                          if suffix_shared_tokens else None)
        if cost_model not in COST_MODELS:
            raise CastspecError(f"unknown cost model {cost_model!r}; choose from {', '.join(COST_MODELS)}")
        if drafter is not None and drafter not in DRAFTERS:
            raise CastspecError(f"unknown drafter {drafter!r}; choose from {', '.join(DRAFTERS)} "
                                "(or pass a draft model with --draft)")
        if method != "cast":
            make_policy(method, **policy_options)

    @classmethod
    def load(cls, model: str, method: str | None = None, draft: str | None = None, drafter: str | None = None,
             dtype: str = "bf16", device: str = "cpu", cost_table: str | None = None, force_table: bool = False,
             head: str | None = None, with_ngram: bool = False, cost_model: str = "online",
             with_suffix: bool = False, suffix_depth: int = 16, suffix_shared_tokens: int = 0,
             share_by_default: bool = False, prepack: bool = True, compile: bool = False,
             **policy_options) -> Engine:
        """A target by registry name, local directory or hub id, with a drafter and a tree policy. Given only
        the model it decodes with CAST over the n-gram drafter (over `draft` or `head` when given); the engine's
        `choice` says in words what it chose. The suffix drafter (`drafter='suffix'`, or merged into a model
        drafter with `with_suffix`) keeps a tree over earlier requests' outputs within `suffix_shared_tokens`
        tokens (0: none), read by the requests that opt in (all of them with `share_by_default`); CAST
        calibrates the model-free drafters' scores (n-gram, suffix) unless `cast_calibrate` says otherwise.
        `prepack` (default) holds a CPU bf16 / fp16 model's linear weights in oneDNN's blocked layout
        (`decode.prepack`: faster forwards through the same modules); fp32 models are never packed. `compile`
        compiles the target's decode forward (`decode.compiled`; the command line's default, off here because a
        first compile takes a minute or more on a small CPU)."""
        cls.check_options(method, draft, drafter, head, with_ngram, cost_model, with_suffix, suffix_depth,
                          suffix_shared_tokens, **policy_options)
        method, drafter, choice = default_choice(method, draft, drafter, head)
        target_model, tokenizer = load_model(model, dtype, device, prepack=prepack, compile=compile)
        draft_model = None
        if draft is not None:
            draft_model, draft_tokenizer = load_model(draft, dtype, device, prepack=prepack)
            check_compatible(target_model, tokenizer, draft_model, draft_tokenizer)
        chosen: Drafter | None = None
        if method != "ar":
            if head is not None:
                chosen = EagleHeadDrafter(load_eagle_head(head, target_model), target_model)
            elif draft_model is not None:
                chosen = DraftModelDrafter(draft_model)
            shared = (SharedSuffixTrie(suffix_shared_tokens, suffix_depth) if suffix_shared_tokens else None)
            model_free = model_free_drafter("suffix" if drafter == "suffix" or with_suffix else "ngram",
                                            suffix_depth, shared, share_by_default and shared is not None)
            if chosen is None:
                chosen = model_free
            elif with_ngram or with_suffix:
                chosen = NgramAugmentedDrafter(chosen, model_free)
        if method == "cast":
            if policy_options.get("cast_calibrate") is None:  # model-free scores are counts, not probabilities
                policy_options["cast_calibrate"] = calibrated_by_default(drafter, with_suffix)
            if policy_options.get("cast_max_depth") is None and drafter in MODEL_FREE:
                policy_options["cast_max_depth"] = MODEL_FREE_MAX_DEPTH
        table = None
        if method == "cast":
            expect = setup_key(target_model)
            drafter_id = drafter_identity(draft_model, head, "suffix" if drafter == "suffix" else "ngram")
            table = (CostTable.load(cost_table, expect=expect, force=force_table) if cost_table
                     else find_cost_table(expect, drafter_id))
            if cost_model == "online":
                table = online_cost_model(target_model, chosen, drafter_id, seed=table,
                                          chosen_seed=cost_table is not None, save=not force_table)
        policy = make_policy(method, cost_table=table, **policy_options)
        engine = cls(target_model, tokenizer, chosen, policy)
        engine.choice = choice
        return engine

    def stepper(self, max_batch_size: int = 8, max_waiting: int | None = None, prefix_cache_gb: float = 0.0,
                prefill_chunk: int | str | None = None, prefill_slack: float = PREFILL_SLACK,
                prefill_at_once: float = PREFILL_AT_ONCE) -> StepEngine:
        """A stepping engine over this engine's target, drafter and policy (continuous batching; the server's).
        `prefix_cache_gb` > 0: joining prompts reuse earlier sequences' KV, up to that many GiB kept;
        `prefill_chunk`: prompt tokens prefilled per step while other rows decode (None: a joining prompt at once;
        "auto": as many as keep such a step within `prefill_slack` decode steps, learnt from the steps' times, and
        a prompt whose prefill costs at most `prefill_at_once` decode steps whole)."""
        cache = PrefixCache(gigabytes(prefix_cache_gb)) if prefix_cache_gb > 0 else None
        return StepEngine(self.target, self.drafter, self.policy, self.tokenizer, self.eos_ids, max_batch_size,
                          max_waiting, cache, prefill_schedule(prefill_chunk, prefill_slack, prefill_at_once))

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's view of the tokenizer, built at the first constrained generation (~2 s)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.target.model.config.vocab_size, self.eos_ids)
        return self._grammars

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        return encode_text(self.tokenizer, prompt, messages)

    def generate(self, prompt: str | None = None, messages: list[dict] | None = None, max_new_tokens: int = 128,
                 stop: list[str] | None = None, prompt_ids: list[int] | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 draft_sampling: str = "topk", response_format=None) -> Generation:
        """Greedy generation (temperature 0) is token-identical to the target's own greedy decoding; with
        temperature > 0 the output is distributed exactly as plain sampling with the same temperature, top_p and
        top_k, and the same seed repeats the same output. `draft_sampling`: the drafter proposes its top-k
        ("topk") or draws its candidates from its own distribution ("sample", draft models only).
        `response_format`: OpenAI's ({"type": "json_schema", "json_schema": {"schema": ...}}, json_object) or a
        `Grammar` (regex, choice, lark): the output is what the target decodes under that grammar's mask."""
        ids = list(prompt_ids) if prompt_ids is not None else self.encode(prompt, messages)
        return self.generate_batch(prompt_ids=[ids], max_new_tokens=max_new_tokens, stop=stop,
                                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                   draft_sampling=draft_sampling, response_format=response_format)[0]

    def generate_batch(self, prompts: list[str | list[dict]] | None = None, max_new_tokens: int = 128,
                       stop: list[str] | None = None, prompt_ids: list[list[int]] | None = None,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                       draft_sampling: str = "topk", response_format=None) -> list[Generation]:
        """Generate for several prompts at once (a prompt string or a list of chat messages each): one batched
        target forward per step, every row drafting its own tree. Greedy rows are token-identical to
        generating each prompt alone. Sampling: row b uses seed + b."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise CastspecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        sampling = SamplingParams(temperature, top_p, top_k, seed)
        if draft_sampling not in ("topk", "sample"):
            raise CastspecError(f"draft_sampling must be 'topk' or 'sample', got {draft_sampling!r}")
        if prompt_ids is None:
            if not isinstance(prompts, list) or not prompts:
                raise CastspecError("give a non-empty list of prompts")
            prompt_ids = [self.encode(messages=p) if isinstance(p, list) else self.encode(prompt=p) for p in prompts]
        if not prompt_ids or any(not ids for ids in prompt_ids):
            raise CastspecError("the prompt is empty")
        generators = None
        if not sampling.greedy:
            generators = [dataclasses.replace(sampling, seed=None if seed is None else seed + row).generator()
                          for row in range(len(prompt_ids))]
        if self.drafter is not None:
            self.drafter.sample_candidates(sampling if draft_sampling == "sample" else None,
                                           generators[0] if generators else None)
        limit = self.target.max_positions
        conditions = []
        for ids in prompt_ids:
            budget = max_new_tokens
            if limit is not None:
                if len(ids) >= limit:
                    raise CastspecError(f"the prompt has {len(ids)} tokens; this model's context holds {limit}, "
                                        "leaving no room to generate")
                budget = min(max_new_tokens, limit - len(ids))
            conditions.append(StopCondition(budget, self.eos_ids, stop or [], self.tokenizer))
        grammar = grammar_from_response_format(response_format)
        constraints = [self.grammars.constraint(grammar) for _ in prompt_ids] if grammar is not None else None
        start = time.perf_counter()
        outputs, steps = decode(self.target, self.drafter, self.policy, [list(i) for i in prompt_ids], conditions,
                                sampling, generators, constraints)
        wall = time.perf_counter() - start
        return [Generation(self.tokenizer.decode(out, skip_special_tokens=True), out, len(ids),
                           cond.reason or "max_new_tokens", wall, row_steps)
                for out, ids, cond, row_steps in zip(outputs, prompt_ids, conditions, steps, strict=True)]
