"""Cost-aware trees (``auto``): the selection rule on synthetic cost curves and scores, the
monotone calibration, the early-stop bound, the cost-curve cache, the profile's JSON, the
metrics, and ``treespec tune`` / ``bench --auto-profile`` end to end on a tiny model.

Cost curves here are synthetic (in units of one decode step): a measured curve on a shared
machine is noise, and the rule must be pinned on known inputs."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

import treespec
from helpers.references import hf_greedy
from helpers.tiny import tiny_model
from treespec import AutoProfile, Tree, TreeConfig
from treespec import costs as costs_mod
from treespec.auto import AutoController, best_sizes, choice_order, choose_tree, choose_trees, keep_drafting
from treespec.builder import build_dynamic_trees
from treespec.calibration import Calibration, pav
from treespec.costs import CostCurve, cached_cost_curve, cost_key, measure_cost_curve
from treespec.drafters import ModelDrafter, NgramDrafter
from treespec.drafters.ngram import trie_tree
from treespec.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

FLAT = CostCurve((1, 128), (1.0, 1.0))  # a GPU-like verify: any tree costs one step
STEEP = CostCurve((1, 2, 128), (1.0, 2.0, 128.0))  # every extra token costs a whole step
MID = CostCurve((1, 2, 128), (1.0, 1.25, 32.75))  # every extra token costs a quarter step


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


# ---- cost curve and its cache ------------------------------------------------------------


def test_cost_curve_interpolates_and_extends():
    c = CostCurve((1, 3, 5), (1.0, 2.0, 2.5))
    assert c(np.array([1, 2, 4, 5, 7])).tolist() == pytest.approx([1.0, 1.5, 2.25, 2.5, 3.0])
    with pytest.raises(ValueError):
        CostCurve((2, 1), (1.0, 1.0))
    assert CostCurve.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_monotone_fit_pools_a_spike_instead_of_lifting_every_larger_size():
    from treespec.costs import monotone_fit

    fit = monotone_fit([10.0, 11.0, 30.0, 12.0, 12.5, 13.0, 20.0])  # one slow sample at q=3
    assert np.all(np.diff(fit) >= 0)
    assert fit[:2].tolist() == [10.0, 11.0] and fit[-1] == 20.0
    assert fit[2] < 30.0 and fit[5] < 20.0  # pooled; a running maximum would give 30 up to q=6
    assert monotone_fit([1.0, 2.0, 3.0]).tolist() == [1.0, 2.0, 3.0]


def test_measure_cost_curve_on_a_tiny_model():
    runner = ModelRunner(tiny_model("llama", 0))
    with runner.attached():
        c = measure_cost_curve(runner, 5, repeats=1)
    assert c.tokens == (1, 2, 3, 4, 5)
    assert all(b >= a > 0 for a, b in zip(c.seconds, c.seconds[1:]))


def test_cost_cache_round_trip_and_keys(monkeypatch, tmp_path):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = []

    def fake(runner, max_tokens, repeats=3):
        calls.append(max_tokens)
        return CostCurve((1, max_tokens), (1.0, 1.0 + len(calls)))

    monkeypatch.setattr(costs_mod, "measure_cost_curve", fake)
    model = tiny_model("llama", 2)
    runner = ModelRunner(model)
    with runner.attached():
        first = cached_cost_curve(runner, 9)
        assert calls == [9]
        assert cached_cost_curve(runner, 9) == first and calls == [9]  # this process's copy
        costs_mod._MEASURED.clear()  # as in the next process
        assert cached_cost_curve(runner, 9) == first and calls == [9]  # read back from disk
        assert cached_cost_curve(runner, 5) == first and calls == [9]  # a longer curve serves
        files = list((tmp_path / "costs").glob("*.json"))
        assert len(files) == 1
        saved = json.loads(files[0].read_text())
        key = cost_key(runner)
        assert saved["key"] == key and CostCurve.from_json(saved["curve"]) == first
        assert key["dtype"] == "float32" and key["backend"] == "torch" and key["packed"] is False
        assert key["parameters"] == sum(p.numel() for p in model.parameters())
        assert cached_cost_curve(runner, 12) != first and calls == [9, 12]  # too short: measured
        assert cached_cost_curve(runner, 12, refresh=True) and calls == [9, 12, 12]
        torch.set_num_threads(2)  # another thread count is another key
        try:
            assert cost_key(runner)["threads"] == 2
            cached_cost_curve(runner, 9)
            assert calls == [9, 12, 12, 9]
        finally:
            torch.set_num_threads(1)
    other = ModelRunner(tiny_model("llama", 2, layers=3))
    assert cost_key(other)["model_config"] != key["model_config"]
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2


def test_profile_takes_this_settings_curve(monkeypatch, tmp_path):
    """A profile's curve from another setting is replaced (the calibration is kept); one
    without a key (a synthetic curve) or with this setting's key is used as is."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs_mod, "measure_cost_curve", lambda runner, q, repeats=3: CostCurve((1, q), (1.0, 2.0)))
    runner = ModelRunner(tiny_model("llama", 2))
    key = cost_key(runner)
    synthetic = AutoProfile(costs=MID)
    synthetic.prepare(runner, 9)
    assert synthetic.costs == MID
    mine = AutoProfile(costs=MID, keys={"costs": key})
    mine.prepare(runner, 9)
    assert mine.costs == MID
    foreign = AutoProfile(costs=MID, keys={"costs": {**key, "dtype": "bfloat16"}})
    foreign.greedy.observe([-0.1], [1])
    with pytest.warns(treespec.TreespecWarning, match="another setting .*dtype"):
        foreign.prepare(runner, 9)
    assert foreign.costs == CostCurve((1, 9), (1.0, 2.0)) and foreign.keys["costs"] == key
    assert foreign.greedy.num_observed == 1


