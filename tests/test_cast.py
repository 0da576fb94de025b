"""CAST policy with synthetic scores and cost tables: no model."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch
from test_drafting import ScriptedDrafter

from castspec.costs.online import OnlineCostTable
from castspec.costs.table import CostGrid, CostTable
from castspec.decode.drafting import grow_tree
from castspec.errors import CastspecError
from castspec.policies.base import Eagle2Policy, StepContext
from castspec.policies.cast import CastPolicy, select_max_valid_index


def table(target_per_token: float, draft_per_token: float, *, fixed: float = 1.0, draft_fixed: float = 0.0,
          batch_growth: float = 0.0) -> CostTable:
    """f_T(B, c, n) = fixed + target_per_token * n * (1 + batch_growth * (B - 1)); same shape for the draft."""
    batch_sizes, contexts, tokens = [1, 2, 4, 8], [16, 4096], list(range(1, 129))

    def grid(base, slope):
        return CostGrid(batch_sizes, contexts, tokens,
                        [[[base + slope * n * (1 + batch_growth * (b - 1)) for n in tokens] for _ in contexts]
                         for b in batch_sizes])

    return CostTable({"target": {}}, grid(fixed, target_per_token), grid(draft_fixed, draft_per_token))


# ---- Algorithm 1 ------------------------------------------------------------------------------------------------

def test_alg1_keeps_everything_worth_its_cost():
    assert select_max_valid_index([0.9, 1.6, 2.0, 2.1], [0.1, 0.2, 0.3, 0.4], 3.0) == 3


def test_alg1_crosses_a_single_non_concave_dip():
    # item 2 adds little for its cost, item 3 a lot: measured from anchor 1, the pair 2-3 is still worth it
    u, c = [1.0, 1.05, 2.0], [0.1, 0.2, 0.3]
    assert select_max_valid_index(u, c, 4.0) == 3


def test_alg1_equal_costs_keep_growing_utility():
    # once the first item pays, later items at no extra cost are free utility
    assert select_max_valid_index([0.5, 0.8, 0.9], [0.2, 0.2, 0.2], 2.0) == 3
    assert select_max_valid_index([0.5, 0.8, 0.9], [0.2, 0.2, 0.2], 10.0) == 0


def test_alg1_nothing_worth_keeping():
    assert select_max_valid_index([0.1, 0.15], [1.0, 2.0], 1.0) == 0
    assert select_max_valid_index([], [], 1.0) == 0
    assert select_max_valid_index([0.5], [1.2], 1.0, base_cost=1.0) == 1  # 0.5 / 0.2 >= 1
    assert select_max_valid_index([0.5], [1.9], 1.0, base_cost=1.0) == 0


# ---- Theorem 4.1: linear cost + matching thresholds = EAGLE-2 ---------------------------------------------------

class TheoremCast(CastPolicy):
    """CAST whose thresholds are the theorem's: C1 = v(K)/lambda_D per layer, C3 = v(m-1)/lambda_T, no depth
    pruning before `depth` layers."""

    def __init__(self, costs, k, depth, total, lam_d, lam_t):
        super().__init__(costs, 0, 0, 0, max_depth=depth, top_k=k, max_verify=10_000)
        self.k, self.total, self.lam_d, self.lam_t = k, total, lam_d, lam_t

    def threshold(self, which, scores, ctx):
        scores = scores.flatten()  # a batch of one
        if which == "breadth":
            return float(scores[min(self.k, len(scores)) - 1]) / self.lam_d
        if which == "verify":
            return float(scores[min(self.total - 1, len(scores)) - 1]) / self.lam_t
        return 0.0


@pytest.mark.parametrize("k, depth, total", [(10, 5, 60), (2, 4, 9), (4, 3, 16), (3, 6, 30)])
def test_theorem_4_1_linear_costs_reproduce_the_eagle2_tree(k, depth, total):
    lam_d, lam_t = 0.05, 0.02
    costs = table(lam_t, lam_d, fixed=1.0 - lam_t)  # normalised: c_T(n) = 1 + lam_t (n - 1), c_D(n) = lam_d n
    eagle, _ = grow_tree(ScriptedDrafter(), Eagle2Policy(k, depth, total), [1, 2], StepContext(1, 16))
    cast, _ = grow_tree(ScriptedDrafter(), TheoremCast(costs, k, depth, total, lam_d, lam_t), [1, 2],
                        StepContext(1, 16))
    assert torch.equal(cast.tokens, eagle.tokens) and torch.equal(cast.parents, eagle.parents)


# ---- the cost model shapes the tree -------------------------------------------------------------------------

def grown(policy, ctx: StepContext | None = None):
    tree, record = grow_tree(ScriptedDrafter(), policy, [3], ctx or StepContext(1, 16))
    return len(tree) - 1, record


def test_a_flat_cost_gives_a_bigger_tree_than_a_steep_one():
    flat = CastPolicy(table(0.002, 0.01), c1=2.0, c2=1.0, c3=1.5)
    steep = CastPolicy(table(0.3, 0.25), c1=2.0, c2=1.0, c3=1.5)
    flat_size, flat_record = grown(flat)
    steep_size, steep_record = grown(steep)
    assert flat_size > steep_size
    assert flat_record.depth >= steep_record.depth


def test_a_larger_batch_gets_a_smaller_tree():
    costs = table(0.01, 0.02, batch_growth=1.0)  # per-token cost grows with the batch
    sizes = [grown(CastPolicy(costs, c1=2.0, c2=1.0, c3=1.5), StepContext(b, 16))[0] for b in (1, 2, 4, 8)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_auto_mode_follows_the_measured_goodput():
    policy = CastPolicy(table(0.02, 0.02), auto=True)
    before, _ = grown(policy)
    for _ in range(20):  # the decoder reports 40 tokens per AR-step time: only very cheap nodes still pay
        policy.observe(40, 1.0)
    after, _ = grown(policy)
    assert before > after


def test_auto_thresholds_do_not_depend_on_the_tables_clock():
    """The busy-server mystery: auto mode compared tokens per wall second times the table's AR seconds with
    utilities per table cost. A table whose seconds were 30x this machine's made the threshold 30x too high and
    CAST drafted nothing. The goodput is now read in table prices, so scaling a table's seconds (target and
    drafter alike) changes no decision, whatever the wall clock says."""
    def scaled(factor):
        base = table(0.02, 0.05)
        return CostTable({"target": {}}, *(CostGrid(g.batch_sizes, g.contexts, g.tokens,
                                                     [[[factor * x for x in row] for row in plane]
                                                      for plane in g.seconds]) for g in (base.target, base.draft)))

    trees = []
    for factor in (1.0, 30.0):
        policy = CastPolicy(scaled(factor), auto=True)
        for _ in range(12):
            size, record = grown(policy)
            policy.observe(1 + size // 2, 0.03)  # wall seconds of a fast machine, not the table's
        trees.append((size, record.depth, policy.threshold("verify", None, StepContext(1, 16))))
    assert trees[0][:2] == trees[1][:2] and trees[0][0] > 0
    assert trees[0][2] == pytest.approx(trees[1][2], rel=1e-9)


def test_depth_pruning_stops_when_layers_stop_paying():
    cheap = CastPolicy(table(0.001, 0.001), c1=0.5, c2=0.5, c3=0.5, max_depth=6)
    _, record = grown(cheap)
    assert record.depth == 6  # only the hard limit stops it
    dear = CastPolicy(table(0.001, 0.2), c1=0.5, c2=50.0, c3=0.5, max_depth=6)
    _, record = grown(dear)
    assert record.depth == 1 and dear.trace["layers"][0]["stop"] == "depth_pruning"


def test_trace_explains_the_choices():
    policy = CastPolicy(table(0.01, 0.02), c1=2.0, c2=1.0, c3=1.5)
    _, record = grown(policy)
    trace = record.decisions
    assert trace["layers"] and {"width", "utilities", "costs", "c1"} <= set(trace["layers"][0])
    assert trace["verify_budget"] == record.verify_budget


def test_a_table_without_drafter_costs_is_refused():
    costs = table(0.01, 0.01)
    costs.draft = None
    with pytest.raises(CastspecError, match="drafter table"):
        CastPolicy(costs)


def test_random_trees_stay_valid():
    rng = random.Random(0)
    for _ in range(30):
        policy = CastPolicy(table(rng.uniform(0, 0.2), rng.uniform(0, 0.3)), c1=rng.uniform(0, 5),
                            c2=rng.uniform(0, 5), c3=rng.uniform(0, 5), max_depth=rng.randint(1, 8))
        size, record = grown(policy)
        assert 0 <= size <= record.pool_size and record.depth <= 8


def test_auto_mode_skips_drafting_where_even_perfect_acceptance_cannot_pay():
    ctx = StepContext(1, 16)
    # each extra verified token costs 0.7 AR steps and each drafted one 0.4: d tokens cost 1.1 d > d
    assert not CastPolicy(table(0.7, 0.4, fixed=0.3), auto=True).should_draft(ctx)
    assert CastPolicy(table(0.05, 0.1, fixed=0.95), auto=True).should_draft(ctx)
    assert CastPolicy(table(0.7, 0.4, fixed=0.3), auto=False).should_draft(ctx)  # the paper always drafts
    # a drafter 40 tokens behind must absorb them in its first forward (7.8 AR steps here): a row that has 4
    # tokens left cannot earn that back, one with a long way to go spreads it over its next 64 tokens
    cheap = CastPolicy(table(0.05, 0.2, fixed=0.95), auto=True)
    assert cheap.should_draft(StepContext(1, 16, depth_limit=3, pending=3))
    assert not cheap.should_draft(StepContext(1, 16, depth_limit=3, pending=40))
    assert cheap.should_draft(StepContext(1, 16, depth_limit=500, pending=40))


def test_a_drafting_step_pays_its_share_of_the_drafter_s_catch_up():
    """The catch-up of a new prompt is charged to the drafting steps that use it, by the tokens they make out of
    the next 64, in the goodput and in the payoff gate's gains, not whole to the first tree."""
    from castspec.decode.tree import DraftTree

    policy = CastPolicy(table(0.05, 0.2, fixed=0.95), auto=True, calibrate=True)
    ctx = StepContext(1, 16, depth_limit=500, pending=41, rows=("new",))
    assert policy.should_draft(ctx)
    policy.start_step(ctx)  # catch-up: D(41) - D(1) = 8 AR steps
    policy.observe_tree(DraftTree.chain([5, 6, 7, 8]), [1, 2, 3], row="new")
    before = policy.payoff.expected
    policy.observe(16, 1.0)  # 16 tokens: a quarter of the catch-up (2 AR steps) plus the one-token draft forward
    gain = 16 - (1.0 + 0.2 + 8.0 * 16 / 64)
    d = policy.payoff.decay
    expected_total = d * policy.payoff.prior * before + (1 - d) * policy.payoff.prior * policy.payoff.prior_gain + gain
    assert policy.payoff.total == pytest.approx(expected_total)


