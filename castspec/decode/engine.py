"""The stepping engine: requests join, each step drafts a tree per row, verifies them all in one target forward,
accepts and commits; requests leave the moment they finish or are aborted.

`StepEngine` is the one decode loop. `step()` admits waiting requests while rows are free and runs one target
forward: every running row's tree together with the next tokens of the prompts still being prefilled (a chunk per
step, or whole), so a newcomer never costs the batch a forward of its own; prompts done join with their first
token. `decode` (offline batches) and the server are loops over it. With a prefix cache, joining prompts reuse
the KV of earlier sequences' first tokens and every row's committed KV is stored when it leaves."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from castspec.costs.online import OnlineCostTable
from castspec.costs.prefill import PrefillBudget, prefill_schedule
from castspec.decode.constraints import Constraint, Grammar, GrammarCompiler, GrammarError
from castspec.decode.drafting import DraftRecord, grow_trees
from castspec.decode.prefix_cache import PrefixCache
from castspec.decode.sampling import SamplingParams
from castspec.decode.step_timer import StepTimer
from castspec.decode.target import Prefill, Target
from castspec.decode.tree import DraftTree
from castspec.decode.verify import accept
from castspec.drafters.base import Drafter
from castspec.errors import CastspecError
from castspec.policies.base import Policy, StepContext


@dataclass
class StepStats:
    accepted: int  # tokens emitted by this step, bonus included (before any stop cut)
    tree_size: int  # drafted nodes verified (root excluded)
    draft_s: float
    verify_s: float
    context_length: int
    draft: DraftRecord = field(default_factory=DraftRecord)
    batch_size: int = 1  # rows verified together in this step


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


class RequestError(CastspecError):
    """A request the engine refuses; `param` names the offending field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the target's raw distribution at its position (before
    temperature, top-k / top-p and any grammar mask, as vLLM reports them), and the likeliest tokens there."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`logits` [n, V]: row j the target's logits where tokens[j] was emitted."""
    logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    return [TokenLogprob(token, value, list(zip(best.indices[j].tolist(), best.values[j].tolist(), strict=True))
                         if best is not None else [])
            for j, (token, value) in enumerate(zip(tokens, chosen, strict=True))]


@dataclass(frozen=True)
class RequestParams:
    """Per-request settings: how long, where to stop, and how to draw (temperature 0 = greedy)."""

    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # read earlier requests' outputs from the drafter's shared history and add this one's (None: the drafter's
    # default; the suffix drafter with a shared tree)
    share_history: bool | None = None
    grammar: Grammar | None = None  # structured output: every token is drawn under this grammar's mask
    # each output token's log-probability under the target's own (raw) distribution, and this many of the
    # likeliest tokens' (None: none)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not all(isinstance(s, str) for s in self.stop):
            raise RequestError("stop must be a string or a list of strings", "stop")
        if self.share_history is not None and not isinstance(self.share_history, bool):
            raise RequestError("share_history must be true or false", "share_history")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise RequestError("grammar must be a castspec Grammar", "response_format")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"top logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got "
                               f"{self.logprobs!r}", "top_logprobs")
        try:
            _ = self.sampling
        except CastspecError as e:
            param = next((p for p in ("temperature", "top_p", "top_k", "seed") if str(e).startswith(p)), None)
            raise RequestError(str(e), param) from None

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.seed)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]  # accepted since the last output (several per speculative step)
    text: str  # the text they add (held back while it could still turn into a stop string or a partial char)
    finished: bool
    finish_reason: str | None  # eos | stop_string | max_new_tokens | abort
    output_ids: list[int]  # every token so far
    steps: list[StepStats]  # every verify step so far
    full_text: str = ""  # every text delta so far, joined (once finished: the whole answer, cut at a stop string)
    prefill_started: float | None = None  # perf_counter when its prefill began (queue time ends there)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, when asked for


@dataclass
class StepInfo:
    """The latest step, for metrics and traces: which kind, how many rows, the trees they verified."""

    kind: str  # "prefill" (rows joined), "prefill_chunk" (rows still prefilling) or "decode"
    batch_size: int
    tree_sizes: list[int]
    accepted: list[int]  # tokens emitted per row
    record: DraftRecord | None
    seconds: float
    prompt_tokens: int = 0  # prompt tokens the step's forward prefilled (beside the trees of a decode step)
    cached_tokens: int = 0  # of those, taken from the prefix cache (not prefilled)


_SERIALS = itertools.count()


