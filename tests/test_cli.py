"""Bad input through the CLI: one clear line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from castspec.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it: its own process, through the installed entry point's module."""
    return subprocess.run([sys.executable, "-m", "castspec.cli", *args], capture_output=True, text=True, timeout=300)


def in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """The same command through main() in this process: no interpreter start and imports per call (seconds
    each), where the test is about what the command does rather than about the process around it."""
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, captured.out, captured.err)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens must be positive"),
        (["--prompt", "hi", "--method", "beam"], "unknown method 'beam'"),
        (["--prompt", "hi", "--drafter", "magic"], "unknown drafter 'magic'"),
        (["--prompt", "hi", "--method", "chain", "--with-ngram"], "give --draft or --head too"),
        (["--prompt", "hi", "--drafter", "ngram", "--dtype", "int3"], "unknown dtype"),
        (["--prompts-file", "/nonexistent.jsonl"], "does not exist"),
    ],
)
def test_bad_generate_input(capsys, args, message):
    code = main(["generate", "--model", "smollm2-135m", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_profile_refuses_zero_passes_before_loading_anything(capsys):
    code = main(["profile", "--model", "./no/such/model", "--out", "/tmp/never.json", "--repeats", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--repeats must be at least 1" in err and "Traceback" not in err


def test_missing_model_directory(capsys):
    assert main(["generate", "--model", "./no/such/model", "--method", "ar", "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_prompt_longer_than_the_context_says_the_limit(capsys):
    code = main(["generate", "--model", "smollm2-135m", "--method", "ar", "--prompt", "word " * 9000])
    err = capsys.readouterr().err
    assert code == 2 and "context holds 8192" in err


def test_bad_prompts_file_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "prompt": "ok"}\n{"id": 2}\n')
    assert main(["generate", "--model", "smollm2-135m", "--method", "ar", "--prompts-file", str(f)]) == 2
    assert "p.jsonl:2" in capsys.readouterr().err


def test_json_output_from_a_prompts_file(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"id": "a", "prompt": "1, 2, 3, 4,"}, {"id": "b", "messages": [{"role": "user", "content": "Hi"}]}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    proc = run("generate", "--model", "smollm2-135m", "--drafter", "ngram", "--method", "eagle2",
               "--prompts-file", str(f), "--max-new-tokens", "8", "--dtype", "fp32", "--json")
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [o["id"] for o in out] == ["a", "b"]
    for o in out:
        assert {"output_ids", "text", "steps", "accept_lengths", "wall_s"} <= set(o)
        assert 1 <= len(o["output_ids"]) <= 8 and sum(o["accept_lengths"]) + 1 >= len(o["output_ids"])


def test_uncaught_subprocess_error_is_one_line():
    proc = run("generate", "--model", "smollm2-135m", "--method", "ar", "--prompt", "hi", "--max-new-tokens", "-3")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("castspec: error:")
    assert "Traceback" not in proc.stderr


def test_cast_uses_a_cost_table_and_writes_a_decision_trace(tmp_path, capsys):
    from synthetic import flat_costs

    table, trace = tmp_path / "t.json", tmp_path / "trace.jsonl"
    flat_costs().save(table)
    args = ["generate", "--model", "smollm2-135m", "--drafter", "ngram", "--method", "cast", "--cost-table",
            str(table), "--prompt", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1,", "--max-new-tokens", "12", "--dtype", "fp32"]
    refused = in_process(capsys, *args)
    assert refused.returncode == 2 and "measured on another setup" in refused.stderr
    proc = in_process(capsys, *args, "--force-table", "--cast-mode", "paper", "--cost-model", "fixed", "--trace",
                      str(trace), "--json")
    assert proc.returncode == 0, proc.stderr
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert steps and all({"layer_sizes", "widths", "verify_budget", "policy"} <= set(s) for s in steps)
    drafted = [s for s in steps if s["layer_sizes"]]
    assert drafted and all("layers" in s["policy"] and "verify_budget" in s["policy"] for s in drafted)


def test_cast_without_any_table_probes_online_or_says_how_to_make_one(tmp_path, monkeypatch, capsys):
    from castspec.models import converted_dir, fetch

    fetch("smollm2-135m")
    model_dir = str(converted_dir("smollm2-135m"))
    monkeypatch.setenv("CASTSPEC_HOME", str(tmp_path))  # no tables here
    cast = ["generate", "--model", model_dir, "--drafter", "ngram", "--method", "cast", "--prompt", "hi",
            "--max-new-tokens", "4", "--dtype", "fp32"]
    assert main([*cast, "--cost-model", "fixed"]) == 2
    assert "needs a cost table" in capsys.readouterr().err
    assert main(cast) == 0  # online, the default: a probe of a few forwards, then decoding
    assert "cost model: online, probed in" in capsys.readouterr().err
    assert list((tmp_path / "costs").glob("online-*.json"))


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails a test that loads a model: bad settings must be refused before the slow load."""
    import castspec.api
    import castspec.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(castspec.models, "load_model", refuse)
    monkeypatch.setattr(castspec.api, "load_model", refuse)


def test_bad_sampling_options_fail_before_loading_a_model(no_model_loads, capsys):
    for flag, value, word in [("--temperature", "-1", "temperature"), ("--sample-top-k", "-2", "top_k")]:
        assert main(["generate", "--model", "no-such-model", "--method", "ar", "--prompt", "hi", flag, value]) == 2
        err = capsys.readouterr().err
        assert word in err and len(err.strip().splitlines()) == 1


def test_batched_generate_equals_one_at_a_time(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": p}) for i, p in
                                 enumerate(["def add(a, b):", "Hi", "1, 2, 3, 1, 2, 3, 1,"])) + "\n")
    common = ["generate", "--model", "smollm2-135m", "--drafter", "ngram", "--method", "eagle2", "--prompts-file",
              str(prompts), "--max-new-tokens", "8", "--dtype", "fp32", "--json"]
    outputs = {}
    for size in ("1", "2"):
        proc = in_process(capsys, *common, "--batch-size", size)
        assert proc.returncode == 0, proc.stderr
        outputs[size] = [json.loads(line)["output_ids"] for line in proc.stdout.splitlines()]
    assert len(outputs["1"]) == 3 and outputs["1"] == outputs["2"]


def test_throughput_bench_writes_results(tmp_path, capsys):
    proc = in_process(capsys, "bench", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--dtype", "fp32",
                      "--per-set", "1", "--max-new-tokens", "4", "--batch-sizes", "1,2", "--methods",
                      "ar;eagle2:ngram:top_k=2,depth=2", "--out-dir", str(tmp_path), "--name", "tp")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "tp.json").read_text())
    assert {(r["batch_size"], r["method"]) for r in result["summary"]} == {
        (b, m) for b in (1, 2) for m in ("ar", "eagle2:ngram:top_k=2,depth=2")}
    assert all(r["same_as_ar"] == r["prompts"] == 3 for r in result["summary"])  # fp32: identical outputs
    assert (tmp_path / "tp.png").stat().st_size > 0 and "speed-up over batched AR" in (tmp_path / "tp.md").read_text()
    assert all(r["decode_speedup"] is not None for r in result["summary"])


def test_train_head_refuses_bad_settings_before_loading(no_model_loads, capsys):
    for flag, value, word in [("--epochs", "0", "--epochs must be positive"), ("--lr", "-1", "--lr must be")]:
        assert main(["train-head", "--target", "no-such-model", "--out", "nowhere", flag, value]) == 2
        err = capsys.readouterr().err
        assert word in err and len(err.strip().splitlines()) == 1


def test_generate_and_bench_with_an_eagle_head(tmp_path, capsys):
    import torch

    from castspec.drafters.eagle_head import EagleHead, head_config, save_eagle_head
    from castspec.models import load_model

    model, _ = load_model("smollm2-135m", "fp32")
    torch.manual_seed(0)
    save_eagle_head(EagleHead(head_config(model)), tmp_path / "head")
    common = ["--model", "smollm2-135m", "--dtype", "fp32", "--max-new-tokens", "6"]
    texts = []
    for extra in (["--method", "ar"], ["--method", "eagle2", "--head", str(tmp_path / "head"), "--top-k", "2"]):
        proc = in_process(capsys, "generate", *common, "--prompt", "def add(a, b):", "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        texts.append(json.loads(proc.stdout)["output_ids"])
    assert texts[0] == texts[1]
    bench = ["bench", *common, "--draft", "none", "--sets", "mtbench", "--per-set", "1", "--out-dir", str(tmp_path),
             "--name", "h"]
    proc = in_process(capsys, *bench, "--methods", "ar;chain:head:chain_length=2")
    assert proc.returncode == 2 and "--head" in proc.stderr and "Traceback" not in proc.stderr
    proc = in_process(capsys, *bench, "--head", str(tmp_path / "head"), "--methods", "ar;chain:head:chain_length=2")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert len(rows) == 2 and rows[0]["output_ids"] == rows[1]["output_ids"]
    proc = in_process(capsys, "profile", "--model", "smollm2-135m", "--dtype", "fp32", "--head", str(tmp_path / "head"),
                      "--batch-sizes", "1", "--contexts", "32", "--max-tokens", "2", "--repeats", "1",
                      "--out", str(tmp_path / "head-costs.json"))
    assert proc.returncode == 0, proc.stderr
    table = json.loads((tmp_path / "head-costs.json").read_text())
    assert table["meta"]["draft"]["drafter"] == "eagle-head:head" and table["draft"]["tokens"] == [1, 2]


def test_bench_resume_keeps_finished_prompts_and_runs_the_rest(tmp_path, capsys):
    common = ["bench", "--model", "smollm2-135m", "--draft", "none", "--dtype", "fp32", "--sets", "mtbench,gsm8k",
              "--per-set", "1", "--max-new-tokens", "4", "--methods", "ar;eagle2:ngram:top_k=2,depth=2",
              "--out-dir", str(tmp_path), "--name", "r"]
    assert main([*common, "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert main(common) == 0
    full = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert not (tmp_path / "r.partial.jsonl").exists() and not (tmp_path / "r.partial.settings.json").exists()
    # the state an interruption leaves: the first prompt finished, the second one half done, its last line cut
    first, second = full[0]["prompt_id"], full[2]["prompt_id"]
    kept = [{**r, "wall_s": 123.0} for r in full[:2]]  # marked: a re-run would not reproduce this time
    (tmp_path / "r.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept + full[2:3])
                                              + json.dumps(full[3])[:40])
    settings = json.loads((tmp_path / "r.json").read_text())["meta"]["settings"]
    assert settings["methods"] == "ar;eagle2:ngram:top_k=2,depth=2" and "threads" in settings["machine"]
    (tmp_path / "r.partial.settings.json").write_text(json.dumps({**settings, "max_new_tokens": 8}))
    assert main([*common, "--resume"]) == 2
    assert "max_new_tokens: was 8, now 4" in capsys.readouterr().err
    (tmp_path / "r.partial.settings.json").write_text(json.dumps({**settings, "machine": "Other CPU, 2 threads"}))
    assert main([*common, "--resume"]) == 2
    assert "machine: was 'Other CPU, 2 threads'" in capsys.readouterr().err
    (tmp_path / "r.partial.settings.json").write_text(json.dumps(settings))
    assert main([*common, "--resume"]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [(r["prompt_id"], r["method"]) for r in rows] == [(r["prompt_id"], r["method"]) for r in full]
    assert [r["wall_s"] for r in rows if r["prompt_id"] == first] == [123.0, 123.0]
    assert all(r["wall_s"] != 123.0 for r in rows if r["prompt_id"] == second)
    assert [r["output_ids"] for r in rows] == [r["output_ids"] for r in full]
    # a finished run grows: one more prompt per set, the measured ones kept
    assert main([*common, "--per-set", "2", "--resume"]) == 0
    grown = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert len(grown) == 8 and [r for r in grown if r["prompt_id"] in (first, second)] == rows


def test_bench_rounds_alternate_the_order_take_medians_and_grow_by_resume(tmp_path, capsys):
    common = ["bench", "--model", "smollm2-135m", "--draft", "none", "--dtype", "fp32", "--sets", "gsm8k",
              "--per-set", "1", "--max-new-tokens", "4", "--methods", "ar;eagle2:ngram:top_k=2,depth=2",
              "--out-dir", str(tmp_path), "--name", "k"]
    assert main([*common, "--rounds", "0"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
    assert main([*common, "--rounds", "2"]) == 0
    run = json.loads((tmp_path / "k.json").read_text())
    rows = run["rows"]
    # the second round runs the methods in reverse order
    assert [(r["round"], r["method"]) for r in rows] == [(0, "ar"), (0, "eagle2:ngram:top_k=2,depth=2"),
                                                         (1, "eagle2:ngram:top_k=2,depth=2"), (1, "ar")]
    assert run["meta"]["rounds"] == 2
    summary = {(s["task"], s["method"]): s for s in run["summary"]}
    for method in ("ar", "eagle2:ngram:top_k=2,depth=2"):
        mine = [r["tokens_per_s"] for r in rows if r["method"] == method]
        entry = summary["all", method]
        assert entry["prompts"] == 1 and entry["same_as_ar"] == 1
        assert entry["tokens_per_s"] == round((mine[0] + mine[1]) / 2, 3)  # the median of two
    # a finished run grows by a round; the measured rounds are kept as they were
    assert main([*common, "--rounds", "3", "--resume"]) == 0
    grown = json.loads((tmp_path / "k.json").read_text())["rows"]
    assert grown[:4] == rows and [(r["round"], r["method"]) for r in grown[4:]] == [
        (2, "ar"), (2, "eagle2:ngram:top_k=2,depth=2")]


def test_demo_probes_costs_once_then_goes_on_from_what_it_learned(tmp_path, monkeypatch, capsys):
    from castspec.models import converted_dir, fetch

    fetch("smollm2-135m")
    model_dir = str(converted_dir("smollm2-135m"))
    monkeypatch.setenv("CASTSPEC_HOME", str(tmp_path))  # no tables here: CAST must start from a probe
    demo = ["demo", "--model", model_dir, "--draft", model_dir, "--prompts", "1", "--max-new-tokens", "4"]
    assert main(demo) == 0
    captured = capsys.readouterr()
    assert "cost model: online, probed in" in captured.err and "`cast:draft`" in captured.out
    # CAST raced against the fixed trees over each drafter, with a line on what it chose
    assert "CAST over draft: " in captured.out and "CAST over ngram: " in captured.out
    assert re.search(r"CAST over draft: [\d.]+x AR, [\d.]+x the best fixed tree over the same drafter "
                     r"\((chain|eagle2):draft", captured.out)
    tables = list((tmp_path / "costs").glob("online-*.json"))  # one learned table per drafter
    assert len(tables) == 2
    assert all(json.loads(t.read_text())["online"]["target"]["observations"] > 5 for t in tables)
    assert main(demo) == 0  # the second demo goes on from the saved, learned table
    assert "going on from" in capsys.readouterr().err
    assert main(["demo", "--model", model_dir, "--draft", "none"]) == 2
    assert "give one with --draft" in capsys.readouterr().err


def test_training_data_from_several_sources(tmp_path, capsys):
    """--data A,B trains on both files' conversations (--conversations caps each, in the order named); the feature
    cache is named after both; a missing source or an empty one between commas is one clear line."""
    from castspec.cli.heads import _conversations, _data_name

    def write(name: str, count: int) -> str:
        file = tmp_path / f"{name}.jsonl"
        file.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{name} {i}"},
                                                         {"role": "assistant", "content": "ok"}]}) + "\n"
                                for i in range(count)))
        return str(file)

    both = f"{write('first', 3)},{write('second', 2)}"
    got = [turns[0]["content"] for turns in _conversations(both, 2)]
    assert got == ["first 0", "first 1", "second 0", "second 1"]
    assert _data_name(both) == "first+second"
    assert main(["train-head", "--target", "smollm2-135m", "--data", f"{both},", "--out", str(tmp_path / "h")]) == 2
    assert "empty source" in capsys.readouterr().err
    assert main(["train-head", "--target", "smollm2-135m", "--data", f"{both},{tmp_path / 'none.jsonl'}",
                 "--out", str(tmp_path / "h")]) == 2
    assert "does not exist" in capsys.readouterr().err



def test_generate_with_only_a_model_and_a_prompt_uses_cast_over_ngram_and_says_so(smollm, smollm_reference):
    from castspec.api import Engine

    prompt = "def fib(n):"
    proc = run("generate", "--model", "smollm2-135m", "--prompt", prompt, "--max-new-tokens", "24", "--dtype", "fp32",
               "--json")
    assert proc.returncode == 0, proc.stderr
    assert "castspec: method cast (the default; --method ar for plain decoding) over the n-gram drafter" in proc.stderr
    model, tokenizer = smollm
    ids = Engine(model, tokenizer).encode(prompt)
    assert json.loads(proc.stdout)["output_ids"] == smollm_reference(tuple(ids), 24)


def test_the_defaults_name_what_they_chose():
    from castspec.api import default_choice

    assert default_choice(None, None, None, None)[:2] == ("cast", "ngram")
    method, drafter, said = default_choice(None, "qwen2.5-coder-0.5b", None, None)
    assert (method, drafter) == ("cast", None) and "over draft model qwen2.5-coder-0.5b" in said
    assert "(the default" not in default_choice("cast", None, None, "./head")[2]
    assert default_choice("eagle2", None, None, None)[:2] == ("eagle2", "ngram")
    assert default_choice("ar", None, None, None) == ("ar", None, "method ar: plain autoregressive decoding")


def test_explain_draws_the_largest_step_and_the_generation(tmp_path, smollm, smollm_reference):
    from synthetic import flat_costs

    from castspec.api import Engine
    from castspec.bench.explain import generate_explained, pick_step

    table = tmp_path / "flat.json"
    flat_costs().save(table)
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1,"
    common = ["explain", "--model", "smollm2-135m", "--dtype", "fp32", "--cost-table", str(table), "--force-table",
              "--cost-model", "fixed", "--cast-mode", "paper", "--prompt", prompt, "--max-new-tokens", "16"]
    step, generation = tmp_path / "step.png", tmp_path / "generation.png"
    proc = run(*common, "--out", str(step), "--generation-out", str(generation))
    assert proc.returncode == 0, proc.stderr
    assert step.read_bytes()[:4] == b"\x89PNG" and generation.read_bytes()[:4] == b"\x89PNG"
    refused = run(*common, "--step", "99", "--out", str(step))
    assert refused.returncode == 2 and "is not a step of this generation" in refused.stderr
    model, tokenizer = smollm
    engine = Engine.load("smollm2-135m", dtype="fp32", cost_table=str(table), force_table=True, cost_model="fixed",
                         cast_auto=False)
    out, steps = generate_explained(engine, prompt, max_new_tokens=16)
    assert out.output_ids == smollm_reference(tuple(engine.encode(prompt)), 16)  # watching changes nothing
    largest = pick_step(steps, None)
    assert len(steps[largest].tree) == max(len(s.tree) for s in steps) > 1
    position = 1  # the prefill's token comes first; each step starts from the last token and adds its path
    for s in steps:
        assert int(s.tree.tokens[0]) == out.output_ids[position - 1]
        drafted = s.tree.tokens[s.path].tolist()[: len(out.output_ids) - position]
        assert out.output_ids[position: position + len(drafted)] == drafted
        position += s.stats.accepted


def test_a_trace_file_that_cannot_be_written_is_refused_before_loading(no_model_loads, capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for command in (["generate", "--prompt", "hi"], ["serve", "--port", "8000"]):
        assert main([command[0], "--model", "no-such-model", "--trace", str(blocker / "t.jsonl"), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert "--trace" in err and len(err.strip().splitlines()) == 1


def test_a_trace_files_missing_folders_are_made(tmp_path):
    from castspec.cli.options import trace_path

    path = tmp_path / "traces" / "run-1" / "server-trace.jsonl"
    assert trace_path(str(path)) == str(path) and path.parent.is_dir()