# ---- acceptance calibration -------------------------------------------------------------------------------------

def test_calibration_starts_at_the_drafters_word_and_learns_the_acceptance_rate():
    from castspec.policies.cast import AcceptanceCalibration

    calibration = AcceptanceCalibration()
    scores = torch.tensor([1.0, 0.8, 0.45, 0.1, 0.0])
    assert torch.allclose(calibration(scores), scores, atol=0.02)  # unobserved: the scores as they are
    for _ in range(200):  # score-1.0 proposals are right a quarter of the time, the rest never
        calibration.observe([1.0, 1.0, 1.0, 1.0, 0.5, 0.3], [True, False, False, False, False, False])
    calibrated = calibration(scores)
    assert abs(calibrated[0].item() - 0.25) < 0.05
    assert calibrated[2].item() < 0.05 and calibrated[-1].item() == 0.0
    assert torch.all(calibrated[:-1] >= calibrated[1:])  # sorted scores stay sorted
    for _ in range(1000):  # AR steps only: nothing verified, the evidence fades back to the drafter's word
        calibration.observe([], [])
    assert torch.allclose(calibration(scores), scores, atol=0.03)


def test_evidence_in_one_bin_is_not_dragged_down_by_the_priors_of_unseen_bins_above_it():
    """A suffix match seen once scores ~0.47; in a copied span the target takes every such node. The bins above
    (0.5-1.0) saw nothing: their priors must not pool the observed bin down to ~0.9 (which made a chain of 6
    copied tokens look worth 0.9^6 and capped CAST's trees at 5-6 nodes where chain-16 took 16 every step)."""
    from castspec.policies.cast import AcceptanceCalibration

    calibration = AcceptanceCalibration()
    for _ in range(14):  # 14 steps of 5 copied nodes, all taken
        calibration.observe([0.469] * 5, [True] * 5)
    copied, above = calibration(torch.tensor([0.469, 0.8])).tolist()
    assert copied > 0.95 and above >= copied  # what was seen, and a likelier score never maps below it


