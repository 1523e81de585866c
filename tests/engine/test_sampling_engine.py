"""Sampling through the whole engine: seeds, batch independence, the output distribution,
and the errors for options treespec cannot honour.

The distribution test runs 400 seeded requests (one batched call; every request has its
own generator, so they are independent draws) on a vocabulary-8 model and compares the
joint of the first generated tokens with the exact joint computed from the model's own
logits processed by ``SamplingParams``, which is itself checked against the distribution
HF ``generate(do_sample=True, ...)`` samples from.
"""

from __future__ import annotations


import pytest
import torch

import treespec
from helpers.stats import chi_square
from helpers.tiny import soft_model, tiny_model
from treespec import AutoProfile, SamplingParams, TreeConfig
from treespec.costs import CostCurve
from treespec.drafters.model import ModelDrafter
from treespec.drafters.hybrid import HybridDrafter
from treespec.drafters.ngram import NgramDrafter
from treespec.accept import RequestDecoding


PROMPTS = [[1, 2, 3, 4, 5], [9, 8], [20, 21, 22, 20, 21, 22, 20]]


def sample(model, draft, seed, prompts=PROMPTS, tree="cpu", n=8, **kw):
    kw.setdefault("temperature", 1.0)
    return treespec.generate(model, draft, tree, prompts, max_new_tokens=n, seed=seed, **kw).sequences


# ---- seeds ----------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_same_seed_same_output(drafter):
    model = soft_model()
    make = (lambda: NgramDrafter()) if drafter == "ngram" else (lambda: ModelDrafter(soft_model(copy=1)))
    a = sample(model, make(), seed=123, top_k=20)
    b = sample(model, make(), seed=123, top_k=20)
    assert a == b
    assert all(len(s) == 8 for s in a)


def test_different_seeds_differ():
    model = soft_model()
    outs = [tuple(map(tuple, sample(model, NgramDrafter(), seed=s))) for s in (0, 1, 2, 3)]
    assert len(set(outs)) == 4
    # Within one call the requests get seeds s, s+1, ...: equal prompts still differ.
    same = sample(model, NgramDrafter(), seed=7, prompts=[[4, 5, 6]] * 3)
    assert len({tuple(s) for s in same}) == 3


def test_unseeded_sampling_runs():
    out = sample(soft_model(), NgramDrafter(), seed=None, n=5)
    assert [len(s) for s in out] == [5, 5, 5]
    assert all(0 <= t < 64 for s in out for t in s)


@pytest.mark.parametrize("drafter,tree", [("model", "cpu-tiny"), ("ngram", "chain-3"), ("ngram", "eagle1")])
def test_request_independent_of_its_batch(drafter, tree):
    """A request's output depends only on its own seed: alone with seed s it equals its
    slot in a batch whose seed list has s there (an int seed gives request i seed + i)."""
    model = soft_model()
    draft = ModelDrafter(soft_model(copy=1)) if drafter == "model" else NgramDrafter()
    kw = dict(temperature=0.9, top_p=0.95, n=6)
    seeds = [11, 12, 33]
    batch = sample(model, draft, seed=seeds, tree=tree, **kw)
    for p, s, got in zip(PROMPTS, seeds, batch):
        assert sample(model, draft, seed=s, prompts=[p], tree=tree, **kw) == [got]
    by_int = sample(model, draft, seed=11, tree=tree, **kw)  # seeds 11, 12, 13
    assert by_int[:2] == batch[:2] and by_int[2] != batch[2]


@pytest.mark.parametrize("drafter,tree", [("model", "cpu-tiny"), ("ngram", "chain-3")])
def test_temperature_per_request(drafter, tree):
    """One temperature per request: each request of a mixed batch (greedy and two
    temperatures) equals itself decoded alone with its own temperature and seed."""
    model = soft_model()
    draft = ModelDrafter(soft_model(copy=1)) if drafter == "model" else NgramDrafter()
    temps, seeds = [0.0, 0.7, 1.3], [5, 6, 7]
    batch = sample(model, draft, seed=seeds, tree=tree, temperature=temps, top_k=20)
    for p, t, s, got in zip(PROMPTS, temps, seeds, batch):
        kw = dict(temperature=t, top_k=20) if t > 0 else dict(temperature=0.0)
        assert sample(model, draft, seed=s, prompts=[p], tree=tree, **kw) == [got]
    greedy = treespec.generate(model, NgramDrafter(), "chain-1", PROMPTS[:1], max_new_tokens=8).sequences
    assert batch[0] == greedy[0]


