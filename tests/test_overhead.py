"""The host-overhead measurement (castspec bench --overhead) and the batched tree bookkeeping it checks.

Random-weight models here are pure-logic fixtures (the measurement is about bookkeeping, not about what a model
says); lossless decoding of real weights is proven in test_exactness / test_batch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from castspec.bench.overhead import measure_method, random_models, random_prompts, run_overhead
from castspec.bench.runner import parse_methods
from castspec.decode.tree import DraftTree, TreePool, ancestor_masks

ROOT = Path(__file__).resolve().parent.parent


def _naive_ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        j = parents[i]
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def test_batched_ancestor_masks_equal_the_per_tree_walk():
    trees = [DraftTree.from_lists([5, 6, 7, 8, 9], [-1, 0, 0, 1, 3], [1.0] * 5),
             DraftTree.from_lists([1, 2], [-1, 0], [1.0, 1.0]),
             DraftTree.single(3)]
    masks = ancestor_masks(trees, 6)
    for b, tree in enumerate(trees):
        n = len(tree)
        assert torch.equal(masks[b, :n, :n], _naive_ancestor_mask(tree.parents.tolist()))
        assert torch.equal(masks[b, n:, :], torch.eye(6, dtype=torch.bool)[n:])  # padding sees only itself
        assert not masks[b, :n, n:].any()


@pytest.mark.parametrize("widest", [20, 62, 63, 90])  # the integer-bit walk up to 62 nodes, levels beyond
def test_ancestor_masks_of_random_trees_equal_the_per_tree_walk(widest):
    generator = torch.Generator().manual_seed(widest)
    sizes = [widest, 1, *torch.randint(1, widest + 1, (3,), generator=generator).tolist()]
    trees = []
    for n in sizes:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]
        trees.append(DraftTree.from_lists(list(range(n)), parents, [1.0] * n))
    masks = ancestor_masks(trees, widest)
    for b, tree in enumerate(trees):
        n = len(tree)
        assert torch.equal(masks[b, :n, :n], _naive_ancestor_mask(tree.parents.tolist()))
        assert torch.equal(masks[b, n:], torch.eye(widest, dtype=torch.bool)[n:])
        assert not masks[b, :n, n:].any()


def test_tree_pool_keeps_paths_and_depths_as_it_grows():
    pool = TreePool(4)
    first = pool.append([10, 11], [0, 0])
    second = pool.append([12, 13], [first[1], first[1]])
    assert pool.path_to(second[0]) == [2, 3] and pool.path_to(0) == []
    assert pool.depths == [0, 1, 1, 2, 2]
    tree = pool.tree([1.0, 0.5, 0.4, 0.2, 0.1])
    assert torch.equal(tree.ancestor_mask(), _naive_ancestor_mask(pool.parents))
    with pytest.raises(ValueError):
        pool.append([1], [9])


@pytest.fixture(scope="module")
def tiny():
    return random_models("tiny", seed=0)


def test_step_timer_accounts_for_every_step_and_forward(tiny):
    spec = parse_methods("eagle2:draft:top_k=2,depth=3,total_tokens=6")[0]
    prompts = random_prompts(tiny.target.config.vocab_size, 2, 24)
    outputs, steps = measure_method(tiny, spec, 2, prompts, 10)
    assert [len(o) for o in outputs] == [10, 10]
    assert steps and all(s["target_forwards"] == 1 for s in steps)  # one verify forward per step
    for s in steps:
        phases = sum(s.get(p, 0.0) for p in ("plan", "draft", "verify", "accept", "outputs", "policy", "commit"))
        assert phases <= s["wall_s"] + 1e-6
        assert s["target_forward_s"] <= s["verify"] + 1e-6  # the verify forward runs inside the verify phase
        assert s.get("drafter_forward_s", 0.0) + s.get("candidates_s", 0.0) <= s["draft"] + 1e-6
    # the hooks are gone once measured: the model runs without them
    assert not tiny.target._forward_hooks and not tiny.target._forward_pre_hooks


def test_a_compiled_target_s_forwards_are_timed_as_target_forwards_and_it_stays_compiled():
    from castspec.decode.compiled import compile_target, is_compiled

    models = random_models("tiny", seed=1)
    prompts = random_prompts(models.target.config.vocab_size, 2, 24)
    specs = parse_methods("ar;eagle2:draft:top_k=2,depth=3,total_tokens=6")
    eager_ar, _ = measure_method(models, specs[0], 2, prompts, 10)
    assert compile_target(models.target) is not None
    for spec in specs:
        outputs, steps = measure_method(models, spec, 2, prompts, 10)
        assert outputs == eager_ar  # the compiled path's AR and tree decoding give the eager AR's tokens
        # each step's verify ran the compiled forward, past the model's hooks: it is still counted, once
        assert steps and all(s["target_forwards"] == 1 and 0 < s["target_forward_s"] <= s["verify"] for s in steps)
    assert is_compiled(models.target) and type(models.target.castspec_compiled).__name__ == "_CompiledForward"


def test_overhead_rows_are_lossless_and_complete(tiny):
    specs = parse_methods("ar;chain:draft:chain_length=3;eagle2:head:top_k=2,depth=2,total_tokens=4;"
                          "eagle2:ngram:top_k=2,depth=2,total_tokens=4")
    result = run_overhead(tiny, specs, [1, 2], prompts=2, prompt_length=24, max_new_tokens=8, hf=True,
                          progress=lambda msg: None)
    rows = result["rows"]
    ours = [r for r in rows if not r["method"].startswith("hf-")]
    assert len(ours) == 8 and all(r["same_as_ar"] for r in ours)
    assert {r["method"] for r in rows if r["method"].startswith("hf-")} == {"hf-greedy", "hf-assisted"}
    assert all(r["same_as_ar"] for r in rows if r["method"] == "hf-greedy")
    for r in ours:
        assert r["host_ms"] == pytest.approx(r["wall_ms"] - r["target_forward_ms"] - r["drafter_forward_ms"]
                                             - r["candidates_ms"])
    chain = next(r for r in ours if r["method"].startswith("chain") and r["batch_size"] == 1)
    assert chain["tree_nodes"] <= 3 and chain["drafter_forwards"] >= 1


def test_bench_overhead_cli_writes_json_markdown_and_plot(tmp_path):
    from castspec.cli import main

    code = main(["bench", "--overhead", "--methods", "ar;chain:draft:chain_length=2", "--batch-sizes", "1",
                 "--max-new-tokens", "6", "--out-dir", str(tmp_path), "--name", "ov"])
    assert code == 0
    data = json.loads((tmp_path / "ov.json").read_text())
    assert data["meta"]["size"] == "tiny" and data["meta"]["dtype"] == "torch.float32"
    assert "| chain:draft:chain_length=2 | 1 |" in (tmp_path / "ov.md").read_text()
    assert (tmp_path / "ov.png").stat().st_size > 0


def test_gpu_check_script_runs_small_on_the_cpu(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "scripts" / "gpu_check.py"), "--device", "cpu",
                          "--size", "tiny", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["all_equal_to_ar"] and set(report["profile"]) == {"target", "draft", "head"}
    assert (tmp_path / "gpu-check-overhead.png").stat().st_size > 0