# ---- the first-use measurement on a fake clock (issue 31) ---------------------------------


class FakeClock:
    """Time that moves only when a forward "runs": ``cost(q, call)`` seconds for q tokens."""

    def __init__(self, cost):
        self.now, self.cost, self.calls = 0.0, cost, 0

    def __call__(self) -> float:
        return self.now

    def timed(self, runner):
        """``runner`` whose forwards advance this clock (the tiny model's real forward runs)."""
        real = runner.forward

        def forward(cache, seqs, toks, *a, **k):
            self.calls += 1
            self.now += self.cost(len(toks[0]), self.calls)
            return real(cache, seqs, toks, *a, **k)

        runner.forward = forward
        return runner


def idle(q, call):  # 30 ms plus 1 ms a token, every time
    return 0.030 + 0.001 * q


def busy(q, call):  # the same forward waits a whole time slice or three, at random
    return idle(q, call) * (1, 4, 2, 7, 3)[call % 5]


def test_measurement_takes_seconds_and_stops_at_its_budget():
    clock = FakeClock(idle)
    runner = clock.timed(ModelRunner(tiny_model("llama", 0)))
    with runner.attached():
        curve = measure_cost_curve(runner, 43, clock=clock)
    sizes = len(curve.tokens)
    assert curve.tokens == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 43)
    assert curve.seconds == pytest.approx([idle(q, 0) for q in curve.tokens])
    assert clock.calls == 2 + costs_mod.REPEATS * sizes  # the prefix, a warm-up, five rounds
    assert clock.now < 3.0 and curve.spread == pytest.approx(0.0)

    slow = FakeClock(lambda q, call: 2.28)  # a forward as slow as on the busy machine of issue 31
    runner = slow.timed(ModelRunner(tiny_model("llama", 0)))
    with runner.attached():
        curve = measure_cost_curve(runner, 43, clock=slow)
    assert slow.calls == 2 + sizes  # one round, then the budget has gone: 30 s, not 148 s
    assert curve.spread == float("inf")  # nothing to compare: not to be cached


@pytest.mark.parametrize("cost, cached", [(idle, True), (busy, False)])
def test_a_noisy_measurement_is_not_cached(monkeypatch, tmp_path, caplog, cost, cached):
    """A noisy curve stays off the disk, so the next process measures again; this process
    keeps it either way (a chat measured it again on every turn, issue 50)."""
    import functools

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    clock = FakeClock(cost)
    monkeypatch.setattr(costs_mod, "measure_cost_curve", functools.partial(measure_cost_curve, clock=clock))
    runner = clock.timed(ModelRunner(tiny_model("llama", 0)))
    with caplog.at_level("INFO", logger="treespec.costs"), runner.attached():
        first = cached_cost_curve(runner, 9)
        calls = clock.calls
        assert cached_cost_curve(runner, 9) == first and clock.calls == calls  # the process's own, noisy or not
        costs_mod._MEASURED.clear()  # as in the next process
        cached_cost_curve(runner, 9)  # read back, or measured again
    assert len(list((tmp_path / "costs").glob("*.json"))) == int(cached)
    assert (clock.calls == calls) == cached
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("measuring what a verify forward of 1 to 9 tokens costs here")  # before it starts
    assert any("mostly noise" in m and "not written to the disk cache" in m for m in said) == (not cached)