def test_calibrated_utilities_fall_along_a_chain_of_confident_guesses():
    from castspec.decode.tree import DraftTree

    policy = CastPolicy(table(0.05, 0.01), auto=True, calibrate=True)
    one = torch.tensor([[1.0]])
    assert policy.node_utility(one, one).item() > 0.95  # unobserved: the drafter's word
    chain = DraftTree.from_lists([5, 6, 7, 8], [-1, 0, 1, 2], [1.0, 1.0, 1.0, 1.0])  # an n-gram's sure chain
    for _ in range(60):  # the target takes each next guess half the time: accepted lengths 0,0,0,0,1,1,2,3
        for accepted in (0, 0, 0, 0, 1, 1, 2, 3):
            policy.observe_tree(chain, [1, 2, 3][:accepted])
    depth1 = policy.node_utility(one, one, 1)
    depth3 = policy.node_utility(one, policy.node_utility(one, depth1, 2), 3)
    # about one half at each depth (recent steps weigh more, and the cycle ends on its long acceptances); three
    # deep, about its cube, where calibrating the path score (1.0 at every depth) would have said one half again
    assert 0.45 < depth1.item() < 0.6 and abs(depth3.item() - depth1.item() ** 3) < 0.05 and depth3.item() < 0.2
    uncalibrated = CastPolicy(table(0.05, 0.01), auto=True)
    raw = uncalibrated.node_utility(torch.tensor([[0.5, 0.2]]), torch.tensor([[0.5]]))
    assert torch.allclose(raw, torch.tensor([[0.25, 0.1]]))  # uncalibrated: the draft score