class _Sequence:
    def __init__(self, request_id: str, prompt: list[int], stop: StopCondition, sampling: SamplingParams | None,
                 generator: torch.Generator | None, constraint: Constraint | None = None) -> None:
        self.id, self.prompt, self.stop = request_id, prompt, stop
        self.serial = next(_SERIALS)  # unique in the process, where request ids repeat (every decode() has a "0")
        self.sampling, self.generator = sampling, generator
        self.constraint = constraint  # its grammar, in the state after every token it emitted
        self.top_logprobs: int | None = None  # logprobs asked for: this many top tokens with each
        self.logprobs: list[TokenLogprob] = []
        self.output: list[int] = []
        self.steps: list[StepStats] = []
        self.root = -1
        self.unseen: list[int] = []  # accepted tokens the drafter has not absorbed yet
        self.features: list[torch.Tensor] = []  # target features before them
        self.reported = 0  # tokens already handed out
        self.text_sent = ""
        self.share_history: bool | None = None
        self.prefill_started: float | None = None
        self.cached_tokens = 0
        self.committed_features: list[torch.Tensor] = []  # features of its committed KV (kept for a prefix cache)


def _no_lap(phase: str) -> None:
    pass


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StepEngine:
    """Continuous batching over one target, drafter and policy. Not thread-safe: one thread drives it (the
    server's engine loop); others hand requests to that thread."""

    def __init__(self, target: Target, drafter: Drafter | None = None, policy: Policy | None = None,
                 tokenizer=None, eos_ids: set[int] | None = None, max_batch_size: int = 8,
                 max_waiting: int | None = None, prefix_cache: PrefixCache | None = None,
                 prefill_chunk: int | str | PrefillBudget | None = None) -> None:
        if (drafter is None) != (policy is None):
            raise CastspecError("a drafter and a policy go together: give both (speculative) or neither (AR)")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise CastspecError(f"max batch size must be a positive integer, got {max_batch_size!r}")
        self.target, self.drafter, self.policy = target, drafter, policy
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids or ())
        self.max_batch_size, self.max_waiting = max_batch_size, max_waiting
        self.prefix_cache, self.prefill_chunk = prefix_cache, prefill_schedule(prefill_chunk)
        self.layers = drafter.feature_layers if drafter is not None else ()
        # a learning cost model takes this engine's timed forwards (it only changes which trees CAST picks)
        costs = getattr(policy, "costs", None)
        self.learner: OnlineCostTable | None = costs if isinstance(costs, OnlineCostTable) else None
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []  # row i of the target's (and drafter's) batch
        self.aborted: set[str] = set()
        self.joining: list[_Sequence] = []  # requests whose prompts are being prefilled (by chunks while others decode)
        self.prefills: list[Prefill] = []  # their prompts' progress, in the same order
        self.step_infos: list[StepInfo] = []  # what the latest step() ran: a prefill (chunk), a decode step or both
        self.timer: StepTimer | None = None  # set by `castspec bench --overhead`: per-phase step times
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        target.keep_rows([])
        if drafter is not None:
            drafter.reset(0)

    # -- requests ---------------------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt_ids: list[int], params: RequestParams | None = None
                    ) -> str:
        """Queue a request; it joins the batch at the next step with room. Raises RequestError for a request
        that cannot run (empty or too long prompt, max_tokens past the context, a full queue, a duplicate id)."""
        params = params or RequestParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if any(s.id == request_id for s in itertools.chain(self.waiting, self.running)):
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        self.check_request(prompt_ids, params)
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise RequestError(f"the waiting queue is full ({self.max_waiting} requests)", "queue")
        sampling = params.sampling
        stop = StopCondition(params.max_tokens, self.eos_ids, list(params.stop), self.tokenizer)
        self.add_sequence(request_id, list(prompt_ids), stop, sampling,
                          None if sampling.greedy else sampling.generator(), params.share_history,
                          self.constraint(params.grammar) if params.grammar is not None else None, params.logprobs)
        return request_id

    @property
    def grammars(self) -> GrammarCompiler:
        """The tokenizer's grammar compiler, built at the first constrained request (~2 s for a 151k vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise CastspecError("structured output needs the engine's tokenizer")
                self._grammars = GrammarCompiler(self.tokenizer, self.target.model.config.vocab_size, self.eos_ids)
            return self._grammars

    def constraint(self, grammar: Grammar) -> Constraint:
        """A fresh matcher for `grammar` (RequestError naming the request field when it cannot be served)."""
        try:
            return self.grammars.constraint(grammar)
        except GrammarError as e:
            raise RequestError(str(e), e.param) from None

    def check_request(self, prompt_ids: list[int], params: RequestParams) -> None:
        """Raise RequestError unless the request could run on this model (reads nothing that steps change)."""
        if params.share_history and not (self.drafter is not None and self.drafter.can_share):
            raise RequestError("share_history needs a drafter with a shared history: start the server with "
                               "--drafter suffix --suffix-shared-tokens N", "share_history")
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
            raise RequestError("the prompt must be a non-empty list of token ids", "prompt")
        vocab = self.target.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise RequestError(f"the prompt holds token ids outside this model's vocabulary (0..{vocab - 1})",
                               "prompt")
        limit = self.target.max_positions
        if limit is not None:
            if len(prompt_ids) >= limit:
                raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context holds {limit}, "
                                   "leaving no room to generate", "input_tokens")
            if len(prompt_ids) + params.max_tokens > limit:
                raise RequestError(f"max_tokens {params.max_tokens} is too large: the prompt has {len(prompt_ids)} "
                                   f"tokens and this model's context holds {limit}, so at most "
                                   f"{limit - len(prompt_ids)} can be generated", "max_tokens")
        if params.grammar is not None:
            try:
                self.grammars.check(params.grammar)
            except GrammarError as e:
                raise RequestError(str(e), e.param) from None

    def add_sequence(self, request_id: str, prompt: list[int], stop: StopCondition,
                     sampling: SamplingParams | None = None, generator: torch.Generator | None = None,
                     share_history: bool | None = None, constraint: Constraint | None = None,
                     top_logprobs: int | None = None) -> None:
        """Queue an already validated sequence with its own stop condition, generator and grammar state
        (`top_logprobs`: report each token's logprob with this many top tokens)."""
        seq = _Sequence(request_id, prompt, stop, sampling, generator, constraint)
        seq.top_logprobs = top_logprobs
        seq.share_history = share_history
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """The request leaves at the next step boundary (its KV freed); unknown or finished ids are ignored."""
        self.aborted.add(str(request_id))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.joining)

    @property
    def last_step(self) -> StepInfo | None:
        return self.step_infos[-1] if self.step_infos else None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- stepping ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests while there is room, then one forward: a speculative step over the running
        rows that also prefills the joining prompts' next tokens (at most `prefill_chunk` of them, or what its
        PrefillBudget allows; None: all),
        or, with nobody running, the joining prompts whole. Prompts prefilled to the end join the batch with
        their first token, so a long prompt delays the running rows by the cost of its chunk's tokens, never by
        a forward of its own."""
        self.step_infos = []
        outputs = self._drop_aborted()
        self._admit()
        if self.running:
            return _one_per_request(outputs + self._decode_step())
        if self.joining:
            t0 = _clock(self.target.device)
            *_, tokens = self.target.forward([], self.prefills, None, self.layers)
            outputs += self._join(t0, tokens, alone=True)
        return outputs

    def _drop_aborted(self) -> list[RequestOutput]:
        if not self.aborted:
            return []
        outputs = []
        for seq in [s for s in self.waiting if s.id in self.aborted]:
            self.waiting.remove(seq)
            seq.stop.reason = "abort"
            outputs.append(self._output(seq))
        gone = [i for i, s in enumerate(self.running) if s.id in self.aborted]
        for i in gone:
            self.running[i].stop.reason = "abort"
            outputs.append(self._output(self.running[i]))
        if gone:
            self._keep([i for i in range(len(self.running)) if i not in gone])
        dropped = [i for i, s in enumerate(self.joining) if s.id in self.aborted]
        if dropped:  # half-prefilled prompts leave; the others go on where they are
            self.target.drop_prefills([self.prefills[i] for i in dropped])
            for i in dropped:
                self.joining[i].stop.reason = "abort"
                outputs.append(self._output(self.joining[i]))
            self.joining = [s for i, s in enumerate(self.joining) if i not in dropped]
            self.prefills = [p for i, p in enumerate(self.prefills) if i not in dropped]
        self.aborted.clear()
        return outputs

    def _keep(self, rows: list[int], tails: dict[int, tuple[list[int], torch.Tensor | None]] | None = None) -> None:
        """Only `rows` go on; the others leave (their KV into the prefix cache; `tails`: a finishing row's accepted
        nodes of its last tree, as `_store_prefix` takes them)."""
        if len(rows) < len(self.running):
            if self.prefix_cache is not None:
                for row in sorted(set(range(len(self.running))) - set(rows)):
                    self._store_prefix(row, *(tails or {}).get(row, (None, None)))
            self.target.keep_rows(rows)
            if self.drafter is not None:
                self.drafter.keep_rows(rows)
            self.running = [self.running[i] for i in rows]

    def _store_prefix(self, row: int, tail: list[int] | None = None, tail_features: torch.Tensor | None = None
                      ) -> None:
        """Put a leaving row's KV (its prompt and the tokens it accepted) into the prefix cache. `tail`: the nodes
        of its last verified tree it accepted (root first), whose entries were computed but not committed: a row
        that finishes in a step keeps every entry plain decoding would have (all but the last token's)."""
        seq, cache = self.running[row], self.prefix_cache
        tokens = seq.prompt + seq.output
        count, entries = self.target.row_entries(row, tail or [])
        count = min(count, len(tokens) - 1)
        if count < cache.block_tokens:
            return
        features = None
        if self.layers and seq.committed_features:
            features = torch.cat(seq.committed_features + ([tail_features] if tail_features is not None else []))
            features = features[:count] if features.shape[0] >= count else None
        cache.insert(tokens[:count], entries[:, :, :, :count], features)

    def _admit(self) -> None:
        """Waiting requests take the free rows: each gets its cached prefix (if any) in its slot at once; the
        rest of its prompt is prefilled by the next forwards."""
        room = self.max_batch_size - len(self.running) - len(self.joining)
        if room <= 0 or not self.waiting:
            return
        joining = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        hits = [None] * len(joining)
        if self.prefix_cache is not None:
            hits = [self.prefix_cache.match(s.prompt, limit=len(s.prompt) - 1) for s in joining]
        now = time.perf_counter()
        for seq, hit in zip(joining, hits, strict=True):
            seq.prefill_started, seq.cached_tokens = now, hit.length if hit is not None else 0
        self.joining += joining
        self.prefills += self.target.start_rows([s.prompt for s in joining], hits)

    def _join(self, t0: float, prompt_tokens: int, alone: bool) -> list[RequestOutput]:
        """Prompts prefilled to their end join the batch with their first token (drawn from the logits that
        predict it). `prompt_tokens`: what the step prefilled; `alone`: in a forward of their own (nobody was
        running), which the step's record times, else inside the decode step's."""
        done = [i for i, p in enumerate(self.prefills) if p.complete]
        if not done:
            if alone:
                self.step_infos.append(StepInfo("prefill_chunk", len(self.joining), [0] * len(self.joining),
                                                [0] * len(self.joining), None, _clock(self.target.device) - t0,
                                                prompt_tokens))
            return []
        joining, prefills = [self.joining[i] for i in done], [self.prefills[i] for i in done]
        self.joining = [s for i, s in enumerate(self.joining) if i not in done]
        self.prefills = [p for i, p in enumerate(self.prefills) if i not in done]
        first, prompt_features = self.target.join_rows(prefills, self.layers)
        if self.drafter is not None:
            self.drafter.add_rows(len(joining))
            chosen = [(len(self.running) + i, s.share_history) for i, s in enumerate(joining)
                      if s.share_history is not None]
            if chosen:
                self.drafter.set_sharing([row for row, _ in chosen], [flag for _, flag in chosen])
        outputs, finished = [], []
        for i, seq in enumerate(joining):
            seq.root = accept(DraftTree.single(-1), first[i: i + 1], seq.sampling, seq.generator, seq.constraint)[1]
            seq.unseen = seq.prompt + [seq.root]
            seq.features = [prompt_features[i]] if self.layers else []
            if self.layers and self.prefix_cache is not None:
                seq.committed_features = [prompt_features[i]]
            if seq.top_logprobs is not None:
                seq.logprobs += token_logprobs(first[i: i + 1], [seq.root], seq.top_logprobs)
            if seq.stop.push(seq.output, seq.root):
                finished.append(len(self.running) + i)
            outputs.append(self._output(seq))
        self.running += joining
        if self.prefix_cache is not None:  # the prompts' KV, for requests that share them while these run
            for row in range(len(self.running) - len(joining), len(self.running)):
                if row not in finished:
                    self._store_prefix(row)
        self._keep([i for i in range(len(self.running)) if i not in finished])
        seconds = _clock(self.target.device) - t0 if alone else 0.0  # else timed with the decode step
        self.step_infos.append(StepInfo("prefill", len(joining), [0] * len(joining), [1] * len(joining), None,
                                        seconds, prompt_tokens, sum(s.cached_tokens for s in joining)))
        return outputs

    def _decode_step(self) -> list[RequestOutput]:
        target, drafter, policy, rows = self.target, self.drafter, self.policy, self.running
        lap = self.timer.lap if self.timer is not None else _no_lap
        if self.timer is not None:
            self.timer.begin()
        window = target.max_positions or 1 << 30
        t0 = _clock(target.device)
        limits = [min(s.stop.max_new_tokens - len(s.output), window - target.lengths[i]) - 1
                  for i, s in enumerate(rows)]
        ctx = StepContext(len(rows), target.length, max(limits), max(len(s.unseen) for s in rows),
                          tuple(s.serial for s in rows))
        trees, record = [DraftTree.single(s.root) for s in rows], DraftRecord()
        drafting = drafter is not None and policy is not None and ctx.depth_limit > 0 and policy.should_draft(ctx)
        lap("plan")
        if drafting:
            trees, record = grow_trees(drafter, policy, [s.unseen for s in rows], ctx,
                                       [torch.cat(s.features) for s in rows] if self.layers else None,
                                       (lambda: _clock(target.device)) if self.learner else None,
                                       [s.constraint for s in rows])
            trees = [t if t.max_depth <= limit else t.subtree((t.depths <= limit).nonzero().flatten())
                     for t, limit in zip(trees, limits, strict=True)]  # rows nearer their end draft less deep
            for s in rows:
                s.unseen, s.features = [], []
        t1 = _clock(target.device)
        lap("draft")
        # the joining prompts' next tokens ride in the same forward (the weights are read once for both)
        chunk = self.prefill_chunk
        if isinstance(chunk, PrefillBudget):  # a short prompt whole, a long one by chunks
            first = next((p for p in self.prefills if not p.complete), None)
            chunk = 0 if first is None else chunk.budget(first.left, len(rows), len(first.prompt) - first.cached)
        logits, verified_features, prompt_tokens = target.forward(trees, self.prefills, chunk, self.layers)
        lap("verify")
        results = [accept(tree, logits[i][: len(tree)], s.sampling, s.generator, s.constraint)
                   for i, (s, tree) in enumerate(zip(rows, trees, strict=True))]
        t2 = _clock(target.device)
        lap("accept")
        going, emitted, outputs = [], [], []
        for i, (s, tree, (path, bonus)) in enumerate(zip(rows, trees, results, strict=True)):
            new_tokens = tree.tokens[path].tolist() + [bonus]
            emitted.append(len(new_tokens))
            s.steps.append(StepStats(len(new_tokens), len(tree) - 1, t1 - t0, t2 - t1, ctx.context_length, record,
                                     len(rows)))
            if policy is not None:
                policy.observe_tree(tree, path, s.serial)
            if s.top_logprobs is not None:  # token j was emitted at node j of the accepted path (root first)
                s.logprobs += token_logprobs(logits[i][[0, *path]], new_tokens, s.top_logprobs)
            if not any(s.stop.push(s.output, token) for token in new_tokens):
                going.append(i)
                s.unseen += new_tokens
                if self.layers:
                    s.features.append(verified_features[i][[0, *path]])
                    if self.prefix_cache is not None:
                        s.committed_features.append(s.features[-1])
                s.root = bonus
            if s.top_logprobs is not None:
                del s.logprobs[len(s.output):]  # tokens past a stop are not output
            outputs.append(self._output(s))
        lap("outputs")
        # a step that also prefilled is not what the policy and the cost model price (its time has the prompt's)
        if policy is not None and not prompt_tokens:
            policy.observe(sum(emitted) / len(rows), t2 - t0)
        if self.learner is not None and not prompt_tokens:
            self._learn(ctx, max(len(t) for t in trees), record, t1 - t0, t2 - t1)
        if isinstance(self.prefill_chunk, PrefillBudget):
            self.prefill_chunk.observe(t2 - t0, prompt_tokens, len(rows))
        lap("policy")
        kept = [[0, *results[i][0]] for i in going]
        tails = None
        if self.prefix_cache is not None:  # rows that finish here: their accepted nodes' entries go in the cache
            tails = {i: ([0, *path], verified_features[i][[0, *path]] if self.layers else None)
                     for i, (path, _) in enumerate(results) if i not in going}
        self._keep(going, tails)
        if going:
            target.commit(kept)
        self.step_infos.append(StepInfo("decode", len(rows), [len(t) - 1 for t in trees], emitted, record, t2 - t0,
                                        prompt_tokens))
        if self.timer is not None:
            lap("commit")
            self.timer.end(len(rows), sum(len(t) - 1 for t in trees))
        if self.prefills:
            outputs += self._join(t0, prompt_tokens, alone=False)
        return outputs

    def _learn(self, ctx: StepContext, verified: int, record: DraftRecord, draft_s: float, verify_s: float) -> None:
        """Feed the step's timed forwards to the online cost model; the trace gets what it predicted for them
        beside what they took."""
        costs, b, c = self.learner, ctx.batch_size, ctx.context_length
        timing = {"verify_s": verify_s, "verify_predicted_s": costs.f_target(b, c, verified), "draft_s": draft_s,
                  "draft_predicted_s": sum(costs.f_draft(b, c + extra, n) for extra, n, _ in record.forwards)}
        costs.observe_target(b, c, verified, verify_s)
        for extra, n, seconds in record.forwards:
            costs.observe_draft(b, c + extra, n, seconds)
        record.decisions["timing"] = {k: round(v, 6) for k, v in timing.items()}

    def flush_costs(self) -> None:
        """Save what the online cost model learned (decode() does at its end, the server when it stops)."""
        if self.learner is not None:
            self.learner.flush()

    # -- outputs ----------------------------------------------------------------------------------------------
    def _output(self, seq: _Sequence) -> RequestOutput:
        finished = seq.stop.reason is not None
        new = seq.output[seq.reported:]
        seq.reported = len(seq.output)
        text = ""
        if self.tokenizer is not None:
            visible = self._visible_text(seq, finished)
            if visible.startswith(seq.text_sent):
                text = visible[len(seq.text_sent):]
                seq.text_sent = visible
        return RequestOutput(seq.id, new, text, finished, seq.stop.reason, seq.output, seq.steps, seq.text_sent,
                             seq.prefill_started, seq.cached_tokens, seq.logprobs[len(seq.output) - len(new):]
                             if seq.top_logprobs is not None else [])

    def _visible_text(self, seq: _Sequence, finished: bool) -> str:
        """The text a client may see so far: cut at a stop string once one completed; while running, without a
        trailing partial character or a tail that could still become a stop string."""
        text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        stops = seq.stop.stop_strings
        if seq.stop.reason == "stop_string":
            return text[: min((text.find(s) for s in stops if s in text), default=len(text))]
        if finished:
            return text
        text = text.rstrip("\ufffd")
        hold = max((len(s) - 1 for s in stops), default=0)
        return text[: len(text) - hold] if hold else text


def _one_per_request(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """A request that joined and decoded in the same step gets one output with both steps' tokens."""
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        earlier = merged.get(out.request_id)
        merged[out.request_id] = out if earlier is None else replace(
            out, new_token_ids=earlier.new_token_ids + out.new_token_ids, text=earlier.text + out.text)
    return list(merged.values())


def decode(
    target: Target, drafter: Drafter | None, policy: Policy | None, prompts: list[list[int]],
    stops: list[StopCondition], sampling: SamplingParams | None = None,
    generators: list[torch.Generator] | None = None, constraints: list[Constraint | None] | None = None,
) -> tuple[list[list[int]], list[list[StepStats]]]:
    """Decode a batch of prompts (row b: prompts[b], stops[b], generators[b]); returns each row's tokens and
    steps. Greedy (`sampling` None or temperature 0): every row is token-identical to decoding its prompt alone.
    Sampling: every row is distributed exactly as plain sampling. Finished rows leave the batch."""
    engine = StepEngine(target, drafter, policy, max_batch_size=max(1, len(prompts)))
    generators = generators or [None] * len(prompts)
    constraints = constraints or [None] * len(prompts)
    for b, (prompt, stop, generator, constraint) in enumerate(zip(prompts, stops, generators, constraints,
                                                                   strict=True)):
        engine.add_sequence(str(b), prompt, stop, sampling, generator, constraint=constraint)
    outputs: list[list[int]] = [[] for _ in prompts]
    steps: list[list[StepStats]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            b = int(out.request_id)
            outputs[b], steps[b] = out.output_ids, out.steps
    engine.flush_costs()
    return outputs, steps

