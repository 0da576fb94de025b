"""Method items of `castspec bench`: parsing, the drafter/policy split of options, and clear refusals."""

import pytest

from castspec.api import MODEL_FREE_MAX_DEPTH
from castspec.bench.runner import drafter_options, parse_methods, policy_options
from castspec.errors import CastspecError


def test_items_parse_into_method_drafter_and_options():
    ar, chain, cast, lookup = parse_methods("ar; chain:draft:chain_length=3 ;cast:ngram:auto=0,cast_c1=2.5;"
                                            "hf-prompt-lookup;")
    assert (ar.method, ar.drafter, ar.options) == ("ar", None, {})
    assert (chain.method, chain.drafter, chain.options) == ("chain", "draft", {"chain_length": 3})
    assert cast.options == {"auto": 0, "cast_c1": 2.5} and cast.label == "cast:ngram:auto=0,cast_c1=2.5"
    assert lookup.method == "hf-prompt-lookup"


def test_ngram_sizes_go_to_the_drafter_and_the_rest_to_the_policy():
    (spec,) = parse_methods("eagle2:ngram:top_k=4,min_n=1,max_n=3")
    assert drafter_options(spec) == {"min_n": 1, "max_n": 3}
    assert policy_options(spec) == {"top_k": 4}
    (merged,) = parse_methods("cast:head+ngram:min_n=1,auto=0")
    assert merged.drafter == "head+ngram" and drafter_options(merged) == {"min_n": 1}
    (cast,) = parse_methods("cast:ngram:min_n=1,auto=0")
    assert policy_options(cast, costs="table") == {"cost_table": "table", "cast_auto": False, "cast_calibrate": True,
                                                   "cast_max_depth": MODEL_FREE_MAX_DEPTH}  # 24 deep over n-gram


@pytest.mark.parametrize(("text", "says"), [
    ("eagle3:ngram", "unknown method 'eagle3'"),
    ("eagle2:ngarm", "'ngarm' is not a drafter"),
    ("eagle2:ngram:draft", "or a second one"),
    ("chain:ngram:top_k=4", "'top_k' is not an option of chain with the ngram drafter"),
    ("chain:draft:min_n=1", "'min_n' is not an option of chain with the draft drafter"),
    ("eagle2:ngram:depth=five", "depth needs a number, got 'five'"),
    ("cast", "cast needs a drafter"),
    ("ar:chain_length=2", "(it has: none)"),
    ("chain:ngram:min_n=3,max_n=2", "1 <= min_n <= max_n, got min_n=3, max_n=2"),
    ("chain:ngram:min_n=0", "got min_n=0"),
    ("cast:head+ngram:min_n=0", "got min_n=0"),
    ("cast:ngram+head", "'ngram+head' is not a drafter"),
])
def test_bad_items_are_refused_with_the_reason(text, says):
    with pytest.raises(CastspecError) as error:
        parse_methods(text)
    assert says in str(error.value)


def test_server_options_are_for_bench_serve_only():
    spec = parse_methods("cast:suffix:prefix_cache_gb=0,prefill_chunk=64", server=True)[0]
    assert spec.options == {"prefix_cache_gb": 0, "prefill_chunk": 64}
    with pytest.raises(CastspecError, match="only castspec bench-serve takes them"):
        parse_methods("ar:prefix_cache_gb=0")


def test_suffix_items_take_a_depth_and_a_shared_tree_and_calibrate_by_default():
    from castspec.bench.runner import model_free_from_spec

    (spec,) = parse_methods("cast:suffix:depth=8,shared=5000,auto=0")
    assert drafter_options(spec) == {"depth": 8, "shared": 5000}
    options = policy_options(spec, costs="table")
    assert options["cast_calibrate"] is True and options["cast_max_depth"] == 24
    drafter = model_free_from_spec(spec)
    assert drafter.max_depth == 8 and drafter.shared.max_tokens == 5000 and drafter.share
    (off,) = parse_methods("cast:head+suffix:calibrate=0")
    assert policy_options(off, costs="t")["cast_calibrate"] is False and "cast_max_depth" not in policy_options(off)
    with pytest.raises(CastspecError, match="depth must be an integer"):
        parse_methods("chain:suffix:depth=0")
    # n-gram matches are counts too; a draft model's probabilities merged with them are not recalibrated
    ngram, merged, off = parse_methods("cast:ngram;cast:draft+ngram;cast:ngram:calibrate=0")
    assert policy_options(ngram, costs="t")["cast_calibrate"] is True
    assert policy_options(merged, costs="t")["cast_calibrate"] is False
    assert policy_options(off, costs="t")["cast_calibrate"] is False
    with pytest.raises(CastspecError, match="'min_n' is not an option"):
        parse_methods("chain:suffix:min_n=1")


def test_the_demo_reads_cast_and_fixed_trees_by_method_and_drafter_not_by_label_text():
    from castspec.cli.demo import cast_choices

    rows = [{"method": "cast:ngram:min_n=2", "speedup": 1.5, "drafted_share": 0.5, "mean_tree_size": 3.0,
             "mean_depth": 2.0},
            {"method": "eagle2:ngram:top_k=2,depth=3,total_tokens=6", "speedup": 1.2},
            {"method": "chain:draft+ngram:chain_length=4", "speedup": 2.0},
            {"method": "ar", "speedup": 1.0}]
    (line,) = cast_choices(rows)
    assert line.startswith("CAST over ngram: 1.50x AR, 1.25x the best fixed tree over the same drafter")
    assert "eagle2:ngram:top_k=2" in line and "draft+ngram" not in line
