"""Structured output (issue 41): constraints decoded inside the tree, losslessly.

The reference is independent of castspec's engine: HF `generate(do_sample=False)` with a logits processor that
applies the same llguidance mask at every position. Every method and drafter must produce exactly its tokens, on
real SmolLM2-135M in fp32, for nested schemas, a regex, a choice and a tool call; rows with different constraints
(and none) batched together; sampling under a constraint distributed as plain constrained sampling (chi-square).
Then the pure parts (grammar errors, tool-call schemas, which grammar a request asks for) and the live server
with the real `openai` client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from synthetic import flat_costs
from test_prefix_cache import engines
from test_sampling import ALPHA, chi_square_p_value
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from castspec import Engine
from castspec.decode.constraints import Grammar, GrammarError, grammar_from_response_format, tool_call_schema
from castspec.decode.engine import RequestParams, StopCondition, decode
from castspec.decode.sampling import SamplingParams, warp
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.ngram import NgramDrafter
from castspec.policies.base import Eagle2Policy
from castspec.serve import protocol as P
from castspec.serve.tools import request_grammar, streamable_prefix, tagged_calls

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "job": {"enum": ["nurse", "teacher", "engineer", "farmer"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    "score": {"type": "number", "minimum": -1, "maximum": 1}},
    "required": ["name", "age", "job", "address", "skills", "score"], "additionalProperties": False}
WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"], "additionalProperties": False}}},
]
CASES = {
    "person": (Grammar("json_schema", PERSON),
               "Maria Lopez is a 34 year old nurse from Valencia (46001). She speaks Spanish and knits. JSON:"),
    "regex": (Grammar("regex", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]( [A-Z][a-z]+)?"),
              "The treaty was signed on the fourth of July 1998 in Paris. Date:"),
    "choice": (Grammar("choice", ["positive", "negative", "neutral", "mixed feelings"]),
               "Review: the food was cold but the staff were lovely. Sentiment:"),
    "tool": (Grammar("json_schema", tool_call_schema(WEATHER_TOOLS)),
             "What is the weather in Oslo, in celsius? Call a tool:"),
}
MAX_NEW = 80


class GrammarMask(LogitsProcessor):
    """The reference: HF generate's scores masked by a fresh llguidance matcher that follows the sequence."""

    def __init__(self, constraint, prompt_length: int) -> None:
        self.constraint, self.prompt_length = constraint, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_length:
            self.constraint.advance(int(input_ids[0, -1]))
        return self.constraint.mask(scores[0])[None]


@pytest.fixture(scope="module")
def constrained_reference(smollm):
    model, tokenizer = smollm
    base = Engine(model, tokenizer)
    eos = model.generation_config.eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                              pad_token_id=eos if isinstance(eos, int) else eos[0])
    references = {}
    for name, (grammar, prompt) in CASES.items():
        ids = base.encode(prompt=prompt)
        mask = GrammarMask(base.grammars.constraint(grammar), len(ids))
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 generation_config=config, logits_processor=LogitsProcessorList([mask]))
        references[name] = (ids, out[0, len(ids):].tolist())
    return references


def test_the_reference_answers_are_valid(smollm, constrained_reference):
    _, tokenizer = smollm
    for name, (grammar, _) in CASES.items():
        text = tokenizer.decode(constrained_reference[name][1], skip_special_tokens=True)
        if grammar.kind == "json_schema":
            jsonschema.validate(json.loads(text), grammar.source)
        elif grammar.kind == "choice":
            assert text in grammar.source


@pytest.mark.parametrize("method", ["ar", "chain-draft", "eagle2-ngram", "cast-ngram", "cast-draft", "cast-suffix",
                                    "eagle2-head"])
def test_constrained_greedy_equals_hf_with_the_same_mask(smollm, random_head, constrained_reference, method):
    model, tokenizer = smollm
    engine = dict(engines(model, tokenizer, random_head))[method]
    for name, (grammar, _) in CASES.items():
        ids, expected = constrained_reference[name]
        got = engine.generate(prompt_ids=ids, max_new_tokens=MAX_NEW, response_format=grammar)
        assert got.output_ids == expected, (method, name, got.text)