def test_a_cached_curve_the_steps_contradict_is_measured_again(monkeypatch, tmp_path, caplog):
    """A curve measured on a busy machine (2.28 s a forward) and steps that take 50 ms, forward
    and all: after the first steps the curve leaves the disk cache, and the next generation
    measures again; a curve the steps agree with stays."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    measured = [CostCurve((1, 64), (2.28, 2.5), spread=0.05), CostCurve((1, 64), (0.04, 0.06), spread=0.05)]
    monkeypatch.setattr(costs_mod, "measure_cost_curve", lambda runner, q: measured.pop(0))
    runner = ModelRunner(tiny_model("llama", 0))
    files = lambda: list((tmp_path / "costs").glob("*.json"))  # noqa: E731
    profile = AutoProfile()
    profile.prepare(runner, 17)
    assert profile.costs.seconds == (2.28, 2.5) and len(files()) == 1
    ctl = AutoController(profile, 16, 4, greedy=True)
    with caplog.at_level("WARNING", logger="treespec.auto"):
        for step in range(6):
            ctl.end_step(17, 0.05)
            assert len(files()) == (1 if step < 4 else 0)  # judged after five steps
    assert "measured while other work slowed the machine" in caplog.text
    profile.prepare(runner, 17)  # the next generation
    assert profile.costs.seconds == (0.04, 0.06) and len(files()) == 1 and not measured
    ctl = AutoController(profile, 16, 4, greedy=True)
    for _ in range(10):
        ctl.end_step(17, 0.07)  # a step a little dearer than its forward: as it should be
    assert len(files()) == 1 and "costs_contradicted" not in profile.keys


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_cost_key_sees_packed_weights():
    from treespec.packing import PackedLinears

    model = tiny_model("llama", 3)
    runner = ModelRunner(model)
    with PackedLinears(model):
        assert cost_key(runner)["packed"] is True
    assert cost_key(runner)["packed"] is False


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


# ---- through the engine ------------------------------------------------------------------


PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [50, 51, 52]]


def test_metrics_record_chosen_sizes():
    model, twin = tiny_model("llama", 0), tiny_model("llama", 0)
    refs = [hf_greedy(model, p, 16) for p in PROMPTS]
    big = treespec.generate(model, ModelDrafter(twin), TreeConfig.auto(3, 2, 6), PROMPTS, max_new_tokens=16,
                            auto_profile=AutoProfile(costs=FLAT))
    m = big.metrics
    assert big.sequences == refs
    assert len(m.tree_sizes) == m.num_request_steps and all(0 <= s <= 6 for s in m.tree_sizes)
    assert m.mean_tree_size > 3 and m.summary()["mean_tree_size"] == m.mean_tree_size
    assert m.tree_tokens == sum(m.tree_sizes) + m.num_request_steps
    # Steep costs and a profile that learned the draft is useless: the root alone every step.
    useless = AutoProfile(costs=STEEP)
    useless.greedy.observe(np.zeros(1000) - 0.01, np.zeros(1000))
    none = treespec.generate(model, ModelDrafter(twin), TreeConfig.auto(3, 2, 6), PROMPTS, max_new_tokens=16,
                             auto_profile=useless)
    assert none.sequences == refs
    assert set(none.metrics.tree_sizes) == {0} and none.metrics.mean_accepted_length == 1.0


def test_profile_learns_across_calls_and_fixed_configs_record_sizes():
    model, twin = tiny_model("qwen2", 1), tiny_model("qwen2", 1)
    profile = AutoProfile(costs=MID)
    treespec.generate(model, ModelDrafter(twin), "auto", PROMPTS, max_new_tokens=10, auto_profile=profile)
    seen = profile.greedy.num_observed
    assert seen > 0 and profile.level_seconds is not None and profile.sampling.num_observed == 0
    assert profile.step_overhead is not None  # learned from the steps' measured times
    treespec.generate(model, NgramDrafter(), "auto", PROMPTS, max_new_tokens=10, auto_profile=profile,
                      temperature=1.0, seed=0)
    assert profile.greedy.num_observed == seen  # sampling learns into its own calibration
    assert profile.sampling.num_observed > 0
    fixed = treespec.generate(model, NgramDrafter(), "chain-3", PROMPTS, max_new_tokens=10).metrics
    assert len(fixed.tree_sizes) == fixed.num_request_steps and max(fixed.tree_sizes) <= 3


def test_auto_without_a_profile_uses_the_disk_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs_mod, "MAX_SPREAD", float("inf"))  # cached however busy the test machine is
    model = tiny_model("llama", 1)
    out = treespec.generate(model, NgramDrafter(), TreeConfig.auto(2, 2, 4), PROMPTS, max_new_tokens=6)
    assert out.sequences == [hf_greedy(model, p, 6) for p in PROMPTS]
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1


def test_one_measurement_serves_every_generate_call_of_a_process(monkeypatch, tmp_path):
    """Issue 50: each call without a profile measured again when the curve was noisy (and so not
    on disk). Now two calls measure once; a refresh measures again."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = []

    def noisy(runner, max_tokens):
        calls.append(max_tokens)
        return CostCurve((1, max_tokens), (1e-5, 2e-5), spread=float("inf"))  # one round: never on disk

    monkeypatch.setattr(costs_mod, "measure_cost_curve", noisy)
    model = tiny_model("llama", 1)
    for _ in range(2):
        out = treespec.generate(model, NgramDrafter(), TreeConfig.auto(2, 2, 4), PROMPTS, max_new_tokens=6)
        assert out.sequences == [hf_greedy(model, p, 6) for p in PROMPTS]
    assert len(calls) == 1
    assert not (tmp_path / "costs").exists() or not list((tmp_path / "costs").glob("*.json"))
    runner = ModelRunner(model)
    with runner.attached():
        cached_cost_curve(runner, calls[0], refresh=True)
    assert len(calls) == 2