def test_a_copied_span_that_the_target_keeps_taking_stays_worth_drafting_deep():
    """The same n-gram score at every depth: a first guess taken a third of the time, but once taken the span
    goes on (copied text): deeper nodes are learnt as nearly sure, so a 12-node chain keeps most of its first
    node's worth instead of decaying like (1/3)^12."""
    from castspec.decode.tree import DraftTree

    policy = CastPolicy(table(0.05, 0.01), auto=True, calibrate=True)
    chain = DraftTree.from_lists(list(range(5, 17)), [-1, *range(11)], [1.0] * 12)
    for _ in range(40):
        for accepted in (0, 0, 12):  # two misses at depth 1, then the whole span
            policy.observe_tree(chain, list(range(1, accepted + 1)))
    one = torch.ones(1, 1)
    utility = policy.node_utility(one, one, 1)
    first = utility.item()
    for depth in range(2, 13):
        utility = policy.node_utility(one, utility, depth)
    assert 0.25 < first < 0.45 and utility.item() > 0.8 * first


def test_two_rows_of_one_batch_learn_their_own_regimes():
    """One row copies a span (the target takes the whole chain), the other writes new text (it takes none of it):
    the shared map learns the mean of both, and each row's own ratio moves its utilities to its own side of it;
    a row no step has seen reads as the shared map scaled by the newcomers' ratio."""
    from castspec.decode.tree import DraftTree

    policy = CastPolicy(table(0.05, 0.01), auto=True, calibrate=True)
    chain = DraftTree.from_lists(list(range(5, 11)), [-1, *range(5)], [1.0] * 6)
    for _ in range(30):
        policy.observe_tree(chain, list(range(1, 6)), row="copying")
        policy.observe_tree(chain, [], row="writing")
    policy.start_step(StepContext(3, 64, rows=("copying", "writing", "new")))
    one = torch.ones(3, 1)
    utility = policy.node_utility(one, one, 1, rows=[0, 1, 2])
    for depth in (2, 3):
        utility = policy.node_utility(one, utility, depth, rows=[0, 1, 2])
    copying, writing, new = utility.flatten().tolist()
    shared = policy.node_utility(torch.ones(1, 1), torch.ones(1, 1), 1)
    for depth in (2, 3):
        shared = policy.node_utility(torch.ones(1, 1), shared, depth)
    regimes = policy.calibration.regimes
    start = regimes.newcomer_factor(0) * regimes.newcomer_factor(1) ** 2  # depth 1 is band 0, depths 2-3 band 1
    assert new == pytest.approx(shared.item() * start)
    assert copying > 1.4 * new and writing < 0.5 * new and copying <= 0.99 ** 3 + 1e-9


def test_row_regimes_are_bounded_and_never_certain():
    from castspec.policies.cast import AcceptanceCalibration, RowRegimes

    calibration = AcceptanceCalibration()
    calibration.regimes = RowRegimes(len(calibration.DEPTHS), keep=4)
    for row in range(10):
        for _ in range(20):
            calibration.observe([0.3] * 4, [True] * 4, [1, 2, 4, 8], row=row)
    assert list(calibration.regimes.rows) == [6, 7, 8, 9]
    scaled = calibration(torch.tensor([[0.3, 0.9]]), 1, rows=[9])
    assert scaled.max().item() <= RowRegimes.MOST + 1e-6 and calibration.regimes.factor(9, 0) > 1.2
    assert calibration.regimes.factor(0, 0) == calibration.regimes.newcomer_factor(0)  # dropped: a newcomer again
    unscaled = AcceptanceCalibration(per_row=False)
    unscaled.observe([0.3], [True], [1], row="a")
    assert unscaled.regimes is None