def test_rows_with_different_constraints_and_none_batched_decode_as_alone(smollm, smollm_reference,
                                                                          constrained_reference):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy(3, 3, 8))
    names = list(CASES)
    plain_ids = engine.encode(prompt="def fibonacci(n):")
    prompts = [constrained_reference[n][0] for n in names] + [plain_ids]
    constraints = [engine.grammars.constraint(CASES[n][0]) for n in names] + [None]
    stops = [StopCondition(MAX_NEW, engine.eos_ids, [], tokenizer) for _ in prompts]
    outputs, steps = decode(engine.target, engine.drafter, engine.policy, prompts, stops, constraints=constraints)
    for name, out in zip(names, outputs, strict=False):
        assert out == constrained_reference[name][1], name
    assert outputs[-1] == smollm_reference(tuple(plain_ids), MAX_NEW)
    assert any(s.tree_size > 0 for row in steps for s in row)  # speculation ran


def test_forced_tokens_are_drafted_as_certain_and_accepted(smollm, constrained_reference):
    """Where the grammar allows one token only, it is drafted with score 1 even by a drafter with nothing to
    offer, so a forced run is verified in the same step."""
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, NgramDrafter(), Eagle2Policy(4, 6, 16))
    schema = {"type": "object", "properties": {"first_long_property_name": {"type": "boolean"},
                                               "second_long_property_name": {"type": "boolean"}},
              "required": ["first_long_property_name", "second_long_property_name"], "additionalProperties": False}
    ids = engine.encode(prompt="Two flags as JSON:")
    got = engine.generate(prompt_ids=ids, max_new_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "flags", "schema": schema}})
    assert set(json.loads(got.text)) == set(schema["properties"])
    assert max(s.accepted for s in got.steps) >= 4  # the forced key names went through in a step or few


SAMPLED = Grammar("choice", ["red apple", "green pear", "blue plum", "red cherry", "yellow lemon", "green apple"])


def constrained_joint(model, engine, prompt: list[int], length: int, params: SamplingParams) -> dict[tuple, float]:
    """The exact distribution of the first `length` tokens of plain constrained sampling, by enumeration (a
    choice grammar allows a handful of tokens at each position)."""
    joint = {(): 1.0}
    constraint = engine.grammars.constraint(SAMPLED)
    for _ in range(length):
        grown = {}
        for prefix, prob in joint.items():
            taken = constraint.enter(list(prefix))
            assert taken == len(prefix)
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            p = warp(constraint.mask(logits), params)
            constraint.leave(taken)
            for token in p.nonzero().flatten().tolist():
                grown[prefix + (token,)] = prob * float(p[token])
        joint = grown
    return joint


@pytest.mark.parametrize("drafter", ["draft-sampled", "ngram"])
def test_constrained_sampling_is_distributed_as_plain_constrained_sampling(smollm, drafter):
    model, tokenizer = smollm
    params = SamplingParams(temperature=1.3)
    if drafter == "ngram":
        engine = Engine(model, tokenizer, NgramDrafter(), Eagle2Policy(3, 3, 8))
    else:
        engine = Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy(3, 3, 8))
    prompt = engine.encode(prompt="Name a fruit with its colour, red apple or green pear or blue plum:")
    length, draws = 2, 300
    exact = constrained_joint(model, engine, prompt, length, params)
    samples, drafted = [], 0
    for seed in range(draws):
        generator = torch.Generator().manual_seed(seed)
        if drafter == "draft-sampled":
            engine.drafter.sample_candidates(params, generator)
        stop = StopCondition(length + 2, engine.eos_ids, [], tokenizer)
        outputs, steps = decode(engine.target, engine.drafter, engine.policy, [prompt], [stop], params, [generator],
                                [engine.grammars.constraint(SAMPLED)])
        samples.append(tuple(outputs[0][:length]))
        drafted += sum(s.tree_size for s in steps[0])
    assert drafted > 0
    assert chi_square_p_value(samples, exact) > ALPHA


def test_forbidden_draws_stay_in_the_proposal_and_out_of_the_tree(smollm):
    """Sampled drafting under a grammar: the tree holds allowed tokens only, but verification's proposal keeps
    every token drawn, forbidden ones included (dropping them biases the emitted token; next test)."""
    from castspec.decode.drafting import grow_trees
    from castspec.policies.base import StepContext

    model, tokenizer = smollm
    engine = Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy(8, 2, 16))
    prompt = engine.encode(prompt="Name a fruit with its colour:")
    params = SamplingParams(temperature=1.5)
    engine.drafter.sample_candidates(params, torch.Generator().manual_seed(0))
    engine.drafter.reset(1)
    constraint = engine.grammars.constraint(SAMPLED)
    trees, _ = grow_trees(engine.drafter, engine.policy, [prompt], StepContext(1, len(prompt), 8, len(prompt)),
                          constraints=[constraint])
    allowed = constraint.allowed()
    drawn = trees[0].proposals[0].tokens
    assert all(allowed[t] for t in trees[0].tokens[trees[0].parents == 0].tolist())
    assert any(not allowed[t] for t in drawn) and len(drawn) == 8


