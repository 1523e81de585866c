"""Cost-aware trees (``auto``) through the engine: the metrics record the sizes chosen, a profile
learns across calls (greedy and sampling apart), a run without a profile measures once per
process, a head's own calibration is where auto starts, and auto drafts again after text or a
step cost it could not renew. Every output is HF generate's.

Cost curves are synthetic (``helpers/cost_curves.py``) where the rule must act on known inputs."""

from __future__ import annotations

import numpy as np
import pytest

import treespec
from helpers.cost_curves import FLAT, MID, STEEP
from helpers.references import hf_greedy
from helpers.tiny import tiny_model
from treespec import AutoProfile, TreeConfig
from treespec import costs as costs_mod
from treespec.calibration import Calibration
from treespec.costs import CostCurve, cached_cost_curve
from treespec.drafters import ModelDrafter, NgramDrafter
from treespec.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


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