def test_a_new_row_reads_as_new_rows_did_at_their_start_not_as_the_text_before_it():
    """A copy text teaches the shared map that a drafter's confident first guess is nearly sure; the texts after
    it each rejected their first guess. A new row's first tree is priced by how the new rows before it fared at
    their start, not by the copy text's map, and its own verdicts take over after a few steps."""
    from castspec.policies.cast import AcceptanceCalibration

    calibration = AcceptanceCalibration()
    for _ in range(40):
        calibration.observe([1.0], [True], [1], row="copying")
    for row in range(6):
        calibration.observe([1.0], [False], [1], row=f"writing-{row}")
    shared = calibration(torch.tensor([1.0]), 1).item()
    newcomer = calibration(torch.tensor([1.0]), 1, rows=["next"]).item()
    assert shared > 0.75 and newcomer < 0.6 * shared
    for _ in range(6):  # the new row turns out to copy: its own verdicts raise it back
        calibration.observe([1.0], [True], [1], row="next")
    assert calibration(torch.tensor([1.0]), 1, rows=["next"]).item() > 0.85 * shared


def test_newcomers_that_beat_the_map_do_not_price_a_new_row_above_it():
    from castspec.policies.cast import RowRegimes

    regimes = RowRegimes(bands=4)
    for row in range(6):  # every new row took a first guess the map gave 0.2
        regimes.observe(row, [0], [0.2], [True])
    assert regimes.factor("next", 0) == 1.0 and regimes.factor(5, 0) > 1.3  # its own evidence still counts


def test_a_depth_band_that_saw_nothing_reads_like_the_band_above_it():
    from castspec.policies.cast import AcceptanceCalibration

    calibration = AcceptanceCalibration()
    for _ in range(20):  # first guesses only, all taken
        calibration.observe([0.469] * 3, [True] * 3, [1, 1, 1])
    scores = torch.tensor([0.469, 0.9])
    first, deep = calibration(scores, 1), calibration(scores, 9)
    assert first[0].item() > 0.9 and torch.allclose(deep, first, atol=0.02)


def test_calibration_fit_never_inverts_the_order_of_scores():
    from castspec.policies.cast import AcceptanceCalibration

    calibration = AcceptanceCalibration(prior=0.0)
    rng = random.Random(0)
    for _ in range(300):  # middling scores accepted more often than high ones: the fit pools them
        scores = [rng.random() for _ in range(8)]
        calibration.observe(scores, [0.4 < s < 0.6 or rng.random() < 0.1 for s in scores])
    assert calibration.rates == sorted(calibration.rates)
    grid = torch.linspace(1, 0, 101)
    assert torch.all(calibration(grid)[:-1] >= calibration(grid)[1:])


def test_weighted_isotonic_pools_by_weight():
    from castspec.costs.table import isotonic

    assert isotonic([1.0, 0.0], [3.0, 1.0]) == [0.75, 0.75]
    assert isotonic([0.0, 1.0, 0.5], [1.0, 1.0, 1.0]) == [0.0, 0.75, 0.75]


def test_a_calibrated_cast_verifies_less_from_a_drafter_that_overpromises():
    def sizes(calibrate: bool) -> int:
        policy = CastPolicy(table(0.05, 0.01), auto=True, calibrate=calibrate)
        tree, _ = grow_tree(ScriptedDrafter(), policy, [3], StepContext(1, 16))
        for _ in range(100):  # the target accepts none of what this drafter proposes
            policy.observe_tree(tree, [])
        tree, _ = grow_tree(ScriptedDrafter(), policy, [3], StepContext(1, 16))
        return len(tree) - 1

    assert sizes(calibrate=False) > 0 and sizes(calibrate=True) < sizes(calibrate=False)


# ---- drafting payoff (calibrated CAST) ---------------------------------------------------------------------------

def test_drafting_payoff_stops_a_losing_drafter_and_tries_it_again_now_and_then():
    from castspec.policies.cast import DraftingPayoff

    payoff = DraftingPayoff(prior_gain=0.5, prior=2.0, decay=0.99)
    assert payoff.expected == 0.5  # untried: optimistic
    for _ in range(10):
        payoff.observe(-0.3)  # each drafting step costs 0.3 AR steps more than it brings
    assert payoff.expected < 0
    ar_steps = 0
    while payoff.expected <= 0:
        payoff.observe(None)
        ar_steps += 1
    assert 0 < ar_steps < 500  # the evidence fades: the drafter is tried again
    tries = 0
    for _ in range(5000):
        if payoff.expected > 0:
            payoff.observe(-0.3)
            tries += 1
        else:
            payoff.observe(None)
    # (1 - decay) * prior * prior_gain / (0.3 + that) = 3.2 % of the steps
    assert 0.02 < tries / 5000 < 0.045
    winner = DraftingPayoff()
    for _ in range(1000):
        winner.observe(0.05)
        assert winner.expected > 0


