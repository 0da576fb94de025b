"""castspec generate and castspec explain: decode prompts with one engine; draw one step's tree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from castspec.cli.options import engine_args, load_engine, policy_args, sampling_args, sampling_params, trace_path
from castspec.decode.constraints import Grammar, GrammarError
from castspec.errors import CastspecError


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate text with AR or speculative decoding")
    engine_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompts-file", help='JSONL: {"id": ..., "prompt": ...} or {"id": ..., "messages": [...]}')
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (one target forward "
                                                               "per step for all of them)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE", help="structured output: every answer is JSON valid "
                                                                 "under this JSON schema (a file)")
    structured.add_argument("--json-object", action="store_true", help="structured output: any JSON object")
    structured.add_argument("--regex", help="structured output: every answer matches this regular expression")
    structured.add_argument("--choice", action="append", help="structured output: every answer is one of these "
                                                             "strings (repeatable)")
    policy_args(gen)
    sampling_args(gen)

    gen.set_defaults(run=run_generate)

    explain = sub.add_parser("explain", help="draw one step's draft tree and the decisions behind it, and the tree "
                                             "size, depth and tau over the generation")
    engine_args(explain)
    explain.add_argument("--prompt", required=True)
    explain.add_argument("--chat", action="store_true", help="wrap --prompt as a user message")
    explain.add_argument("--max-new-tokens", type=int, default=48)
    explain.add_argument("--step", type=int, help="the step to draw (default: the one with the largest tree)")
    explain.add_argument("--out", required=True, help="the step's picture (PNG)")
    explain.add_argument("--generation-out", help="also the whole generation's tree sizes, depths and tau (PNG)")
    policy_args(explain)
    explain.set_defaults(run=run_explain)


def run_generate(args) -> None:
    from castspec.bench.prompts import read_prompts_file

    if args.max_new_tokens <= 0:
        raise CastspecError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.prompt is not None and not args.prompt.strip():
        raise CastspecError("the prompt is empty")
    sampling = sampling_params(args)  # bad values fail here, before the slow model load
    if args.batch_size < 1:
        raise CastspecError(f"--batch-size must be positive, got {args.batch_size}")
    rows = read_prompts_file(args.prompts_file) if args.prompts_file else [{"id": 0, "prompt": args.prompt}]
    grammar = structured_output(args)  # a bad grammar fails here, before the slow model load
    trace_file = trace_path(args.trace)
    engine = load_engine(args)
    print(f"castspec: {engine.choice}", file=sys.stderr, flush=True)
    trace = open(trace_file, "w") if trace_file else None  # noqa: SIM115 - closed below, written per step
    for first in range(0, len(rows), args.batch_size):
        batch = rows[first: first + args.batch_size]
        prompts = [row["messages"] if "messages" in row else
                   [{"role": "user", "content": row["prompt"]}] if args.chat else row["prompt"] for row in batch]
        generations = engine.generate_batch(prompts, max_new_tokens=args.max_new_tokens, stop=args.stop,
                                            temperature=sampling.temperature, top_p=sampling.top_p,
                                            top_k=sampling.top_k, seed=sampling.seed,
                                            draft_sampling=args.draft_sampling, response_format=grammar)
        for row, g in zip(batch, generations, strict=True):
            if trace is not None:
                for number, step in enumerate(g.steps):
                    trace.write(json.dumps({"id": row["id"], "step": number, "batch_size": len(batch),
                                            "accepted": step.accepted, "tree_size": step.tree_size,
                                            "context": step.context_length, "layer_sizes": step.draft.layer_sizes,
                                            "widths": step.draft.widths, "verify_budget": step.draft.verify_budget,
                                            "draft_s": step.draft_s, "verify_s": step.verify_s,
                                            "policy": step.draft.decisions}) + "\n")
                trace.flush()
            if args.json:
                print(json.dumps({"id": row["id"], **g.to_json()}), flush=True)
            else:
                print(g.text, flush=True)
                print(f"[{len(g.output_ids)} tokens in {g.wall_s:.2f} s (batch of {len(batch)}), "
                      f"{len(g.steps)} steps, mean accepted {g.mean_accepted:.2f}, stop: {g.stop_reason}]",
                      file=sys.stderr, flush=True)
    if trace is not None:
        trace.close()


def structured_output(args) -> Grammar | None:
    """The grammar `castspec generate` was asked to decode under, checked (one-line errors)."""
    if args.json_schema:
        path = Path(args.json_schema)
        if not path.is_file():
            raise CastspecError(f"--json-schema: no such file {path}")
        try:
            schema = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CastspecError(f"--json-schema: {path} is not JSON ({e})") from None
        grammar = Grammar("json_schema", schema, "--json-schema")
    elif args.json_object:
        grammar = Grammar("json_object", None, "--json-object")
    elif args.regex is not None:
        grammar = Grammar("regex", args.regex, "--regex")
    elif args.choice:
        grammar = Grammar("choice", args.choice, "--choice")
    else:
        return None
    try:
        grammar.checked_text()
    except GrammarError as e:
        raise CastspecError(f"{e.param}: {e}") from None
    return grammar


def run_explain(args) -> None:
    from castspec.bench.explain import draw_generation, draw_step, generate_explained, pick_step

    if not args.prompt.strip():
        raise CastspecError("the prompt is empty")
    if args.max_new_tokens < 2:
        raise CastspecError(f"--max-new-tokens must be at least 2 (a step after the first token), got "
                            f"{args.max_new_tokens}")
    engine = load_engine(args)
    print(f"castspec: {engine.choice}", file=sys.stderr, flush=True)
    chat = [{"role": "user", "content": args.prompt}] if args.chat else None
    generation, steps = generate_explained(engine, None if chat else args.prompt, chat, args.max_new_tokens)
    number = pick_step(steps, args.step)
    who = f"{Path(args.model).name}, {engine.policy.name} over {engine.drafter.name}" + (
        f", costs from {Path(args.cost_table).name}" if args.cost_table else "")
    draw_step(steps[number], engine.tokenizer, args.out, f"step {number} of {len(steps)}: {who}")
    print(args.out)
    if args.generation_out:
        draw_generation(steps, args.generation_out, f"{len(generation.output_ids)} tokens in {len(steps)} steps, "
                                                    f"tau {generation.mean_accepted:.2f}\n{who}")
        print(args.generation_out)
