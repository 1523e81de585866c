"""Cost-aware trees (``auto``) as values and rules: the selection rule on synthetic cost curves
and scores, the monotone calibration, the early-stop bound, the "rate" objective, the profile's
JSON and the auto tree config.

Cost curves here are synthetic (``helpers/cost_curves.py``, in units of one decode step): a
measured curve on a shared machine is noise, and the rule must be pinned on known inputs."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from helpers.cost_curves import FLAT, MID, STEEP
from treespec import AutoProfile, Tree, TreeConfig
from treespec.auto import AutoController, best_sizes, choice_order, choose_tree, choose_trees, keep_drafting
from treespec.builder import build_dynamic_trees
from treespec.calibration import Calibration, pav
from treespec.costs import CostCurve
from treespec.drafters import NgramDrafter
from treespec.drafters.ngram import trie_tree


def exact() -> Calibration:
    """A calibration that trusts the draft: exp(score) at the bin centres, whatever it sees."""
    return Calibration(prior_weight=1e9)


def example_tree() -> Tree:
    """A confident chain 1 -> 2 -> 3 and unlikely siblings 4 (of the root) and 5 (of 1)."""
    #            root  1      2      3      4     5
    parents = [-1, 0, 1, 2, 0, 1]
    scores = [0.0, -0.05, -0.1, -0.15, -3.5, -4.0]
    return Tree(parents, [0, 1, 2, 3, 4, 5], scores)


# ---- the rule ---------------------------------------------------------------------------


def test_best_size_worked_example():
    # t(q) = 1 + 0.25 (q - 1): J(0) = 1/1, J(1) = 1.9/1.25 = 1.52, J(2) = 2.4/1.5 = 1.6,
    # J(3) = 2.5/1.75 = 1.43 -> two nodes.
    n, rate = best_sizes(np.array([[0.9, 0.5, 0.1]]), MID, 0.0)
    assert n.tolist() == [2] and rate[0] == pytest.approx(1.6)
    # A draft time shared by every n makes the verify cost relatively cheaper: one more node.
    n, _ = best_sizes(np.array([[0.9, 0.5, 0.3]]), MID, 2.0)
    assert n.tolist() == [3]


def test_flat_curve_picks_the_largest_tree():
    tree = example_tree()
    chosen = choose_tree(tree, exact(), FLAT, 0.0)
    assert chosen is tree  # every node has p > 0 and costs nothing


def test_mid_curve_picks_the_confident_chain():
    chosen = choose_tree(example_tree(), exact(), MID, 0.0)
    assert chosen.parents.tolist() == [-1, 0, 1, 2]  # the chain, siblings dropped
    assert chosen.tokens.tolist() == [0, 1, 2, 3]


def test_steep_curve_picks_nothing_when_even_the_best_node_is_unlikely():
    tree = Tree([-1, 0, 1, 0], [0, 1, 2, 3], [0.0, -1.2, -2.0, -2.5])  # best p = 0.30
    chosen = choose_tree(tree, exact(), STEEP, 0.0)
    assert chosen.num_drafted == 0 and chosen.tokens.tolist() == [0]
    # Where a token costs a whole step nothing can pay: (1 + p) / 2 <= 1. Where it costs
    # 0.9 of a step, a near-certain first node does (1.98 / 1.9 > 1), its child not.
    sure = Tree([-1, 0, 1], [0, 1, 2], [0.0, -0.02, -2.0])
    assert choose_tree(sure, exact(), STEEP, 0.0).num_drafted == 0
    almost = CostCurve((1, 2, 128), (1.0, 1.9, 115.3))
    assert choose_tree(sure, exact(), almost, 0.0).parents.tolist() == [-1, 0]


def _markov_trees(seed: int, cfg: TreeConfig, B: int = 3):
    g = torch.Generator().manual_seed(seed)
    V = 12
    table = torch.randn(V, V, generator=g).mul(2.0).log_softmax(-1)
    root = torch.randn(B, V, generator=g).mul(2.0).log_softmax(-1)
    return build_dynamic_trees(torch.arange(B), root, lambda f: (table[f.tokens], None), cfg)


@pytest.mark.parametrize("seed", range(4))
def test_every_prefix_of_the_choice_order_is_a_tree(seed):
    """Ancestor-closed for every n: a child ranks after its parent (score <= parent's, deeper)."""
    for tree in _markov_trees(seed, TreeConfig.dynamic(4, 3, 20)):
        order = choice_order(tree)
        pos = {int(i): r for r, i in enumerate(order)}
        for i in order.tolist():
            p = int(tree.parents[i])
            assert p == 0 or pos[p] < pos[i]
        for n in range(tree.num_nodes):
            sub = tree.subtree(order[:n].tolist())
            assert sub.num_drafted == n
            assert torch.all(sub.scores[1:] <= sub.scores[sub.parents[1:]] + 1e-6)


def test_subtree_refuses_a_hole():
    with pytest.raises(ValueError, match="ancestor-closed"):
        example_tree().subtree([2])  # node 2 without its parent 1


# ---- calibration -------------------------------------------------------------------------


def test_pav_literal_cases():
    assert pav(np.array([0.5, 0.2, 0.8]), np.ones(3)).tolist() == pytest.approx([0.35, 0.35, 0.8])
    assert pav(np.array([0.9, 0.1]), np.array([1.0, 3.0])).tolist() == pytest.approx([0.3, 0.3])
    assert pav(np.array([0.1, 0.2, 0.3]), np.ones(3)).tolist() == pytest.approx([0.1, 0.2, 0.3])


def test_prior_is_exp_score_and_monotone():
    c = Calibration()
    assert c.num_observed == 0
    np.testing.assert_allclose(c.fitted(), np.exp(c.centres))
    s = np.linspace(-15, 0, 200)
    p = c(s)
    assert np.all(np.diff(p) >= -1e-12) and p[-1] <= 1 and p[0] >= 0
    assert c(np.array([-np.inf]))[0] == 0.0


def test_calibration_learns_a_monotone_fit_from_outcomes():
    """An over-confident draft: true acceptance is half of exp(score)."""
    rng = np.random.default_rng(0)
    s = -rng.exponential(1.5, size=20000)
    truth = 0.5 * np.exp(s)
    c = Calibration()
    c.observe(s, rng.random(s.size) < truth)
    fit = c.fitted()
    assert np.all(np.diff(fit) >= 0)
    well = np.array(c.seen) > 300
    np.testing.assert_allclose(fit[well], 0.5 * np.exp(c.centres[well]), atol=0.06)
    assert c(np.array([-0.05]))[0] < 0.6  # the prior said 0.95


def test_calibration_forces_monotone_on_noisy_bins():
    c = Calibration(prior_weight=1.0)
    # A confident bin that got unlucky, below a less confident one that got lucky.
    c.observe([-0.05] * 10 + [-1.1] * 10, [0] * 8 + [1] * 2 + [1] * 9 + [0])
    fit = c.fitted()
    assert np.all(np.diff(fit) >= 0)
    low, high = c.bin_of(np.array([-1.1, -0.05]))
    assert fit[low] == pytest.approx(fit[high])  # pooled into one block


def test_calibration_memory_gives_way_to_a_new_domain():
    """Learned on text it drafts well (80% accepted), then verified on text it drafts badly
    (20%): with a memory the fit follows within a few hundred steps; without, it would not."""
    rng = np.random.default_rng(0)
    fits = {}
    for memory in (400.0, None):
        c = Calibration(memory=memory)
        c.observe(np.full(50000, -0.5), rng.random(50000) < 0.8)
        for _ in range(100):  # 100 steps of 20 verified nodes in that bin
            c.observe(np.full(20, -0.5), rng.random(20) < 0.2)
        b = int(c.bin_of(np.array([-0.5]))[0])
        fits[memory] = float(c.fitted()[b])
        assert c.seen[b] <= (memory or np.inf) + 1e-9
    assert fits[400.0] == pytest.approx(0.2, abs=0.07)
    assert fits[None] > 0.7
    with pytest.raises(ValueError, match="memory"):
        Calibration(memory=0.5)
    c = Calibration(memory=None)
    assert Calibration.from_json(c.to_json()).memory is None


# ---- early stop --------------------------------------------------------------------------


def test_step_overhead_is_learned_and_makes_larger_trees_pay():
    """A step that costs more than the curve says (a fixed cost per step) is learned as the
    measured remainder, and a fixed cost shared by every tree size favours larger trees:
    on MID, p = 0.9, 0.5, 0.3 pick two nodes without it and three with a cost of one step."""
    ctl = AutoController(AutoProfile(costs=MID), max_nodes=8, top_k=4, greedy=True)
    assert ctl.overhead == 0.0
    for _ in range(200):
        ctl.end_step(3, float(MID(3)) + 1.0)  # every step 1.0 s above the curve
    assert ctl.profile.step_overhead == pytest.approx(1.0, rel=1e-6)
    tree = Tree([-1, 0, 1, 2], [0, 1, 2, 3], np.log([1.0, 0.9, 0.5, 0.3]).tolist())
    probs = np.array([[0.9, 0.5, 0.3]])
    assert best_sizes(probs, MID, 0.0)[0].tolist() == [2]
    assert best_sizes(probs, MID, ctl.overhead)[0].tolist() == [3]
    ctl.calibration = exact()
    assert ctl.choose([tree], 0.0)[0].num_drafted == 3
    fresh = AutoController(AutoProfile(costs=MID), max_nodes=8, top_k=4, greedy=True)
    fresh.calibration = exact()
    assert fresh.choose([tree], 0.0)[0].num_drafted == 2
    # A curve that overestimates learns a negative remainder, bounded by half a forward.
    for _ in range(200):
        ctl.end_step(3, 0.0)
    assert ctl.profile.step_overhead < 0 and ctl.overhead == pytest.approx(-0.5 * float(MID(1)))


def test_keep_drafting_bound():
    probs = np.array([[0.9, 0.8, 0.1]])
    # A flat curve and a free level: any node with p > 0 may help.
    assert keep_drafting(probs, np.array([0.05]), FLAT, 0.0, 0.0, max_nodes=8, width=2) is True
    # Steep: a node must be worth more than J* times a whole step; p_f = 0.3 is not.
    assert keep_drafting(probs, np.array([0.3]), STEEP, 0.0, 0.0, max_nodes=8, width=2) is False
    # Flat, but a level costs as much as a verify: p_f = 0.5 does not pay for it ...
    assert keep_drafting(probs, np.array([0.5]), FLAT, 0.0, 1.0, max_nodes=8, width=2) is False
    # ... while four such nodes per level could (m = 4 <= room).
    assert keep_drafting(probs, np.array([0.95]), FLAT, 0.0, 1.0, max_nodes=8, width=2) is True
    # Budget full: only swaps of the weakest chosen node (0.1) can help.
    full = np.array([[0.9, 0.8, 0.1]])
    assert keep_drafting(full, np.array([0.7]), FLAT, 0.0, 0.01, max_nodes=3, width=2) is True
    assert keep_drafting(full, np.array([0.12]), FLAT, 0.0, 0.5, max_nodes=3, width=2) is False


def test_batch_chooses_jointly():
    """One forward verifies the batch: the nodes worth their cost are picked across requests,
    so a sure request keeps more than an unsure one, and a lone request gets the rule."""
    sure = Tree([-1, 0, 1, 2], [0, 1, 2, 3], [0.0, -0.02, -0.05, -0.1])
    unsure = Tree([-1, 0, 0, 1], [0, 1, 2, 3], [0.0, -1.5, -2.0, -2.5])
    a, b = choose_trees([sure, unsure], exact(), MID, 0.0)
    assert a.num_drafted == 3 and b.num_drafted == 0
    assert choose_trees([sure], exact(), MID, 0.0)[0] is sure
    assert choose_trees([unsure], exact(), MID, 0.0)[0].num_drafted == choose_tree(unsure, exact(), MID, 0.0).num_drafted
    # Copies of one tree: every copy keeps a prefix of the same order, and on a flat curve all.
    copies = choose_trees([example_tree()] * 3, exact(), MID, 0.0)
    for t in copies:
        assert t.tokens.tolist() == example_tree().tokens.tolist()[: t.num_nodes]
    assert all(t.num_drafted == 5 for t in choose_trees([example_tree()] * 3, exact(), FLAT, 0.0))
    with_plain = choose_trees([Tree([-1, 0], [0, 1]), sure], exact(), MID, 0.0)  # no scores: kept whole
    assert with_plain[0].num_drafted == 1


def test_builder_stops_when_told_and_keeps_the_pool():
    cfg = TreeConfig.dynamic(5, 3, 30)
    seen = []

    def stop(depth, frontier, pool):
        seen.append((depth, tuple(frontier.shape), pool.shape[1]))
        return depth == 2

    g = torch.Generator().manual_seed(0)
    table = torch.randn(12, 12, generator=g).log_softmax(-1)
    (tree,) = build_dynamic_trees(torch.tensor([0]), table[:1], lambda f: (table[f.tokens], None), cfg, stop=stop)
    assert seen == [(1, (1, 3), 3), (2, (1, 3), 12)]
    assert tree.max_depth == 2 and tree.num_drafted == 12  # min(30, pool of 3 + 9)


@pytest.mark.parametrize("curve, levels", [(FLAT, 5), (STEEP, 1)])
def test_controller_drafts_deep_on_flat_costs_and_stops_on_steep(curve, levels):
    cfg = TreeConfig.auto(max_depth=5, top_k=3, max_nodes=30)
    ctl = AutoController(AutoProfile(costs=curve, level_seconds=0.0), 30, 3, greedy=True)
    g = torch.Generator().manual_seed(1)
    table = torch.randn(12, 12, generator=g).mul(0.5).log_softmax(-1)  # a diffuse draft: p ~ 0.1
    asked = []

    def stop(depth, frontier, pool):
        asked.append((depth, ctl.stop(depth, frontier, pool)))
        return asked[-1][1]

    ctl.begin_step()
    (tree,) = build_dynamic_trees(torch.tensor([0]), table[:1], lambda f: (table[f.tokens], None), cfg, stop=stop)
    drafted = 1 + sum(not s for _, s in asked)  # level 1 comes with the root's log-probs
    assert drafted == levels
    assert tree.max_depth <= levels


def test_level_time_is_the_gap_between_decisions_not_the_root_step():
    """t_level is learned from the time between consecutive early-stop calls: a slow root step
    (here 300 ms) before the first call must not count as a level (here ~10 ms each)."""
    ctl = AutoController(AutoProfile(costs=FLAT), 30, 3, greedy=True)
    frontier, pool = torch.full((1, 3), -0.1), torch.full((1, 3), -0.1)
    ctl.begin_step()
    time.sleep(0.3)
    for depth in (1, 2, 3):
        assert ctl.stop(depth, frontier, pool) is False  # flat costs, likely nodes: keep going
        time.sleep(0.01)
    assert 0.008 < ctl.profile.level_seconds < 0.15  # generous: a busy machine oversleeps
    ctl.begin_step()  # a new step: its root step is not a gap either
    time.sleep(0.3)
    ctl.stop(1, frontier, pool)
    assert ctl.profile.level_seconds < 0.15


# ---- profile -----------------------------------------------------------------------------


def test_profile_json_round_trip(tmp_path):
    p = AutoProfile(costs=MID, level_seconds=0.003, step_overhead=0.004, keys={"model": "tiny"})
    p.greedy.observe([-0.1, -0.1, -2.0], [1, 0, 0])
    p.sampling.observe([-0.5], [1])
    path = p.save(tmp_path / "p.json")
    q = AutoProfile.load(path)
    assert q.to_json() == p.to_json()
    assert q.greedy.seen == p.greedy.seen and q.costs == MID and q.level_seconds == 0.003
    assert q.step_overhead == 0.004
    np.testing.assert_allclose(q.greedy(np.array([-0.1, -1.0])), p.greedy(np.array([-0.1, -1.0])))
    c = p.copy()
    c.greedy.observe([-0.1], [1])
    assert p.greedy.num_observed == 3  # a copy learns on its own
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="auto profile"):
        AutoProfile.load(tmp_path / "bad.json")


