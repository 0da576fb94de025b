"""The benchmark index: generated from the runs' JSON, current in the repo, and loud about a stale mark."""

import json
from pathlib import Path

import pytest

from castspec.bench.index import SUPERSEDED, collect, render, write_index

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_the_committed_index_is_what_the_generator_writes():
    assert (BENCH / "README.md").read_text() == render(collect(BENCH), BENCH), \
        "bench/README.md is stale: run `castspec bench-index`"


def test_a_study_lists_its_runs_newest_first_with_the_best_method_and_marks(tmp_path):
    study = tmp_path / "headline"
    study.mkdir()
    rows = [{"task": "all", "method": m, "speedup": s, "tau": t} for m, s, t in
            (("ar", 1.0, 1.0), ("cast:ngram", 1.9, 1.6), ("hf-prompt-lookup", 2.0, 1.7))]
    for name, date in (("old", "2026-01-01 10:00"), ("new", "2026-02-01 10:00")):
        meta = {"date": date, "machine": "test cpu", "command": f"castspec bench --name {name}"}
        (study / f"{name}.json").write_text(json.dumps({"meta": meta, "summary": rows}))
        (study / f"{name}.png").write_bytes(b"")
    (tmp_path / SUPERSEDED).write_text(json.dumps({"headline/old": "see headline/new"}))
    text = write_index(tmp_path).read_text()
    assert text.index("**new**") < text.index("**old**")
    assert "best cast:ngram: 1.90x over AR, tau 1.60; best peer hf-prompt-lookup: 2.00x" in text
    assert "[png](headline/new.png)" in text and "*superseded: see headline/new*" in text
    assert "`castspec bench --name new`" in text
    (tmp_path / SUPERSEDED).write_text(json.dumps({"headline/gone": "x"}))
    with pytest.raises(ValueError, match="headline/gone"):
        collect(tmp_path)
