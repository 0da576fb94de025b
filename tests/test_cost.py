"""Cost model: interpolation, monotonicity, storage and its errors (synthetic tables), and a real quick profile."""

from __future__ import annotations

import json
import random

import pytest

from castspec.cli import main
from castspec.costs.profile import held_out_points
from castspec.costs.table import CostGrid, CostTable
from castspec.errors import CastspecError


def linear_grid(batch_sizes=(1, 4), contexts=(128, 512), tokens=(1, 2, 4, 8)) -> CostGrid:
    def f(b, c, n):
        return 0.1 + 0.01 * b * n + 0.0001 * c

    return CostGrid(list(batch_sizes), list(contexts), list(tokens),
                    [[[f(b, c, n) for n in tokens] for c in contexts] for b in batch_sizes])


def test_exact_on_the_grid_and_linear_between():
    grid = linear_grid()
    assert grid(1, 128, 4) == pytest.approx(0.1 + 0.04 + 0.0128)
    assert grid(1, 320, 3) == pytest.approx(0.1 + 0.03 + 0.032)  # bilinear inside a cell
    assert grid(2.5, 128, 2) == pytest.approx((grid(1, 128, 2) + grid(4, 128, 2)) / 2)


def test_extrapolation_beyond_the_grid_keeps_the_trend():
    grid = linear_grid()
    assert grid(1, 1024, 16) == pytest.approx(0.1 + 0.16 + 0.1024)
    assert grid(8, 128, 1) > grid(4, 128, 1)
    assert grid(1, 16, 1) <= grid(1, 128, 1)


def test_noisy_measurements_become_non_decreasing_in_n_and_c():
    rng = random.Random(1)
    tokens, contexts = [1, 2, 3, 4, 6, 8, 12, 16], [64, 128, 256, 512]
    seconds = [[[0.1 + 0.005 * n + rng.uniform(-0.03, 0.03) for n in tokens] for _ in contexts]]
    grid = CostGrid([1], contexts, tokens, seconds)
    for c in range(64, 520, 7):
        values = [grid(1, c, n / 4) for n in range(4, 65)]
        assert all(b >= a - 1e-12 for a, b in zip(values, values[1:], strict=False))
    for n in (1, 5, 16):
        values = [grid(1, c, n) for c in range(64, 520, 5)]
        assert all(b >= a - 1e-12 for a, b in zip(values, values[1:], strict=False))


def test_normalised_costs():
    table = CostTable({"target": {}}, linear_grid(), linear_grid())
    assert table.normalised_target(1, 128, 1) == pytest.approx(1.0)
    assert table.normalised_target(1, 128, 8) == pytest.approx(table.f_target(1, 128, 8) / table.f_target(1, 128, 1))
    assert table.normalised_draft(4, 512, 2) == pytest.approx(table.f_draft(4, 512, 2) / table.f_target(4, 512, 1))


def test_bad_axes_are_refused():
    with pytest.raises(CastspecError, match="strictly increasing"):
        CostGrid([1], [128, 64], [1], [[[1.0], [1.0]]])
    with pytest.raises(CastspecError, match="do not match"):
        CostGrid([1], [64], [1, 2], [[[1.0]]])


KEY = {"device": "cpu-x", "threads": 2, "model": "m#1", "dtype": "bfloat16", "torch": "2", "transformers": "5"}


def test_save_load_roundtrip_and_setup_key(tmp_path):
    path = tmp_path / "t.json"
    CostTable({"target": KEY}, linear_grid(), linear_grid(contexts=(64,))).save(path)
    table = CostTable.load(path, expect=KEY)
    assert table.f_target(4, 300, 5) == pytest.approx(linear_grid()(4, 300, 5))
    other = {**KEY, "threads": 16, "dtype": "float32"}
    with pytest.raises(CastspecError, match="another setup.*threads.*dtype"):
        CostTable.load(path, expect=other)
    assert CostTable.load(path, expect=other, force=True).draft is not None