def test_auto_config_value():
    cfg = TreeConfig.auto(max_depth=4, top_k=3, max_nodes=10)
    assert cfg.auto and cfg.kind == "dynamic" and cfg.max_tree_tokens == 11
    assert cfg.describe() == "auto(max_depth=4, top_k=3, max_nodes=10)"
    assert cfg != TreeConfig.dynamic(4, 3, 10) and not TreeConfig.dynamic(4, 3, 10).auto
    assert TreeConfig.preset("auto").auto
    with pytest.raises(ValueError, match="fixed shape"):
        cfg.to_vllm()
    with pytest.raises(ValueError, match="dynamic"):
        TreeConfig("static", 1, 1, 1, ((0,),), auto=True)
    with pytest.raises(ValueError, match="candidate pool"):
        TreeConfig.auto(max_depth=2, top_k=2, max_nodes=7)


def test_ngram_scores_are_log_shares_decayed_by_depth():
    runs = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    tree = trie_tree(9, runs, num_nodes=10)
    share = dict(zip(tree.tokens.tolist()[1:], np.exp(tree.scores.numpy()[1:]).tolist()))
    assert share == pytest.approx({1: 0.75, 2: 0.5, 3: 0.25, 4: 0.25, 5: 0.25, 6: 0.25})
    assert float(tree.scores[0]) == 0.0
    decayed = trie_tree(9, runs, num_nodes=10, depth_decay=0.5)
    got = dict(zip(decayed.tokens.tolist()[1:], np.exp(decayed.scores.numpy()[1:]).tolist()))
    assert got == pytest.approx({1: 0.375, 2: 0.125, 3: 0.03125, 4: 0.03125, 5: 0.0625, 6: 0.125})
    assert torch.all(decayed.scores[1:] < decayed.scores[decayed.parents[1:]])  # strictly: depth tells
    lone = trie_tree(9, [[7, 8, 9]], num_nodes=3, depth_decay=NgramDrafter().depth_decay)
    assert len(set(Calibration().bin_of(lone.scores.numpy()[1:]).tolist())) == 3  # each depth its own bin
    with pytest.raises(ValueError, match="depth_decay"):
        NgramDrafter(depth_decay=0.0)