def test_temperature_per_request_errors():
    model = soft_model()
    with pytest.raises(ValueError, match="2 values for 3 requests"):
        sample(model, NgramDrafter(), seed=1, temperature=[0.5, 1.0])
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        sample(model, NgramDrafter(), seed=1, temperature=[0.5, -1.0, 0.0])
    with pytest.raises(ValueError, match="apply to sampling"):
        sample(model, NgramDrafter(), seed=1, temperature=[0.0, 0.0, 0.0], top_p=0.9)
    with pytest.raises(ValueError, match="one decoding mode"):
        sample(model, NgramDrafter(), seed=1, temperature=[0.0, 1.0, 1.0], tree="auto")


def test_seed_does_not_change_greedy():
    model = soft_model()
    a = treespec.generate(model, NgramDrafter(), "cpu", PROMPTS, max_new_tokens=8, seed=1).sequences
    b = treespec.generate(model, NgramDrafter(), "cpu", PROMPTS, max_new_tokens=8).sequences
    assert a == b


# ---- the output distribution ------------------------------------------------------------------

E2E_V = 8
E2E_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6, 1, 3, 5, 7, 0]  # every token has an n-gram match
E2E_PARAMS = dict(temperature=0.8, top_k=5)


@torch.no_grad()
def exact_joint(model, prompt, params: SamplingParams, n: int) -> dict:
    """P(first n generated tokens) from the model's processed next-token distributions."""
    joint = {(): 1.0}
    for _ in range(n):
        prefixes = [k for k, p in joint.items() if p > 0]
        ids = torch.tensor([prompt + list(k) for k in prefixes])
        probs = params.probs(model(ids).logits[:, -1].float()).double()  # [P, V]
        joint = {k + (t,): joint[k] * float(probs[i, t]) for i, k in enumerate(prefixes) for t in range(probs.shape[1])}
    return joint


def test_sampling_params_match_hf_generate():
    """``SamplingParams.probs`` is the distribution HF ``generate(do_sample=True)`` samples."""
    model = soft_model(1, vocab=E2E_V, peak=6.0)
    ids = torch.tensor([E2E_PROMPT])
    for kw in (E2E_PARAMS, dict(temperature=1.3, top_p=0.7), dict(temperature=0.6, min_p=0.2, top_k=6)):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=True,
                             return_dict_in_generate=True, output_scores=True, output_logits=True, **kw)
        hf = torch.softmax(out.scores[0][0].float(), -1)
        ours = SamplingParams(**kw).probs(out.logits[0][0])
        assert torch.allclose(hf, ours, atol=1e-6), kw


@pytest.mark.parametrize("drafter,tree", [("twin", "dynamic"), ("ngram", "dynamic"), ("twin", "auto"),
                                          ("twin+lookup", "dynamic"), ("twin+lookup", "auto-rate")])