def test_auto_starts_from_the_heads_own_calibration(monkeypatch, tmp_path):
    """A head directory's auto-profile.json gives the calibrations auto starts from without a
    profile (copies: a generation never changes the drafter's); none gives the prior; a
    calibration that says "never accepted" makes every step verify the root alone, one that
    says "always" drafts, and the output is the target's either way."""
    from treespec.drafters.eagle import EagleHead

    # A measured curve of a tiny model is noise (a bigger verify may read cheaper, and then
    # even useless nodes pay): pin it.
    monkeypatch.setattr("treespec.auto.cached_cost_curve", lambda *a, **k: MID)
    model = tiny_model("llama", 1)
    EagleHead.for_target(model, eagle3=False).save_pretrained(tmp_path / "head")
    assert treespec.load_draft(tmp_path / "head", model).auto_calibration is None
    assert AutoProfile.starting(treespec.load_draft(tmp_path / "head", model)).greedy.num_observed == 0

    never = Calibration(seen=[1e6] * 20, accepted=[0.0] * 20, memory=None)
    AutoProfile(greedy=never, sampling=Calibration()).save(tmp_path / "head" / "auto-profile.json")
    draft = treespec.load_draft(tmp_path / "head", model)
    carried = draft.auto_calibration
    assert carried.greedy.to_json() == never.to_json() and carried.sampling.num_observed == 0
    assert carried.costs is None and carried.level_seconds is None
    start = AutoProfile.starting(draft)
    start.greedy.observe([0.0], [True])
    assert draft.auto_calibration.greedy.to_json() == never.to_json()  # a copy

    n = 8
    out = treespec.generate(model, draft, TreeConfig.auto(3, 2, 6), PROMPTS, max_new_tokens=n)
    assert out.sequences == [hf_greedy(model, p, n) for p in PROMPTS]
    assert out.metrics.tree_sizes and set(out.metrics.tree_sizes) == {0}
    always = Calibration(seen=[1e6] * 20, accepted=[1e6] * 20, memory=None)
    draft.auto_calibration = AutoProfile(greedy=always, sampling=always)
    sure = treespec.generate(model, draft, TreeConfig.auto(3, 2, 6), PROMPTS, max_new_tokens=n)
    assert sure.sequences == out.sequences and max(sure.metrics.tree_sizes) > 0

    (tmp_path / "head" / "auto-profile.json").write_text("{}")
    with pytest.raises(ValueError, match="bad auto profile .*auto-profile.json"):
        treespec.load_draft(tmp_path / "head", model)


def test_the_shipped_head_carries_its_calibration():
    """The shipped head's auto-profile.json: a greedy calibration learned by treespec tune on
    this pair (its observations), prompt lookup's learned with lookup grafted on, no
    machine's cost curve."""
    from treespec.assets import resolve_draft
    from treespec.drafters.hybrid import LOOKUP

    path = resolve_draft("smollm2-135m-instruct-eagle")
    greedy = AutoProfile.head_calibration(path).greedy
    assert greedy.num_observed > 1000
    fitted = greedy.fitted()
    assert np.all(np.diff(fitted) >= 0) and fitted[-1] > 0.5 > fitted[0]
    shipped = AutoProfile.load(path / "auto-profile.json")
    assert shipped.costs is None and shipped.level_seconds is None and shipped.step_overhead is None
    assert shipped.calibration(True, LOOKUP).num_observed > 100