# ---- the "rate" objective ---------------------------------------------------------------------


def test_rate_objective_drops_the_doubtful_steps_nodes():
    """Steps of two kinds, alternating: confident (p = 0.9) and doubtful (p = 0.3) nodes, a
    quarter step per token. Each step's own ratio says verify all 8 nodes of both (0.3 > 0.25
    of the step's rate at the margin); the generation's rate R is higher than a doubtful
    step's, and a node pays only when p > R / 4, so the rate rule verifies the doubtful step's
    root alone and the whole generation is faster."""
    sure, doubt = np.full(8, 0.9), np.full(8, 0.3)
    assert best_sizes(sure, MID, 0.0)[0][0] == 8 and best_sizes(doubt, MID, 0.0)[0][0] == 8

    def run(rate_rule: bool) -> float:
        tokens = seconds = 0.0
        for p in [sure, doubt] * 20:
            rate = tokens / seconds if rate_rule and seconds else None
            n = int(best_sizes(p, MID, 0.0, rate=rate)[0][0])
            tokens += 1 + p[:n].sum()
            seconds += float(MID(1 + n))
        return tokens / seconds

    assert best_sizes(doubt, MID, 0.0, rate=1.9)[0][0] == 0
    assert best_sizes(sure, MID, 0.0, rate=1.9)[0][0] == 8
    assert run(True) > 1.15 * run(False)


