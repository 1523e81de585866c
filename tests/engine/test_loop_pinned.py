"""The decoding loop's output pinned on fixed cases: the tokens, every StepOutput of the
stream, every metrics field, and what an ``auto`` tree learned.

The values in ``loop_pinned.json`` were recorded from the loop as it stood before it was
split into stages (issue 30), so a refactor of ``treespec.engine`` that changes any token,
step or counter fails here. Times are pinned too: a fake clock advances only inside the
stages (a target forward 1 s, a draft's propose 1/4 s, its commit 1/8 s, start 1/16 s,
finish 1/32 s: binary fractions, so every sum is exact), which pins what each of
``prefill_seconds``, ``draft_seconds``, ``verify_seconds`` and ``total_seconds`` counts,
and the times an ``auto`` tree learns from.

Regenerate (only for a change meant to alter the loop's output):
``PYTHONPATH=tests python tests/engine/test_loop_pinned.py > tests/engine/loop_pinned.json``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from pathlib import Path

import pytest
import torch

import treespec
from helpers.tiny import tiny_model
from treespec import AutoProfile, TreeConfig
from treespec.costs import CostCurve
from treespec.drafters.base import DraftSession, Drafter
from treespec.drafters.eagle import EagleDrafter, EagleHead
from treespec.drafters.hybrid import HybridDrafter
from treespec.drafters.model import ModelDrafter
from treespec.drafters.ngram import NgramDrafter
from treespec.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

PINNED = Path(__file__).with_name("loop_pinned.json")
MID = CostCurve((1, 2, 128), (1.0, 1.25, 32.75))  # every extra token costs a quarter step
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [50, 51, 52], [7, 7, 9, 7, 7]]


class Clock:
    """A perf_counter that moves only when told."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _ClockedSession(DraftSession):
    def __init__(self, inner: DraftSession, clock: Clock):
        self.inner, self.clock = inner, clock

    def propose(self, requests, roots, max_depth):
        trees = self.inner.propose(requests, roots, max_depth)
        self.clock.now += 0.25
        return trees

    def commit(self, requests, tokens, features):
        self.inner.commit(requests, tokens, features)
        self.clock.now += 0.125

    def finish(self, request):
        self.inner.finish(request)
        self.clock.now += 0.03125


class Clocked(Drafter):
    """``inner`` with every session call advancing ``clock``."""

    def __init__(self, inner: Drafter, clock: Clock):
        self.inner, self.clock = inner, clock
        self.feature_layers, self.extra_nodes = inner.feature_layers, inner.extra_nodes

    def check_compatible(self, model):
        self.inner.check_compatible(model)

    def features_for(self, model):
        return self.inner.features_for(model)

    def start(self, model, ctx):
        session = self.inner.start(model, ctx)
        self.clock.now += 0.0625
        return _ClockedSession(session, self.clock)


def _eagle(model):
    torch.manual_seed(11)
    head = EagleHead.for_target(model, eagle3=False)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)
    return EagleDrafter(head, attention_backend="torch")


def _cases():
    """name -> (drafter factory(model), tree, generate kwargs, family, seed)."""
    return {
        "greedy-weak-cpu": (lambda m: ModelDrafter(tiny_model("llama", 1000, layers=1)), "cpu",
                            dict(max_new_tokens=12), "llama", 0),
        "greedy-twin-chain3-eos": (lambda m: ModelDrafter(tiny_model("qwen2", 1)), "chain-3",
                                   dict(max_new_tokens=14, eos_token_id=[36, 8]), "qwen2", 1),
        "sampling-twin-eagle1": (lambda m: ModelDrafter(tiny_model("llama", 2, peak=3.0)), "eagle1",
                                 dict(max_new_tokens=10, temperature=0.8, top_k=20, seed=3), "llama", 2),
        "mixed-ngram-cpu": (lambda m: NgramDrafter(), "cpu",
                            dict(max_new_tokens=9, temperature=[0.0, 1.0, 0.0], seed=[5, 6, 7]), "llama", 0),
        "eagle-features-cpu": (_eagle, "cpu", dict(max_new_tokens=8), "llama", 3),
        "auto-twin": (lambda m: ModelDrafter(tiny_model("llama", 0)), TreeConfig.auto(3, 2, 6),
                      dict(max_new_tokens=12), "llama", 0),
        "auto-rate-hybrid-sampling": (
            lambda m: HybridDrafter(ModelDrafter(tiny_model("llama", 0)),
                                    NgramDrafter(max_ngram=2, min_ngram=1, max_matches=2, depth=5, num_nodes=6)),
            "auto-rate", dict(max_new_tokens=10, temperature=1.0, seed=1), "llama", 0),
    }


def _metrics(m) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(m)))