# ---- command line ------------------------------------------------------------------------


def test_tune_writes_a_profile_and_pictures_and_bench_reads_it(capsys, monkeypatch, tmp_path, lm_dir):
    from treespec import cli

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Once upon a time", "Tom and Lily and Tom"]))
    prof = tmp_path / "prof.json"
    rc = cli.main(["tune", "--model", lm_dir, "--draft", f"model:{lm_dir}", "--dataset", str(data), "--prompt-field",
                   "text", "--num-prompts", "2", "--max-new-tokens", "12", "--out", str(prof), "--plot-dir",
                   str(tmp_path / "plots"), "--no-pack", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    p = AutoProfile.load(prof)
    assert p.costs is not None and p.greedy.num_observed > 0 and p.sampling.num_observed == 0
    assert p.keys["model"] == lm_dir and p.keys["costs"]["dtype"] == "float32" and "cpu" in p.keys["machine"]
    for name in ("cost_curve", "calibration", "tree_sizes"):
        assert (tmp_path / "plots" / f"prof-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean tree size" in out

    res = tmp_path / "b.json"
    rc = cli.main(["bench", "--model", lm_dir, "--dataset", str(data), "--prompt-field", "text", "--num-prompts",
                   "2", "--max-new-tokens", "8", "--config", "ngram@auto", "--config", "ngram@chain-2",
                   "--auto-profile", str(prof), "--no-warmup", "--no-hf-lookup", "--no-pack", "--out", str(res)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    configs = {c["name"]: c for c in json.loads(res.read_text())["configs"]}
    auto = configs["ngram/auto"]
    assert auto["tree_config"].startswith("auto(") and auto["mismatches"] == 0
    assert 0 <= auto["mean_tree_size"] <= 32 and configs["ngram/chain-2"]["mean_tree_size"] <= 2
    header = next(ln for ln in out.splitlines() if "tok/s" in ln and "nodes" in ln)
    row = next(ln for ln in out.splitlines() if ln.startswith("ngram/auto"))
    at = header.index("nodes")
    assert row[at - 2: at + 5].strip() not in ("", "-")  # the table shows the mean nodes auto chose

    rc = cli.main(["generate", "--model", lm_dir, "--draft", "ngram", "--tree", "auto", "--prompt", "Tom and",
                   "--max-new-tokens", "6", "--auto-profile", str(prof), "--no-pack"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "mean tree size" in err
    rc = cli.main(["generate", "--model", lm_dir, "--draft", "ngram", "--tree", "auto", "--prompt", "Tom",
                   "--auto-profile", str(tmp_path / "missing.json")])
    _, err = capsys.readouterr()
    assert rc == 2 and "no auto profile" in err


def test_tune_refuses_a_fixed_tree(capsys, lm_dir, tmp_path):
    from treespec import cli

    assert cli.main(["tune", "--help"]) == 0 and "--refresh-costs" in capsys.readouterr().out
    rc = cli.main(["tune", "--model", lm_dir, "--tree", "cpu", "--out", str(tmp_path / "x.json")])
    _, err = capsys.readouterr()
    assert rc == 2 and "not an auto tree" in err


# ---- the "rate" objective ---------------------------------------------------------------------


LINEAR = CostCurve((1, 2, 128), (1.0, 1.25, 32.75))  # a quarter step per extra token


def test_rate_objective_drops_the_doubtful_steps_nodes():
    """Steps of two kinds, alternating: confident (p = 0.9) and doubtful (p = 0.3) nodes, a
    quarter step per token. Each step's own ratio says verify all 8 nodes of both (0.3 > 0.25
    of the step's rate at the margin); the generation's rate R is higher than a doubtful
    step's, and a node pays only when p > R / 4, so the rate rule verifies the doubtful step's
    root alone and the whole generation is faster."""
    sure, doubt = np.full(8, 0.9), np.full(8, 0.3)
    assert best_sizes(sure, LINEAR, 0.0)[0][0] == 8 and best_sizes(doubt, LINEAR, 0.0)[0][0] == 8

    def run(rate_rule: bool) -> float:
        tokens = seconds = 0.0
        for p in [sure, doubt] * 20:
            rate = tokens / seconds if rate_rule and seconds else None
            n = int(best_sizes(p, LINEAR, 0.0, rate=rate)[0][0])
            tokens += 1 + p[:n].sum()
            seconds += float(LINEAR(1 + n))
        return tokens / seconds

    assert best_sizes(doubt, LINEAR, 0.0, rate=1.9)[0][0] == 0
    assert best_sizes(sure, LINEAR, 0.0, rate=1.9)[0][0] == 8
    assert run(True) > 1.15 * run(False)


def test_rate_objective_in_the_controller():
    """R is the tokens committed per modelled step second (draft + overhead + the curve's
    verify); None before a step ends and for the "step" objective."""
    profile = AutoProfile(costs=LINEAR, step_overhead=0.0)
    ctl = AutoController(profile, max_nodes=8, top_k=2, greedy=True, objective="rate")
    assert ctl.rate is None
    tree = Tree([-1, 0, 1], [0, 1, 2], [0.0, -0.1, -0.2])
    ctl.begin_step()
    chosen = ctl.choose([tree], propose_seconds=0.5)
    ctl.learn(chosen, [[0, 1]])  # committed 2 tokens
    ctl.end_step(chosen[0].num_nodes, 2.0)
    assert ctl.rate == pytest.approx(2 / (0.5 + float(LINEAR(chosen[0].num_nodes))))
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


@pytest.mark.filterwarnings("ignore:the model accepted none")  # the stranger's drafts: meant to fail
def test_auto_drafts_again_after_text_it_could_not_draft():
    """A profile that has just learned the draft is useless (a stretch of text it cannot
    predict: here a draft model unrelated to the target) stops drafting, as it should; but
    it must not stop for good. Steps that verify no drafted node learn nothing, so without
    fresh evidence the calibration would stay at "useless" for the rest of the process (a
    bench's prompts, a chat's turns): the Spec-Bench 480 run drafted nothing on 46
    conversation questions in a row after one such question. Idle steps let the
    calibration fade back towards the draft's own scores until the draft is tried again."""
    model, twin, stranger = tiny_model("llama", 0), tiny_model("llama", 0), tiny_model("llama", 7)
    profile = AutoProfile(costs=MID)
    for _ in range(3):  # long enough to learn that the stranger's drafts fail
        bad = treespec.generate(model, ModelDrafter(stranger), TreeConfig.auto(3, 2, 6), PROMPTS[:1],
                                max_new_tokens=100, auto_profile=profile).metrics
    assert bad.mean_accepted_length < 1.2 and bad.tree_sizes[-1] == 0  # it stopped drafting
    prompt = [5, 9, 13]
    good = treespec.generate(model, ModelDrafter(twin), TreeConfig.auto(3, 2, 6), prompt, max_new_tokens=200,
                             auto_profile=profile)
    assert good.sequences[0] == hf_greedy(model, prompt, 200)
    sizes = good.metrics.tree_sizes
    assert sizes[0] == 0  # it starts where the stranger left it ...
    assert sum(s > 0 for s in sizes[-20:]) >= 15  # ... and is drafting again by the end
    assert good.metrics.mean_accepted_length > 1.5


def test_auto_drafts_again_after_a_step_cost_it_could_not_renew():
    """The other evidence a step can stop renewing: the learned cost of each verified token
    (``step_slope``: identified only while tree sizes vary) and of one draft level
    (``level_seconds``: measured only between two levels). A slope learned while something
    else slowed the machine makes every node look dear; with the root alone every step the
    sizes never vary again, so unrenewed, the slope would keep trees empty for good. Both
    fade while unrenewed, as the calibration does on idle steps."""
    model, twin = tiny_model("llama", 0), tiny_model("llama", 0)
    profile = AutoProfile(costs=MID, step_slope=1.0, level_seconds=5.0)  # a token 4x, a level 5x a step
    prompt = [5, 9, 13]
    out = treespec.generate(model, ModelDrafter(twin), TreeConfig.auto(3, 2, 6), prompt, max_new_tokens=200,
                            auto_profile=profile)
    assert out.sequences[0] == hf_greedy(model, prompt, 200)
    sizes = out.metrics.tree_sizes
    assert sizes[0] == 0  # it starts as dear as it was told ...
    assert sum(s > 0 for s in sizes[-20:]) >= 15  # ... and is drafting again by the end
    assert profile.step_slope < 0.25 and profile.level_seconds < 1.0  # neither stayed where it was