@pytest.mark.parametrize("keep_forbidden", [True, False])
def test_recursive_rejection_under_a_mask_needs_every_draw(keep_forbidden):
    from test_sampling import V, draw_without_replacement, synthetic_pq

    from castspec.decode.tree import Proposal
    from castspec.decode.verify import emit_from_proposal

    p, q = synthetic_pq(0)
    allowed = torch.arange(V) % 2 == 0
    p = torch.where(allowed, p, 0.0)
    p = p / p.sum()
    generator, emitted = torch.Generator().manual_seed(0), []
    for _ in range(20000):
        drawn = draw_without_replacement(q, 3, generator)
        drawn = drawn if keep_forbidden else [t for t in drawn if allowed[t]]
        emitted.append((emit_from_proposal(p, Proposal(drawn, q), generator),))
    p_value = chi_square_p_value(emitted, {(t,): float(p[t]) for t in range(V) if p[t] > 0})
    assert p_value > ALPHA if keep_forbidden else p_value < 1e-8


@pytest.mark.parametrize("method", ["ar", "cast-draft", "eagle2-ngram", "eagle2-head"])
def test_logprobs_are_the_targets_own_with_and_without_speculation(smollm, random_head, method):
    """Each output token's logprob and top tokens are the target's at that position (a full forward over prompt
    + output), whether the token came from a tree or alone; under a grammar too (raw, unmasked, as vLLM's)."""

    model, tokenizer = smollm
    engine = dict(engines(model, tokenizer, random_head))[method]
    prompt = engine.encode(prompt=CASES["person"][1])
    stepper = engine.stepper(max_batch_size=2)
    params = RequestParams(max_tokens=24, logprobs=3, grammar=CASES["person"][0])
    stepper.add_request("json", prompt, params)
    stepper.add_request("plain", prompt, RequestParams(max_tokens=16, logprobs=0))
    got: dict[str, list] = {"json": [], "plain": []}
    outputs: dict[str, list[int]] = {}
    for _ in range(200):
        if not stepper.has_unfinished():
            break
        for out in stepper.step():
            got[out.request_id] += out.new_logprobs
            outputs[out.request_id] = out.output_ids
    for request_id, top in (("json", 3), ("plain", 0)):
        output = outputs[request_id]
        assert [i.token for i in got[request_id]] == output
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1]
        reference = torch.log_softmax(logits.float(), -1)
        for j, item in enumerate(got[request_id]):
            assert abs(item.logprob - float(reference[j, item.token])) < 1e-3, (method, request_id, j)
            assert len(item.top) == top
            if top:
                assert [t for t, _ in item.top] == reference[j].topk(top).indices.tolist()


# --- the pure parts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grammar,param,message", [
    (Grammar("regex", "[a-", "--regex"), "--regex", "unclosed character class"),
    (Grammar("json_schema", "{not json"), "response_format", "not valid JSON"),
    (Grammar("json_schema", {"type": "object", "properties": {"a": {"type": "nonsense"}}}), "response_format",
     "nonsense"),
    (Grammar("choice", []), "response_format", "non-empty list"),
])
def test_bad_grammars_are_one_line_errors_naming_the_field(grammar, param, message):
    with pytest.raises(GrammarError) as e:
        grammar.checked_text()
    assert e.value.param == param and message in str(e.value) and "\n" not in str(e.value)


def test_response_formats_and_tool_choices_become_grammars():
    assert grammar_from_response_format({"type": "text"}) is None
    assert grammar_from_response_format({"type": "json_object"}).kind == "json_object"
    schema = {"type": "object"}
    got = grammar_from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                               "strict": True}})
    assert (got.kind, got.source) == ("json_schema", schema)
    with pytest.raises(GrammarError, match="not one of"):
        grammar_from_response_format({"type": "yaml"})
    body = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=WEATHER_TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    grammar, mode = request_grammar(body)
    assert mode.forced and grammar.source["items"]["properties"]["name"] == {"const": "get_time"}
    assert request_grammar(body.model_copy(update={"tool_choice": "auto"}))[1].auto
    with pytest.raises(GrammarError, match="not in tools"):
        request_grammar(body.model_copy(update={"tool_choice": P.NamedToolChoice(
            type="function", function={"name": "nope"})}))
    with pytest.raises(GrammarError) as e:
        request_grammar(body.model_copy(update={"tool_choice": "required", "response_format": {"type": "json_object"}}))
    assert e.value.param == "tool_choice"
    vllm = P.CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[0-9]+"})
    assert request_grammar(vllm)[0].kind == "regex"
    with pytest.raises(GrammarError, match="no option"):
        request_grammar(vllm.model_copy(update={"structured_outputs": {"ebnf": "x"}}))