def _request_steps(policy: CastPolicy, row, accepts_all: bool, steps: int) -> list[bool]:
    """`steps` decoding steps of one request (`row`; None: steps that name no rows): per step, whether `policy`
    drafted, when the target accepts every drafted chain (or nothing)."""
    from castspec.decode.tree import DraftTree

    drafted = []
    for _ in range(steps):
        ctx = StepContext(1, 16, rows=() if row is None else (row,))
        tree, path = DraftTree.single(3), []
        drafted.append(policy.should_draft(ctx))
        if drafted[-1]:
            tree, _ = grow_tree(ScriptedDrafter(), policy, [3], ctx)
            if accepts_all:
                path = max(tree.paths(), key=len)[1:]
        policy.observe_tree(tree, path, row)
        # the step takes the time the table prices it at, so that auto mode measures a goodput it can trust
        price = policy._step_price if policy._step_price is not None else 1.0
        policy.observe(len(path) + 1, price * policy.costs.f_target(1, 16, 1))
    return drafted


def _drafting_steps(policy: CastPolicy, accepts_all: bool, steps: int = 150) -> int:
    """Steps on which `policy` drafts, when the target accepts every drafted chain (or nothing)."""
    return sum(_request_steps(policy, None, accepts_all, steps))


def test_a_closed_payoff_gate_tries_each_new_request_once():
    """The gate's evidence is of earlier texts: a request whose text pays must not be decoded as AR because the one
    before it did not (CAST over n-gram made 1.26x AR on a HumanEval prompt after an MT-bench answer closed the
    gate, where a chain of 16 made 4.6x). A new request's first tree is verified; if it pays the gate reopens."""
    policy = CastPolicy(table(0.1, 0.01), c1=0.5, c2=0.5, c3=0.5, top_k=2, max_depth=3, calibrate=True)
    losing = _request_steps(policy, "prose", accepts_all=False, steps=60)
    # the gate closed on the losing text: it reopens only as the evidence fades (a try every ~30 steps here)
    assert policy.payoff.expected <= 0 and sum(losing[10:]) <= 2
    copying = _request_steps(policy, "copy", accepts_all=True, steps=20)
    assert copying[0] and all(copying)  # tried at once, and the gain reopened the gate
    assert policy.trace.get("new_row_try") is None  # an open gate needs no try
    # a request that loses as well gets its one try, and no more
    policy.payoff.total = -abs(policy.payoff.total) - 1.0
    again = _request_steps(policy, "more prose", accepts_all=False, steps=20)
    assert again[0] and not any(again[1:]) and policy.payoff.new_row_tries >= 1


def test_a_request_the_drafter_has_nothing_for_stays_untried():
    """A try that verified no drafted node (the drafter had nothing to offer) is not the request's try: it stays
    untried until a node is verified, so a prompt whose first lookups find no match still gets judged."""
    from castspec.decode.tree import DraftTree

    policy = CastPolicy(table(0.1, 0.01), c1=0.5, c2=0.5, c3=0.5, top_k=2, max_depth=3, calibrate=True)
    policy.payoff.total = -1.0
    ctx = StepContext(1, 16, rows=("new",))
    assert policy.should_draft(ctx)
    policy.observe_tree(DraftTree.single(3), [], "new")  # nothing drafted
    assert policy.should_draft(ctx)
    tree, _ = grow_tree(ScriptedDrafter(), policy, [3], ctx)
    policy.observe_tree(tree, [], "new")
    assert not policy.should_draft(ctx)
    assert not policy.should_draft(StepContext(1, 16))  # a step with no row keys (a replay of old) is no try


def test_calibrated_cast_stops_drafting_when_drafting_does_not_pay():
    def policy(calibrate: bool) -> CastPolicy:  # each drafted token costs 0.3 AR steps to draft, 0.1 to verify
        return CastPolicy(table(0.1, 0.3), c1=0.5, c2=0.5, c3=0.5, top_k=2, max_depth=3, calibrate=calibrate)

    assert _drafting_steps(policy(False), accepts_all=False) == 150  # the paper's CAST always drafts
    assert 0 < _drafting_steps(policy(True), accepts_all=False) < 15
    assert _drafting_steps(policy(True), accepts_all=True) == 150  # a drafter that pays is never stopped


def test_auto_cast_is_payoff_gated_by_default():
    def policy(**kw) -> CastPolicy:  # drafting is cheap enough that an all-accepted chain would pay
        return CastPolicy(table(0.1, 0.3), top_k=2, max_depth=3, auto=True, **kw)

    assert policy().payoff is not None and policy().calibration is None
    assert policy(payoff=False).payoff is None
    assert CastPolicy(table(0.1, 0.3), top_k=2, max_depth=3).payoff is None  # paper mode stays the paper's
    assert _drafting_steps(policy(payoff=False), accepts_all=False) == 150
    assert 0 < _drafting_steps(policy(), accepts_all=False) < 15
    assert _drafting_steps(policy(), accepts_all=True) > 140


# ---- exploration: a table wrong about drafting is corrected by tries ----------------------------------------------