def test_distribution_matches_model(drafter, tree):
    """N seeded requests, 3 new tokens each: the first verify step has a depth-1 tree, so
    token 2 is an accepted draft or a correction and token 3 often the bonus after it.
    ``auto`` verifies a part of the same tree chosen per request from its scores (the batch
    chooses jointly; here a token costs a thousandth of a step, so with 400 roots a node pays
    when p > ~0.3): choosing fewer nodes must not change the distribution."""
    model = soft_model(1, vocab=E2E_V, peak=6.0)
    twin = ModelDrafter(soft_model(1, vocab=E2E_V, peak=6.0, copy=1))
    draft = twin if drafter.startswith("twin") else NgramDrafter()
    if drafter.endswith("+lookup"):  # lookup's chains grafted on: a tree of two drafters
        draft = HybridDrafter(draft, NgramDrafter(max_ngram=2, min_ngram=1, max_matches=2, depth=3, num_nodes=4))
    N = 400
    cfg = TreeConfig.auto(3, 3, 6, objective="rate" if tree == "auto-rate" else "step") if tree.startswith("auto") \
        else TreeConfig.dynamic(3, 3, 6)
    profile = AutoProfile(costs=CostCurve((1, 4096), (1.0, 1.0 + 0.001 * 4095)))
    out = treespec.generate(model, draft, cfg, [E2E_PROMPT] * N, max_new_tokens=3,
                            seed=10_000, auto_profile=profile, **E2E_PARAMS)
    m = out.metrics
    if tree.startswith("auto"):
        assert 0 < m.mean_tree_size < 6 + draft.extra_nodes and len(set(m.tree_sizes)) > 1  # sizes were chosen, and varied
    assert m.tree_tokens > m.num_request_steps  # trees had drafted nodes ...
    assert m.acceptance_counts and m.acceptance_counts[0] > N // 10  # ... and some were accepted
    params = SamplingParams(**E2E_PARAMS)
    for n in (1, 2, 3):
        counts: dict = {}
        for s in out.sequences:
            counts[tuple(s[:n])] = counts.get(tuple(s[:n]), 0) + 1
        stat, thr = chi_square(counts, exact_joint(model, E2E_PROMPT, params, n))
        assert stat < thr, f"first {n} tokens: chi2 {stat:.1f} >= {thr:.1f}"


def test_distribution_test_has_teeth():
    """The same test rejects samples from a wrongly processed distribution: temperature 1.5
    instead of 0.8 (same support, so only the statistic can tell), top-k 4 instead of 5, or
    top-k ignored. (Temperature 1.0 instead of 0.8 is too close to catch with N = 400.)"""
    model = soft_model(1, vocab=E2E_V, peak=6.0)
    N = 400
    right = exact_joint(model, E2E_PROMPT, SamplingParams(**E2E_PARAMS), 2)
    for wrong_params in (SamplingParams(temperature=1.5, top_k=5), SamplingParams(temperature=0.8, top_k=4),
                         SamplingParams(temperature=0.8)):
        wrong = exact_joint(model, E2E_PROMPT, wrong_params, 2)
        counts = draw(wrong, N, seed=0)
        stat, thr = chi_square(counts, right)
        assert stat >= thr, wrong_params
        stat, thr = chi_square(counts, wrong)
        assert stat < thr  # and accepts them against their own distribution


def test_engine_distribution_test_has_teeth(monkeypatch):
    """The engine-level test above rejects an engine whose verification is wrong in the way
    speculative sampling goes wrong: a drafted child kept whenever the target allows it
    (processed probability above zero) instead of only when it is the target's own sample
    there. Same model, drafter, tree and N as the test it guards."""
    choose = RequestDecoding.choose_reached_nodes

    def keep_any_allowed_child(self, history, logits, tree):
        if self.greedy:
            return choose(self, history, logits, tree)
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        child = {(parents[i], tokens[i]): i for i in range(1, len(parents))}
        first = {}
        for i in range(1, len(parents)):
            first.setdefault(parents[i], i)
        out = torch.full((len(parents),), -1, dtype=torch.int64)
        h, node, path = torch.as_tensor(history, dtype=torch.int64), 0, []
        while node >= 0:
            scores = self.processor(torch.cat([h, torch.tensor(path, dtype=torch.int64)]), logits[node: node + 1].float())
            c = int(self.choose_from_scores(scores, len(h) + len(path))[0])
            if node in first and bool(torch.isfinite(scores[0, tokens[first[node]]])):
                c = tokens[first[node]]  # the bug: the draft's first child kept, sample or not
            out[node] = c
            node = child.get((node, c), -1)
            path.append(c)
        return out

    monkeypatch.setattr(RequestDecoding, "choose_reached_nodes", keep_any_allowed_child)
    model = soft_model(1, vocab=E2E_V, peak=6.0)
    N = 400
    twin = ModelDrafter(soft_model(1, vocab=E2E_V, peak=6.0, copy=1))
    out = treespec.generate(model, twin, TreeConfig.dynamic(3, 3, 6), [E2E_PROMPT] * N, max_new_tokens=3,
                            seed=10_000, **E2E_PARAMS)
    counts: dict = {}
    for s in out.sequences:
        counts[tuple(s[:2])] = counts.get(tuple(s[:2]), 0) + 1
    stat, thr = chi_square(counts, exact_joint(model, E2E_PROMPT, SamplingParams(**E2E_PARAMS), 2))
    assert stat >= thr, f"a wrong verification passed: chi2 {stat:.1f} < {thr:.1f}"


