"""Combining benchmark runs: each method over its own run's AR, on the prompts every run finished. No model."""

from __future__ import annotations

import json

import pytest

from castspec.bench.runner import combine_runs, wide_table
from castspec.cli import main
from castspec.errors import CastspecError


def _row(prompt: str, task: str, method: str, tokens_per_s: float) -> dict:
    return {"prompt_id": prompt, "task": task, "method": method, "new_tokens": 11, "wall_s": 11 / tokens_per_s,
            "tokens_per_s": tokens_per_s, "output_ids": [1] * 11, "steps": 5, "mean_accepted": 2.0,
            "mean_tree_size": 3.0, "mean_depth": 2.0}


def _run(rates: dict[str, dict[str, float]], tasks: dict[str, str], max_new_tokens: int = 128) -> dict:
    rows = [_row(p, tasks[p], method, rate) for p, per_method in rates.items() for method, rate in per_method.items()]
    return {"meta": {"max_new_tokens": max_new_tokens, "prompts": len(rates),
                     "settings": {"model": "m", "dtype": "bf16", "max_new_tokens": max_new_tokens}}, "rows": rows}


TASKS = {"a1": "alpha", "a2": "alpha", "b1": "beta"}


def test_each_method_is_divided_by_its_own_runs_ar_on_the_common_prompts():
    # run 1 is a slow sitting (AR 1.0), run 2 a fast one (AR 2.0): each method's ratio must use its own AR
    first = _run({"a1": {"ar": 1.0, "x": 1.5}, "a2": {"ar": 1.0, "x": 0.5}, "b1": {"ar": 1.0, "x": 1.2}}, TASKS)
    second = _run({"a1": {"ar": 2.0, "y": 4.0}, "b1": {"ar": 2.0, "y": 1.0}}, TASKS)  # a2 not finished here
    combined = combine_runs([first, second], ["one", "two"])
    cell = {(r["method"], r["task"]): r for r in combined["summary"]}
    assert combined["meta"]["prompts"] == 2  # a2 dropped: run two never finished it
    assert cell[("x", "all")]["speedup"] == pytest.approx((1.5 + 1.2) / 2)
    assert cell[("y", "all")]["speedup"] == pytest.approx((4.0 + 1.0) / 2 / 2.0)
    assert cell[("y", "alpha")]["speedup"] == pytest.approx(2.0)
    assert [r["method"] for r in combined["summary"] if r["task"] == "all"] == ["ar", "x", "y"]
    assert combined["meta"]["ar_tokens_per_s"] == {"one": 1.0, "two": 2.0}
    table = wide_table(combined["summary"])
    assert "| `y` | 1.25x | 2.00 | 3.00 | 2.00 | 2.00x | 0.50x |" in table


def test_a_method_in_two_runs_keeps_both_rows_named_by_run():
    first = _run({"a1": {"ar": 1.0, "x": 2.0}}, TASKS)
    second = _run({"a1": {"ar": 1.0, "x": 3.0}}, TASKS)
    methods = [r["method"] for r in combine_runs([first, second], ["one", "two"])["summary"] if r["task"] == "all"]
    assert methods == ["ar", "x", "x (two)"]


@pytest.mark.parametrize("second, message", [
    (_run({"a1": {"ar": 1.0, "y": 1.0}}, TASKS, max_new_tokens=64), "differ in max_new_tokens"),
    (_run({"b1": {"ar": 1.0, "y": 1.0}}, {"b1": "beta"}), "share no prompt"),
    (_run({"a1": {"y": 1.0}}, TASKS), "no 'ar' rows"),
])
def test_runs_that_do_not_compare_are_refused(second, message):
    first = _run({"a1": {"ar": 1.0, "x": 1.0}}, TASKS)
    with pytest.raises(CastspecError, match=message):
        combine_runs([first, second], ["one", "two"])


def test_cli_writes_the_report_and_refuses_a_file_that_is_not_a_run(tmp_path, capsys):
    paths = []
    for name, rate in (("one", 1.5), ("two", 0.5)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(_run({"a1": {"ar": 1.0, name: rate}}, TASKS)))
    assert main(["bench-combine", *map(str, paths), "--out-dir", str(tmp_path), "--name", "both"]) == 0
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"both.{suffix}").stat().st_size > 0
    assert "| `two` | 0.50x |" in (tmp_path / "both.md").read_text()
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["bench-combine", str(paths[0]), str(tmp_path / "bad.json"), "--name", "x"]) == 2
    assert "not a finished benchmark run" in capsys.readouterr().err