def target_seconds(n: int) -> float:
    return 0.1 + 0.002 * n


class TimedDrafter(ScriptedDrafter):
    """Scripted proposals whose forwards take `seconds(n)` on a simulated clock (n: tokens in the forward)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.now = seconds, 0.0

    def begin(self, new_tokens, top_k, features=None):
        self.now += self.seconds(max(len(t) for t in new_tokens))
        return super().begin(new_tokens, top_k, features)

    def expand(self, pools, frontiers, top_k):
        self.now += self.seconds(max(len(f) for f in frontiers))
        return super().expand(pools, frontiers, top_k)


def online_table(draft_grid_factor: float, draft_seconds) -> OnlineCostTable:
    """A learning table seeded with the true target costs and draft costs `draft_grid_factor` times the truth."""
    tokens = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    contexts = [32, 64, 128, 256, 512]

    def grid(seconds):
        return CostGrid([1], contexts, tokens, [[[seconds(n) for n in tokens] for _ in contexts]])

    costs = OnlineCostTable({"target": {}})
    costs.target_curve.seed_from(grid(target_seconds))
    costs.draft_curve.seed_from(grid(lambda n: draft_grid_factor * draft_seconds(n)))
    return costs


def simulate(policy: CastPolicy, drafter: TimedDrafter, steps: int, accept_all: bool) -> list[dict]:
    """Decode `steps` steps of a simulated engine: the drafter's forwards and the target's verify take their true
    time, the online table learns from both, and the target accepts every drafted chain (or nothing)."""
    from castspec.decode.drafting import grow_trees

    costs, log, pending, context = policy.costs, [], 1, 64
    for _ in range(steps):
        ctx = StepContext(1, context, 1 << 30, pending)
        verified, tokens, drafted, start = 1, 1, policy.should_draft(ctx), drafter.now
        exploring = policy._exploring
        if drafted:
            trees, record = grow_trees(drafter, policy, [[3] * pending], ctx, clock=lambda: drafter.now)
            for extra, n, seconds in record.forwards:
                costs.observe_draft(1, context + extra, n, seconds)
            verified = len(trees[0])
            tokens += len(max(trees[0].paths(), key=len)) - 1 if accept_all else 0
            pending = tokens
        else:
            pending += 1
        seconds = drafter.now - start + target_seconds(verified)
        costs.observe_target(1, context, verified, target_seconds(verified))
        policy.observe(tokens, seconds)
        log.append({"drafted": drafted, "exploring": exploring, "tokens": tokens, "seconds": seconds})
    return log


def test_a_table_twenty_times_too_pessimistic_about_drafting_is_corrected_by_tries():
    """The lock-out seen on a fresh machine: drafting priced 20x its cost is never done, so it is never timed.
    Tries re-time the drafter; timings well below the table move it at once, and CAST then drafts on its own."""
    def draft_seconds(n):
        return 0.01 + 0.001 * n

    costs = online_table(20.0, draft_seconds)
    policy = CastPolicy(costs, top_k=2, max_depth=4, auto=True)
    assert not policy.should_draft(StepContext(1, 64))  # priced out, as in the issue
    log = simulate(policy, TimedDrafter(draft_seconds), 300, accept_all=True)
    first = next(i for i, step in enumerate(log) if step["drafted"] and not step["exploring"])
    # two tries (one every 8 steps) time two draft cells twice each, well below the table: the curve moves down
    # as a whole (`LearnedCurve._follow_drops`); before that path it took 150 steps
    assert first <= 3 * policy.exploration.every, f"CAST drafted on its own only from step {first}"
    assert sum(step["drafted"] for step in log[first:]) >= 0.9 * len(log[first:])
    assert costs.normalised_draft(1, 64, 1) < 0.5  # the table now says what drafting costs (0.11 AR steps)


def test_a_drafter_that_never_pays_costs_a_few_percent_over_ar_at_most():
    """A drafter dearer than the target (1.2x at every width), whose drafts the target never takes, priced right:
    only tries draft, every 8 steps while its price settles, then ever rarer. What remains is mostly the catch-up
    forward of a try (the tokens since the drafter last ran): 3.7% over AR in 2000 steps here."""
    def draft_seconds(n):
        return 1.2 * target_seconds(n)

    policy = CastPolicy(online_table(1.0, draft_seconds), top_k=2, max_depth=4, auto=True)
    log = simulate(policy, TimedDrafter(draft_seconds), 2000, accept_all=False)
    tries = sum(step["exploring"] for step in log)
    assert all(step["exploring"] for step in log if step["drafted"])  # it drafts only to try
    assert 5 <= tries <= 20 and policy.exploration.gap == policy.exploration.most
    seconds_per_token = sum(step["seconds"] for step in log) / sum(step["tokens"] for step in log)
    assert seconds_per_token / target_seconds(1) <= 1.05


def test_a_fixed_table_is_never_explored():
    assert CastPolicy(table(0.7, 0.4, fixed=0.3), auto=True).exploration is None


def test_a_lookup_guess_is_priced_by_its_match_length_not_by_its_depth():
    """After other texts taught the map that short matches' guesses are coin tosses, a node behind a long match
    (a copy of the prompt, at depth 1 of its step) still reads as nearly sure: the calibration bands a lookup
    drafter's nodes by match length. Banded by depth, both read as one first-guess map (the HumanEval ramp of
    bench/regret: 3, 4, 5 nodes a step before a copy's first deep tree)."""
    from dataclasses import replace

    from castspec.decode.tree import DraftTree

    policy = CastPolicy(table(0.05, 0.01), auto=True, calibrate=True)
    guess = DraftTree.from_lists([5, 6], [-1, 0], [1.0, 1.0])
    for _ in range(40):  # at the same score and depth: short matches rejected, long ones taken
        policy.observe_tree(replace(guess, matched=[0, 2]), [])
        policy.observe_tree(replace(guess, matched=[0, 16]), [1])
    one = torch.ones(2, 1)
    short, long = policy.node_utility(one, one, 1, matched=[2, 16]).flatten().tolist()
    assert short < 0.2 and long > 0.85
    by_depth = CastPolicy(table(0.05, 0.01), auto=True, calibrate=True)
    for _ in range(40):
        by_depth.observe_tree(guess, [])
        by_depth.observe_tree(guess, [1])
    assert 0.35 < by_depth.node_utility(torch.ones(1, 1), torch.ones(1, 1), 1).item() < 0.65