def test_corrupt_truncated_and_foreign_files(tmp_path):
    path = tmp_path / "t.json"
    CostTable({"target": KEY}, linear_grid()).save(path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(CastspecError, match="corrupt or truncated"):
        CostTable.load(path)
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(CastspecError, match="not a castspec cost table"):
        CostTable.load(path)
    data = json.loads(text)
    del data["target"]["seconds"]
    path.write_text(json.dumps(data))
    with pytest.raises(CastspecError, match="corrupt"):
        CostTable.load(path)
    with pytest.raises(CastspecError, match="does not exist"):
        CostTable.load(tmp_path / "absent.json")


def test_held_out_points_avoid_the_grid():
    grid = linear_grid(contexts=(128, 256, 512), tokens=(1, 2, 4, 8, 16))
    for b, c, n in held_out_points(grid, 30):
        assert b in grid.batch_sizes and c not in grid.contexts and n not in grid.tokens
        assert 128 <= c <= 512 and 1 <= n <= 16


def test_quick_profile_of_smollm_gives_a_loadable_table(tmp_path, capsys):
    out = tmp_path / "smollm.json"
    assert main(["profile", "--model", "smollm2-135m", "--drafter", "ngram", "--quick", "--out", str(out)]) == 0
    from castspec.costs.table import setup_key
    from castspec.models import load_model

    model, _ = load_model("smollm2-135m", "bf16")
    table = CostTable.load(out, expect=setup_key(model))
    assert table.meta["target"]["source"] == "smollm2-135m" and table.draft is not None
    assert table.f_target(1, 100, 8) > 0 and table.f_target(2, 100, 8) >= table.f_target(2, 100, 1)
    png = tmp_path / "curves.png"
    assert main(["profile", "--plot", str(out), str(png)]) == 0 and png.stat().st_size > 10_000
    assert main(["profile", "--validate", str(out), "--points", "3"]) == 0
    assert "median error" in capsys.readouterr().out
    assert "median_ape" in CostTable.load(out).validation["target"]


def test_profile_passes_interleave_timers_in_random_orders_and_keep_medians():
    from castspec.costs.profile import measure_grids

    calls = []

    def timer(which):
        def run(b, c, n):
            calls.append((which, b, c, n))
            # a burst of load during the first pass slows everything measured in it
            burst = 3.0 if len(calls) <= 12 else 1.0
            return (0.1 + 0.01 * n + 1e-4 * c) * burst * (1.0 if which == "target" else 0.5)
        return run

    grids = measure_grids({"target": timer("target"), "draft": timer("draft")}, [1, 2], [128, 512], [1, 4, 8],
                          passes=3)
    points = {(w, b, c, n) for w in ("target", "draft") for b in (1, 2) for c in (128, 512) for n in (1, 4, 8)}
    assert len(calls) == 3 * 24 and set(calls) == points and all(calls.count(p) == 3 for p in points)
    passes = [calls[i * 24:(i + 1) * 24] for i in range(3)]
    assert passes[0] != passes[1] != passes[2]
    assert {w for w, *_ in passes[0][:8]} == {"target", "draft"}  # the two models alternate, not one after the other
    for which, scale in (("target", 1.0), ("draft", 0.5)):
        for bi in range(2):
            for ci, c in enumerate((128, 512)):
                for ni, n in enumerate((1, 4, 8)):
                    assert grids[which].seconds[bi][ci][ni] == pytest.approx((0.1 + 0.01 * n + 1e-4 * c) * scale)


def test_profile_needs_a_pass():
    from castspec.costs.profile import measure_grids

    with pytest.raises(CastspecError, match="at least one pass"):
        measure_grids({"target": lambda b, c, n: 0.1}, [1], [128], [1], passes=0)


def test_isotonic_fit_averages_an_outlier_instead_of_carrying_it():
    from castspec.costs.table import isotonic_plane

    measured = [[1.0, 10.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0], [2.5, 3.5, 4.5, 6.0]]
    fit = isotonic_plane(measured)
    for i in range(3):
        for j in range(4):
            assert (j == 0 or fit[i][j] >= fit[i][j - 1] - 1e-9) and (i == 0 or fit[i][j] >= fit[i - 1][j] - 1e-9)
    running_max = [[1.0, 10.0, 10.0, 10.0], [2.0, 10.0, 10.0, 10.0], [2.5, 10.0, 10.0, 10.0]]

    def error(grid):
        return sum((grid[i][j] - measured[i][j]) ** 2 for i in range(3) for j in range(4))

    assert error(fit) < error(running_max) / 5
    assert fit[2][3] < 7.0  # the far corner stays near its own measurement, not at the outlier's 10
    already = [[1.0, 2.0, 3.0], [1.5, 2.5, 3.5]]
    assert isotonic_plane(already) == already


def test_weighted_isotonic_grid_is_the_weighted_fit_along_lines_and_monotone_in_3d():
    import random

    import torch

    from castspec.costs.table import isotonic, isotonic_grid

    rng = random.Random(0)
    for _ in range(50):  # one axis: the same as pool-adjacent-violators
        length = rng.randint(1, 18)
        values, weights = [rng.gauss(0, 1) for _ in range(length)], [rng.uniform(0.01, 5) for _ in range(length)]
        fit = isotonic_grid(torch.tensor(values, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64))
        assert fit.tolist() == pytest.approx(isotonic(values, weights), abs=1e-9)
    values = torch.randn(3, 5, 7, dtype=torch.float64).cumsum(2)
    weights = torch.rand(3, 5, 7, dtype=torch.float64) + 0.01
    fit = isotonic_grid(values, weights)
    for dim in range(3):
        assert (fit.diff(dim=dim) >= 0).all()
    # a light point above heavy ones is pulled down to them; heavy points barely move
    spike = torch.tensor([[1.0, 1.0, 5.0, 1.0]], dtype=torch.float64)
    fit = isotonic_grid(spike, torch.tensor([[50.0, 50.0, 1.0, 50.0]], dtype=torch.float64))
    assert fit[0, 2] < 1.1 and fit[0, 3] < 1.1
    already = torch.tensor([[1.0, 2.0], [1.5, 2.5]], dtype=torch.float64)
    assert torch.allclose(isotonic_grid(already, torch.rand(2, 2, dtype=torch.float64) + 0.1), already)


def test_a_context_below_the_grid_costs_what_the_smallest_timed_one_did():
    # linear extrapolation down from a steep first segment reached zero: a free forward, and log(0) in the
    # online model's drift check (it killed a server's engine loop)
    grid = CostGrid([1], [32, 64], [1, 2], [[[1.0, 1.5], [3.0, 4.0]]])
    assert grid(1, 8, 1) == 1.0 and grid(1, 1, 2) == 1.5
    assert grid(1, 48, 1) == 2.0 and grid(1, 128, 1) >= 3.0


def test_a_model_keeps_its_key_wherever_it_is_loaded_from(tmp_path):
    """A table learned in one $CASTSPEC_HOME is found from another: the key hashed the folder the config was read
    from, so the same model under two homes had two keys. Different weights or config still differ."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from castspec.costs.table import model_identity

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "a" / "tiny")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tiny").symlink_to(tmp_path / "a" / "tiny")
    one, two = (LlamaForCausalLM.from_pretrained(tmp_path / home / "tiny") for home in ("a", "b"))
    assert one.config._name_or_path != two.config._name_or_path
    assert model_identity(one) == model_identity(two)
    config.num_hidden_layers = 2
    assert model_identity(LlamaForCausalLM(config)) != model_identity(one)