def run_case(name: str, monkeypatch) -> dict:
    make, tree, kw, family, seed = _cases()[name]
    model = tiny_model(family, seed, **({"peak": 3.0} if name.startswith("sampling") else {}))
    clock = Clock()
    forward = ModelRunner.forward

    def clocked_forward(self, *a, **k):
        out = forward(self, *a, **k)
        clock.now += 1.0
        return out

    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(ModelRunner, "forward", clocked_forward)
    profile = AutoProfile(costs=MID) if isinstance(tree, TreeConfig) or tree.startswith("auto") else None
    steps = []
    for out in treespec.stream(model, Clocked(make(model), clock), tree, PROMPTS, attention_backend="torch",
                               auto_profile=profile, **kw):
        m = out.metrics
        steps.append(dict(step=out.step, tokens=out.tokens, finished=out.finished,
                          counters=[m.num_steps, m.num_generated, m.num_request_steps, m.tree_tokens],
                          seconds=[m.prefill_seconds, m.draft_seconds, m.verify_seconds, m.total_seconds]))
    result = dict(steps=steps, metrics=_metrics(m))
    if profile is not None:
        learned = profile.to_json()
        result["profile"] = {k: learned[k] for k in ("level_seconds", "step_overhead", "step_slope",
                                                      "step_moments", "greedy", "sampling", "sources")}
    return json.loads(json.dumps(result))


@pytest.mark.parametrize("name", sorted(_cases()))
def test_loop_output_is_pinned(name, monkeypatch):
    pinned = json.loads(PINNED.read_text())[name]
    got = run_case(name, monkeypatch)
    assert [s["tokens"] for s in got["steps"]] == [s["tokens"] for s in pinned["steps"]]
    assert got["steps"] == pinned["steps"]
    assert got["metrics"] == pinned["metrics"]
    assert got.get("profile") == pinned.get("profile")


def test_pinned_cases_exercise_the_loop():
    """The cases cover what the loop branches on: EOS, budgets, batches that finish apart,
    features, auto trees (with a second source), greedy, sampled and mixed batches."""
    pinned = json.loads(PINNED.read_text())
    for case in pinned.values():
        finished = [s["finished"] for s in case["steps"]]
        assert finished[-1] == [True] * len(PROMPTS)
    auto = pinned["auto-twin"]["metrics"]
    assert len(set(auto["tree_sizes"])) > 1  # auto chose different sizes
    assert pinned["auto-rate-hybrid-sampling"]["profile"]["sources"]  # the lookup's calibration learned
    eos = pinned["greedy-twin-chain3-eos"]["metrics"]["requests"]
    assert sorted(r["num_generated"] for r in eos) == [5, 6, 10]  # two ended at EOS, apart


def test_pinned_greedy_cases_are_hf_generate():
    """The pinned values are the loop's own record, so they are checked against the target's
    own ``generate`` where they can be: every greedy case's tokens, request by request (each
    prompt alone), EOS included where the request ended at one."""
    pinned = json.loads(PINNED.read_text())
    for name in ("greedy-weak-cpu", "greedy-twin-chain3-eos", "eagle-features-cpu", "auto-twin"):
        _, _, kw, family, seed = _cases()[name]
        model = tiny_model(family, seed)
        got = [[] for _ in PROMPTS]
        for step in pinned[name]["steps"]:
            for r, tokens in enumerate(step["tokens"]):
                got[r].extend(tokens)
        eos = kw.get("eos_token_id")
        for prompt, tokens in zip(PROMPTS, got):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=kw["max_new_tokens"], eos_token_id=eos, pad_token_id=0)
            assert tokens == out[0, len(prompt):].tolist(), (name, prompt)


def test_the_fixed_tree_controller_answers_as_auto_does():
    """The loop calls a fixed tree's no-op controller as it calls an AutoController."""
    from treespec.auto import AutoController
    from treespec.engine.loop import _NoAuto

    for name in ("begin_step", "choose", "learn", "end_step"):
        ours, auto = inspect.signature(getattr(_NoAuto, name)), inspect.signature(getattr(AutoController, name))
        assert list(ours.parameters) == list(auto.parameters), name
    assert callable(AutoController.stop) and callable(AutoController.candidates)
    assert _NoAuto.stop is None and _NoAuto.candidates is None  # DraftStart: no early stop
    trees = [treespec.Tree([-1, 0], [3, 4])]
    assert _NoAuto().choose(trees, 1.0) is trees


def _dump(pinned: dict) -> str:
    """JSON with one line per step and per metrics or profile field: diffs show what moved."""
    cases = []
    for name, case in pinned.items():
        parts = ['  "steps": [\n' + ",\n".join(f"   {json.dumps(s)}" for s in case["steps"]) + "\n  ]"]
        for key in ("metrics", "profile"):
            if key in case:
                fields = ",\n".join(f"   {json.dumps(k)}: {json.dumps(v)}" for k, v in case[key].items())
                parts.append(f'  "{key}": {{\n{fields}\n  }}')
        cases.append(f" {json.dumps(name)}: {{\n" + ",\n".join(parts) + "\n }")
    return "{\n" + ",\n".join(cases) + "\n}"


if __name__ == "__main__":  # print the pinned values of the loop as it is now
    mp = pytest.MonkeyPatch()
    torch.set_num_threads(1)
    out = {}
    for case in sorted(_cases()):
        out[case] = run_case(case, mp)
        mp.undo()
    print(_dump(out))