def test_grown_trees_carry_each_node_s_match_length_into_what_calibration_learns():
    from castspec.drafters.ngram import NgramDrafter

    policy = CastPolicy(table(0.05, 0.01), auto=True, calibrate=True)
    span = list(range(100, 120))
    prompt = span + [7] + span[:6]  # the answer copies the span: a 6-token agreement, each node extends it
    tree, _ = grow_tree(NgramDrafter(), policy, prompt, StepContext(1, len(prompt) - 1, depth_limit=8))
    depths, matched = tree.depths.tolist(), tree.matched
    assert len(tree) > 2 and matched[0] == 0
    assert all(matched[i] == min(16, 5 + depths[i]) for i in range(1, len(tree)))
    policy.observe_tree(tree, list(range(1, len(tree))))  # learnt in the bands of those lengths
    assert policy.calibration.bands[0].seen == [0.0] * len(policy.calibration.bands[0].seen)


def test_a_chain_that_pays_is_drafted_although_its_first_node_alone_would_not():
    """The verify forward's price is not concave in its tokens (a second token costs 0.26 AR steps, each one after
    0.04): after a long accepted copy lifted the goodput to 3.9 tokens per AR step, a copy's sure first node (1
    token for 0.26) does not pay alone, but the chain it heads does (16 tokens for 0.86). Breadth and depth
    pruning project the chain (`CastPolicy._chain_pays`) instead of stopping there (before: a 0-node tree, and one
    token a step until the goodput sank back)."""
    from castspec.drafters.ngram import NgramDrafter

    batch_sizes, contexts, tokens = [1, 2, 4, 8], [16, 4096], list(range(1, 129))
    target = CostGrid(batch_sizes, contexts, tokens, [[[1.0 if n == 1 else 1.26 + 0.04 * (n - 2) for n in tokens]
                                                       for _ in contexts] for _ in batch_sizes])
    draft = CostGrid(batch_sizes, contexts, tokens, [[[1e-4] * len(tokens) for _ in contexts] for _ in batch_sizes])
    span = list(range(100, 140))
    prompt = span + [7] + span[:4]  # the answer copies the span
    for goodput, least in ((1.0, 16), (3.9, 16)):
        policy = CastPolicy(CostTable({"target": {}}, target, draft), auto=True, max_depth=16)
        policy.goodput = goodput
        tree, _ = grow_tree(NgramDrafter(), policy, prompt, StepContext(1, len(prompt) - 1, depth_limit=16))
        assert len(tree) - 1 >= least
    # a chain that does not pay is still declined: the same guesses at one chance in five
    policy = CastPolicy(CostTable({"target": {}}, target, draft), auto=True, max_depth=16)
    policy.goodput, policy.ratios = 3.9, deque([0.2])
    one = torch.tensor([[0.2]])
    assert not policy._chain_pays(0.2, 1, 1, StepContext(1, 44, depth_limit=16), 3.9)
    assert policy.node_utility(one, torch.ones(1, 1)).item() == pytest.approx(0.2)