def test_rate_objective_in_the_controller():
    """R is the tokens committed per modelled step second (draft + overhead + the curve's
    verify); None before a step ends and for the "step" objective."""
    profile = AutoProfile(costs=MID, step_overhead=0.0)
    ctl = AutoController(profile, max_nodes=8, top_k=2, greedy=True, objective="rate")
    assert ctl.rate is None
    tree = Tree([-1, 0, 1], [0, 1, 2], [0.0, -0.1, -0.2])
    ctl.begin_step()
    chosen = ctl.choose([tree], propose_seconds=0.5)
    ctl.learn(chosen, [[0, 1]])  # committed 2 tokens
    ctl.end_step(chosen[0].num_nodes, 2.0)
    assert ctl.rate == pytest.approx(2 / (0.5 + float(MID(chosen[0].num_nodes))))
    step = AutoController(profile, max_nodes=8, top_k=2, greedy=True)
    assert step.rate is None
    with pytest.raises(ValueError, match="objective"):
        AutoController(profile, max_nodes=8, top_k=2, greedy=True, objective="fastest")
    with pytest.raises(ValueError, match="auto trees only"):
        TreeConfig("dynamic", 3, 2, 4, objective="rate")
    assert TreeConfig.preset("auto-rate").objective == "rate"


def test_step_cost_slope_is_learned_once_sizes_vary():
    """A step costing 2 ms plus 1 ms per verified token beyond the curve's (a long context):
    the remainder's line is learned from steps of varied sizes, and the rule then prices a
    tree of q tokens at curve(q) + 1 ms * (q - 1). Steps of one size teach no slope."""
    curve = CostCurve((1, 2, 64), (0.010, 0.011, 0.074))
    profile = AutoProfile(costs=curve)
    ctl = AutoController(profile, max_nodes=16, top_k=2, greedy=True)
    for _ in range(20):
        ctl.end_step(5, float(curve(5)) + 0.002)
    assert profile.step_slope == 0.0 and profile.step_overhead == pytest.approx(0.002)
    rng = np.random.default_rng(0)
    for q in rng.integers(1, 17, size=400):
        ctl.end_step(int(q), float(curve(q)) + 0.002 + 0.001 * (q - 1))
    assert profile.step_slope == pytest.approx(0.001, rel=0.05)
    assert profile.step_overhead == pytest.approx(0.002, abs=3e-4)
    assert float(ctl.costs(9)) == pytest.approx(float(curve(9)) + 8 * profile.step_slope)
    back = AutoProfile.from_json(json.loads(json.dumps(profile.to_json())))
    assert back.step_slope == profile.step_slope and back.step_moments == profile.step_moments
    # A remainder that falls with size (the curve too steep) teaches no negative slope.
    for q in rng.integers(1, 17, size=400):
        ctl.end_step(int(q), float(curve(q)) + 0.010 - 0.0005 * (q - 1))
    assert profile.step_slope == 0.0