def test_auto_tool_calls_are_read_from_the_template_tags_and_never_streamed_as_text():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tagged_calls(text, "chatcmpl-abc", {"get_weather"})
    assert content == "Let me check." and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    assert tagged_calls(text, "chatcmpl-abc", {"other"}) == (text, [])  # not a tool it has
    assert streamable_prefix("Let me check.\n<tool_") == "Let me check.\n"
    assert streamable_prefix(text) == "Let me check.\n"
    assert streamable_prefix("plain <b>") == "plain <b>"


def test_a_field_castspec_does_not_serve_is_refused_by_name():
    body = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], logit_bias={"1": 5})
    assert body.unsupported()[0] == "logit_bias"
    assert P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                   user="someone").unsupported() is None


# --- the live server -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def structured_server(tmp_path_factory):
    from test_serve import live_server

    table = tmp_path_factory.mktemp("costs") / "flat.json"
    flat_costs().save(table)
    args = ["--drafter", "ngram", "--method", "cast", "--force-table", "--cast-mode", "paper", "--cost-model",
            "fixed", "--cost-table", str(table), "--max-batch-size", "4"]
    with live_server(*args, log_path=tmp_path_factory.mktemp("logs") / "structured.log") as base:
        yield base


def test_live_server_json_schema_tool_calls_streaming_and_errors(structured_server, smollm):
    from test_serve import MODEL, client, extra

    model, tokenizer = smollm
    c = client(structured_server)
    messages = [{"role": "user", "content": CASES["person"][1]}]
    response = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=0,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "person", "schema": PERSON, "strict": True}})
    answer = response.choices[0].message.content
    jsonschema.validate(json.loads(answer), PERSON)
    # the same tokens as the offline engine's constrained AR
    offline = Engine(model, tokenizer)
    ids = offline.encode(messages=messages)
    assert extra(response.choices[0], "token_ids") == offline.generate(
        prompt_ids=ids, max_new_tokens=120, response_format=Grammar("json_schema", PERSON)).output_ids

    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    called = c.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER_TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=0)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name in {"get_weather", "get_time"}
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, next(t["function"]["parameters"] for t in WEATHER_TOOLS
                                        if t["function"]["name"] == call.function.name))
    streamed, reasons = {}, []
    for ev in c.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER_TOOLS, max_tokens=80, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        stream=True):
        for ch in ev.choices:
            reasons.append(ch.finish_reason)
            for delta_call in ch.delta.tool_calls or []:
                streamed.setdefault(delta_call.index, delta_call)
    assert reasons[-1] == "tool_calls" and streamed[0].function.name == "get_weather"
    assert set(json.loads(streamed[0].function.arguments)) == {"city", "unit"}

    with_logprobs = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=2, response_format={"type": "json_object"})
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == len(extra(with_logprobs.choices[0], "token_ids"))
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)
    streamed_logprobs = []
    for ev in c.completions.create(model=MODEL, prompt=CASES["choice"][1], max_tokens=8, temperature=0, logprobs=1,
                                   stream=True):
        for ch in ev.choices:
            streamed_logprobs += (ch.logprobs.token_logprobs if ch.logprobs else [])
    plain = c.completions.create(model=MODEL, prompt=CASES["choice"][1], max_tokens=8, temperature=0, logprobs=1)
    assert streamed_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)

    regex = c.completions.create(model=MODEL, prompt=CASES["regex"][1], max_tokens=20, temperature=0,
                                 extra_body={"structured_outputs": {"regex": CASES["regex"][0].source}})
    assert regex.choices[0].text[:4].isdigit()

    for bad, param in [({"response_format": {"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
                         "response_format"),
                       ({"extra_body": {"logit_bias": {"1": 3}}}, "logit_bias"),
                       ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs"),
                       ({"tool_choice": "required"}, "tool_choice"),
                       ({"top_logprobs": 3}, "top_logprobs"),
                       ({"logprobs": True, "top_logprobs": 50}, "top_logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, **bad)
        assert e.value.body["param"] == param, bad
    again = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")
