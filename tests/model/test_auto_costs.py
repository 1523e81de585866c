"""What a verify forward costs here: the cost curve, its fit and its cache (keys, a longer curve
serving a shorter one, a profile's curve from another setting replaced), and the first-use
measurement on a fake clock (it stops at its budget; a noisy curve stays off the disk; a cached
curve the steps contradict is measured again)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import treespec
from helpers.cost_curves import MID
from helpers.tiny import tiny_model
from treespec import AutoProfile
from treespec import costs as costs_mod
from treespec.auto import AutoController
from treespec.costs import CostCurve, cached_cost_curve, cost_key, measure_cost_curve
from treespec.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


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


def test_a_compiled_verify_is_priced_by_its_bucket(monkeypatch, tmp_path):
    """The compiled fixed-shape verify's curve: each bucket up to the one of ``max_tokens`` timed
    (a clock that charges what the bucket's forward costs), every tree size priced at its
    bucket's time; kept under a key of its own, beside today's forward's curve."""
    from treespec.fixed_shape import FixedShapeVerify, bucket_for, fixed_row_tokens

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    runner = ModelRunner(tiny_model("llama", 0))
    cache, seqs = runner.new_rows_cache(1, fixed_row_tokens(140, 16, True), 4)
    fixed = FixedShapeVerify(runner, cache, seqs)
    charged = {1: 2.0, 4: 3.0, 8: 5.0, 16: 6.0}
    now = [0.0]
    real_forward = fixed.forward

    def forward(seqs, trees, cached, capture=False):  # every forward advances the clock by its bucket's price
        now[0] += charged[bucket_for(trees[0].num_nodes)]
        return real_forward(seqs, trees, cached, capture)

    monkeypatch.setattr(fixed, "forward", forward)
    with runner.attached():
        curve = costs_mod.measure_fixed_cost_curve(fixed, 9, repeats=2, clock=lambda: now[0])
    assert curve.tokens == (1, 2, 4, 5, 8, 9, 16)
    assert [float(curve(q)) for q in range(1, 17)] == [2.0] + [3.0] * 3 + [5.0] * 4 + [6.0] * 8
    assert cache.seq_lens[seqs[0]] == 0  # nothing of the measurement stays committed
    key = cost_key(runner, fixed)
    assert key["verify"] == "compiled" and key["rows"] == 1
    assert key["kernels"] == "aten"  # eager here; compiled on a CPU: "inductor-gemm", a curve of its own
    assert key["accept"] is False  # acceptance inside the forward (greedy runs) is a curve of its own too
    assert {k: v for k, v in key.items() if k not in ("verify", "rows", "kernels", "accept")} == cost_key(runner)
    fixed.accepts = True
    assert cost_key(runner, fixed)["accept"] is True


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