def draw(joint: dict, N: int, seed: int) -> dict:
    keys = list(joint)
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(torch.tensor([joint[k] for k in keys]), N, replacement=True, generator=g)
    counts: dict = {}
    for i in draws.tolist():
        counts[keys[i]] = counts.get(keys[i], 0) + 1
    return counts


# ---- errors ---------------------------------------------------------------------------------

def gen(**kw):
    args = dict(model=soft_model(), draft=NgramDrafter(), tree_cfg="cpu", input_ids=[[1, 2, 3]], max_new_tokens=4)
    args.update(kw)
    return treespec.generate(**args)


@pytest.mark.parametrize("option,value", [("num_beams", 2), ("logit_bias", {1: 2.0}), ("guidance_scale", 1.5),
                                          ("frequency_penalty", 0.5), ("do_sample", True), ("attention_mask", [1])])
def test_unsupported_options_raise(option, value):
    with pytest.raises(ValueError, match=option):
        gen(**{option: value})


def test_unknown_keyword_raises_type_error():
    with pytest.raises(TypeError, match="bogus"):
        gen(bogus=1)


@pytest.mark.parametrize("kw", [
    dict(temperature=-1.0),
    dict(temperature=float("nan")),
    dict(temperature=float("inf")),
    dict(temperature=1.0, top_p=0.0),
    dict(temperature=1.0, top_p=1.5),
    dict(temperature=1.0, top_k=0),
    dict(temperature=1.0, top_k=2.5),
    dict(temperature=1.0, min_p=-0.1),
    dict(temperature=0.0, top_k=5),   # top_k would be ignored by greedy decoding
    dict(temperature=0.0, top_p=0.9),
    dict(temperature=0.0, min_p=0.1),
])
def test_bad_sampling_values_raise(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
    with pytest.raises(ValueError):
        gen(**kw)


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError, match="greedy"):
        SamplingParams(0.0).probs(torch.zeros(1, 4))


def test_vocabulary_mismatch_raises():
    with pytest.raises(ValueError, match="vocabulary"):
        gen(draft=ModelDrafter(tiny_model("llama", 0, vocab=48)))


def test_draft_sharing_the_target_raises():
    model = soft_model()
    with pytest.raises(ValueError, match="target model itself"):
        gen(model=model, draft=ModelDrafter(model))


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="unknown tree preset") as err:
        gen(tree_cfg="bogus-tree")
    for name in ("chain-1", "cpu", "cpu-tiny", "eagle1", "eagle2"):
        assert name in str(err.value)


@pytest.mark.parametrize("prompt", [[1, 2, 64], [-1, 3], torch.tensor([1, 200])])
def test_token_out_of_vocabulary_raises(prompt):
    with pytest.raises(ValueError, match="vocabulary"):
        gen(input_ids=[prompt] if not isinstance(prompt, torch.Tensor) else prompt)


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(input_ids=[[1, 2], []]), "at least one token"),
    (dict(input_ids=torch.tensor([1.0, 2.0])), "integers"),
    (dict(input_ids=[]), "non-empty"),
    (dict(seed=[1, 2], input_ids=[[1], [2], [3]]), "seed"),
    (dict(draft="bogus"), "Drafter"),
    (dict(tree_cfg=3), "TreeConfig"),
])
def test_bad_arguments_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        gen(**kw)
