"""Every generation option exact on trees (issue 27), and seeds that hold.

* Greedy with random GenerationConfig options (penalties, banned n-grams and words, minimum
  lengths, biases, suppressed tokens, forced EOS, length decay), random trees and drafters
  (prompt lookup, a draft model, an exact copy, an EAGLE-3 head), one prompt or a ragged
  batch: every request equals HF ``generate`` on that prompt alone with the same options.
* Sampling with penalties: the first two tokens' joint distribution against the target's
  processed one (chi-square).
* A seed fixes the sampled output across trees, drafters, ``auto``, batches and
  ``generate`` / ``stream``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList,
                                                   RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                   SuppressTokensLogitsProcessor)
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

import treespec
from helpers.stats import chi_square
from helpers.tiny import dynamic_configs, soft_model, tiny_model
from treespec import AutoProfile
from treespec.costs import CostCurve
from treespec.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from treespec.processing import NodeProcessor, exact_generation_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

V = 64
SAMPLED_V = 8  # the distribution test's vocabulary: few enough outcomes for a chi-square test
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=None)
def target(seed: int):
    return tiny_model("llama", seed, vocab=V, peak=8.0)  # soft enough that penalties change the argmax


@functools.lru_cache(maxsize=None)
def drafter(kind: str, seed: int):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "weak":
        return ModelDrafter(tiny_model("llama", seed + 1000, vocab=V, layers=1))
    if kind == "twin":
        return ModelDrafter(tiny_model("llama", seed, vocab=V, peak=8.0))
    return HybridDrafter(drafter("weak", seed), NgramDrafter(max_ngram=2, min_ngram=1, max_matches=2, depth=4,
                                                              num_nodes=5))


options = st.fixed_dictionaries({}, optional={
    "repetition_penalty": st.sampled_from([0.8, 1.1, 1.5, 2.0]),
    "no_repeat_ngram_size": st.integers(1, 3),
    "min_new_tokens": st.integers(1, 8),
    "min_length": st.integers(1, 16),  # beside min_new_tokens, that one takes precedence, as in generate
    "bad_words_ids": st.lists(st.lists(st.integers(1, V - 1), min_size=1, max_size=2), min_size=1, max_size=4),
    "sequence_bias": st.dictionaries(st.tuples(st.integers(1, V - 1)), st.sampled_from([-5.0, 3.0, 10.0]),
                                     min_size=1, max_size=3),
    "suppress_tokens": st.lists(st.integers(1, V - 1), min_size=1, max_size=4),
    "begin_suppress_tokens": st.lists(st.integers(1, V - 1), min_size=1, max_size=3),
    "exponential_decay_length_penalty": st.tuples(st.integers(0, 4), st.sampled_from([1.2, 2.0])),
    "forced_eos_token_id": st.just(7),
})


def hf(model, prompt: list[int], n: int | None, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    if n is not None:
        kw["max_new_tokens"] = n
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return out[0, len(prompt):].tolist()


@settings(max_examples=40, **SETTINGS)
@given(opts=options, eos=st.sampled_from([None, 7, [7, 9]]), kind=st.sampled_from(["ngram", "weak", "twin", "hybrid"]),
       seed=st.integers(0, 2), tree=st.one_of(st.sampled_from(["chain-3", "cpu", "eagle1"]), dynamic_configs(4, 12)),
       prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=10), min_size=1, max_size=3),
       max_new=st.integers(1, 16))
def test_greedy_with_options_equals_hf_generate(opts, eos, kind, seed, tree, prompts, max_new):
    model = target(seed)
    if eos is None and ("forced_eos_token_id" in opts or "exponential_decay_length_penalty" in opts):
        eos = 7  # both push towards an EOS, which transformers needs to know
    try:
        want = [hf(model, p, max_new, do_sample=False, eos_token_id=eos, **opts) for p in prompts]
    except ValueError as e:  # contradictory options (a forced EOS that is also suppressed): the same refusal
        with pytest.raises(ValueError, match=str(e)[:40].replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            treespec.generate(model, drafter(kind, seed), tree, prompts, max_new_tokens=max_new, eos_token_id=eos,
                              **opts)
        return
    out = treespec.generate(model, drafter(kind, seed), tree, prompts, max_new_tokens=max_new, eos_token_id=eos, **opts)
    assert out.sequences == want, opts


@pytest.mark.parametrize("opts, tree", [
    (dict(repetition_penalty=1.5, no_repeat_ngram_size=2), "cpu"),
    (dict(min_new_tokens=6, bad_words_ids=[[5], [9, 10]], sequence_bias={(3,): 4.0}), "chain-2"),
    (dict(suppress_tokens=[1, 2, 3], begin_suppress_tokens=[4], repetition_penalty=0.7), "eagle1"),
])
def test_greedy_with_options_and_an_eagle3_head(tmp_path, opts, tree):
    from helpers.eagle_heads import eagle3_checkpoint, eagle_target, write_head

    model = eagle_target("eagle3", 0, "llama")
    head = treespec.load_draft(write_head(tmp_path, *eagle3_checkpoint(0)), model)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [5]]
    out = treespec.generate(model, head, tree, prompts, max_new_tokens=12, eos_token_id=11, **opts)
    assert out.sequences == [hf(model, p, 12, do_sample=False, eos_token_id=11, **opts) for p in prompts]


def test_generation_config_is_read_as_hf_reads_it():
    model = target(0)
    gc = GenerationConfig(repetition_penalty=1.5, no_repeat_ngram_size=2, max_new_tokens=9)
    prompt = [3, 4, 5, 3, 4]
    out = treespec.generate(model, drafter("twin", 0), "cpu", prompt, generation_config=gc)
    assert out.sequences[0] == hf(model, prompt, 9, generation_config=gc, do_sample=False)
    with pytest.raises(ValueError, match="set do_sample, temperature"):
        treespec.generate(model, "ngram", "cpu", prompt, generation_config=gc, temperature=0.7)


def test_the_token_budget_is_counted_as_generate_counts_it():
    """max_new_tokens, else max_length less the prompt, from the keywords or (with a
    generation_config) from the user's and the model's generation configs, as generate reads
    them; a max_length that leaves no room is refused."""
    model = target(0)
    prompt = [3, 4, 5, 3, 4]
    assert treespec.generate(model, "ngram", "cpu", prompt, max_length=11).sequences[0] == hf(
        model, prompt, None, do_sample=False, max_length=11)
    gc = GenerationConfig(max_length=9, repetition_penalty=1.3)
    assert treespec.generate(model, "ngram", "cpu", prompt, generation_config=gc).sequences[0] == hf(
        model, prompt, None, generation_config=gc)
    model.generation_config.max_new_tokens = 5  # the model's own: read with a generation_config only
    try:
        gc = GenerationConfig(no_repeat_ngram_size=2)
        got = treespec.generate(model, "ngram", "cpu", prompt, generation_config=gc).sequences[0]
        assert got == hf(model, prompt, None, generation_config=gc) and len(got) == 5
        assert len(treespec.generate(model, "ngram", "cpu", prompt, max_length=14).sequences[0]) == 9
    finally:
        model.generation_config.max_new_tokens = None
    with pytest.raises(ValueError, match="max_length=5 leaves no room"):
        treespec.generate(model, "ngram", "cpu", prompt, max_length=5)


def test_an_eos_given_beside_a_generation_config_is_the_one_its_processors_ban():
    model = target(0)
    prompt = [3, 4, 5, 3, 4]
    eos = hf(model, prompt, 3, do_sample=False)[1]  # a token greedy decoding emits early
    gc = GenerationConfig(min_new_tokens=6, max_new_tokens=12)
    want = hf(model, prompt, None, generation_config=gc, eos_token_id=eos)
    assert eos not in want[:6]
    assert treespec.generate(model, drafter("twin", 0), "cpu", prompt, generation_config=gc,
                             eos_token_id=eos).sequences[0] == want


def test_min_new_tokens_takes_precedence_over_min_length():
    """generate counts min_length from min_new_tokens when both are given: EOS is banned for
    the new tokens only, not until min_length (found by differential fuzzing)."""
    model = tiny_model("llama", 1)
    prompt = [5, 36, 24, 5, 36]
    opts = dict(eos_token_id=9, min_new_tokens=2, min_length=12)
    want = hf(model, prompt, 10, do_sample=False, pad_token_id=0, **opts)
    assert want[-1] == 9 and len(prompt) + len(want) < 12  # an EOS that min_length alone would have banned
    assert treespec.generate(model, "ngram", "cpu", prompt, max_new_tokens=10, **opts).sequences[0] == want


class EndAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_stopping_criteria_and_max_time_end_a_request_as_in_generate():
    """A user's criterion is asked after every committed token, mid-path included; max_time
    counts from the call (a tiny one ends after the first token, as in generate)."""
    model = target(1)
    prompt = [3, 1, 4, 1, 5]
    crit = StoppingCriteriaList([EndAtLength(len(prompt) + 4)])
    want = hf(model, prompt, 12, do_sample=False, stopping_criteria=crit)
    assert len(want) == 4
    for tree in ("cpu", "chain-3"):
        assert treespec.generate(model, drafter("twin", 1), tree, prompt, max_new_tokens=12,
                                 stopping_criteria=crit).sequences[0] == want
    assert treespec.generate(model, "ngram", "cpu", prompt, max_new_tokens=12, max_time=1e-9).sequences[0] == hf(
        model, prompt, 12, do_sample=False, max_time=1e-9)
    with pytest.raises(ValueError, match="stopping_criteria holds"):
        treespec.generate(model, "ngram", "cpu", prompt, stopping_criteria=[lambda ids, scores: True])


class BanAfter(LogitsProcessor):
    """A user's processor, pure in (input_ids, scores): after token 3, token 4 is banned."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[input_ids[:, -1] == 3, 4] = -float("inf")
        return scores


def test_a_users_logits_processor_runs_per_node():
    model = target(1)
    prompts = [[3, 1, 3, 2, 3], [5, 3]]
    procs = LogitsProcessorList([BanAfter()])
    out = treespec.generate(model, drafter("twin", 1), "cpu", prompts, max_new_tokens=12, logits_processor=procs,
                            repetition_penalty=1.3)
    for p, got in zip(prompts, out.sequences):
        assert got == hf(model, p, 12, do_sample=False, logits_processor=procs, repetition_penalty=1.3)


# ---- sampling ---------------------------------------------------------------------------------


@torch.no_grad()
def processed_joint(model, prompt, n: int, stale: bool = False, **fields) -> dict:
    """P(first n tokens) from the target's distributions after the processors built from
    ``fields``: each prefix processed with its own history, or, ``stale``, with the prompt's
    alone (the bug of a tree node processed with its root's history instead of its path's)."""
    cfg = exact_generation_config(model, **fields)
    proc = NodeProcessor.build(model, cfg, len(prompt))
    joint = {(): 1.0}
    for _ in range(n):
        prefixes = [k for k, p in joint.items() if p > 0]
        ids = torch.tensor([prompt + list(k) for k in prefixes])
        seen = torch.tensor([prompt] * len(prefixes)) if stale else ids
        probs = torch.softmax(proc.processors(seen, model(ids).logits[:, -1].float()), -1).double()
        joint = {k + (t,): joint[k] * float(probs[i, t]) for i, k in enumerate(prefixes) for t in range(probs.shape[1])}
    return joint


# Tokens 6 and 7 left out, so that the penalty on them depends on each node's own path.
PENALTY_PROMPT = [0, 1, 2, 3, 4, 5, 0, 2, 4, 1, 3, 5, 0]


@pytest.mark.parametrize("tree", ["cpu", "auto"])
def test_sampling_with_penalties_has_the_processed_distribution(tree):
    model = soft_model(1, vocab=SAMPLED_V, peak=6.0)
    draft = ModelDrafter(soft_model(1, vocab=SAMPLED_V, peak=6.0, copy=1))
    N, opts = 400, dict(temperature=0.9, top_k=6, repetition_penalty=1.8, no_repeat_ngram_size=2)
    profile = AutoProfile(costs=CostCurve((1, 4096), (1.0, 1.0 + 0.001 * 4095)))
    out = treespec.generate(model, draft, tree, [PENALTY_PROMPT] * N, max_new_tokens=3, seed=123,
                            auto_profile=profile, **opts)
    assert out.metrics.acceptance_counts and out.metrics.acceptance_counts[0] > N // 10
    right = processed_joint(model, PENALTY_PROMPT, 2, do_sample=True, **opts)
    counts: dict = {}
    for s in out.sequences:
        counts[tuple(s[:2])] = counts.get(tuple(s[:2]), 0) + 1
    stat, thr = chi_square(counts, right)
    assert stat < thr, f"chi2 {stat:.1f} >= {thr:.1f}"
    # The test has teeth: the unpenalised distribution is rejected, and so is the one whose
    # second token is processed with the prompt's history instead of its own path's.
    wrong = processed_joint(model, PENALTY_PROMPT, 2, do_sample=True, temperature=0.9, top_k=6)
    assert chi_square(counts, wrong)[0] >= thr
    stale = processed_joint(model, PENALTY_PROMPT, 2, stale=True, do_sample=True, **opts)
    assert chi_square(counts, stale)[0] >= thr


# ---- seeds ------------------------------------------------------------------------------------


def test_a_seed_fixes_the_output_whatever_the_tree_drafter_and_batch():
    model = target(2)
    prompt, other = [4, 8, 15, 16, 23, 42], [1, 2, 3]
    kw = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, repetition_penalty=1.1)
    profile = AutoProfile(costs=CostCurve((1, 64), (1.0, 1.5)))
    runs = {}
    for kind in ("none", "ngram", "weak", "twin", "hybrid"):
        d = "none" if kind == "none" else drafter(kind, 2)
        for tree in ("chain-3", "cpu", "auto"):
            out = treespec.generate(model, d, tree, prompt, seed=[77], auto_profile=profile.copy(), **kw)
            runs[kind, tree] = out.sequences[0]
    # Inside a ragged batch, at another index, with its seed given per request.
    batch = treespec.generate(model, drafter("twin", 2), "cpu", [other, prompt, other[:2]], seed=[5, 77, 6], **kw)
    runs["batch"] = batch.sequences[1]
    streamed = []
    for step in treespec.stream(model, drafter("weak", 2), "chain-3", prompt, seed=[77], **kw):
        streamed.extend(step.tokens[0])
    runs["stream"] = streamed
    assert len({tuple(r) for r in runs.values()}) == 1, runs
    assert runs["batch"] != treespec.generate(model, "none", "chain-3", prompt, seed=[78], **kw).sequences[0]
    # No seed: torch's global generator decides, so torch.manual_seed repeats a run.
    torch.manual_seed(0)
    a = treespec.generate(model, "ngram", "cpu", prompt, **kw).sequences[0]
    torch.manual_seed(0)
    assert a == treespec.generate(model, drafter("twin", 2), "chain-2", prompt, **kw).sequences[0]


def test_stop_strings_end_a_request_across_token_boundaries_as_hf_does(tmp_path):
    from helpers.tiny import save_tiny_lm

    from treespec.models import load

    model, tok = load(save_tiny_lm(tmp_path / "lm", seed=3))
    prompt = tok("Lily saw a big dog.", add_special_tokens=False)["input_ids"]
    free = hf(model, prompt, 24, do_sample=False)
    text = tok.decode(free)
    stop = text[len(text) // 2: len(text) // 2 + 3]  # a piece that may straddle tokens
    want = hf(model, prompt, 24, do_sample=False, stop_strings=[stop], tokenizer=tok)
    assert len(want) < len(free)
    for d in ("ngram", ModelDrafter(load(save_tiny_lm(tmp_path / "twin", seed=3))[0])):
        got = treespec.generate(model, d, "cpu", prompt, max_new_tokens=24, stop_strings=[stop], tokenizer=tok)
        assert got.sequences[0] == want
        streamed = [t for step in treespec.stream(model, d, "chain-3", prompt, max_new_tokens=24, stop_strings=[stop],
                                                  tokenizer=tok) for t in step.tokens[0]]
        assert streamed == want
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        treespec.generate(model, "ngram", "cpu", prompt, stop_strings=["x"])


# ---- model.generate(custom_generate=...) ------------------------------------------------------


@pytest.mark.parametrize("kind", ["ngram", "twin", "hybrid"])
def test_custom_generate_is_a_drop_in_for_model_generate(kind):
    """The call a user already has, plus custom_generate: the same tensor back, padded batch
    included (left padding in, right padding out), with the same options."""
    model = target(0)
    ids = torch.tensor([[0, 0, 5, 9, 5, 9, 2], [4, 8, 15, 16, 23, 42, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=10, repetition_penalty=1.3, no_repeat_ngram_size=2,
              eos_token_id=7, pad_token_id=0, do_sample=False)
    want = model.generate(ids, **kw)
    got = model.generate(ids, custom_generate=treespec.custom_generate(drafter(kind, 0), "cpu"), **kw)
    assert torch.equal(got, want)
    gc = GenerationConfig(max_new_tokens=6, min_new_tokens=4, eos_token_id=7, pad_token_id=0, suppress_tokens=[3])
    out = model.generate(ids, attention_mask=mask, generation_config=gc, return_dict_in_generate=True,
                         custom_generate=treespec.custom_generate(drafter(kind, 0), "chain-3"))
    assert torch.equal(out.sequences, model.generate(ids, attention_mask=mask, generation_config=gc))
    with pytest.raises(ValueError, match="output_scores"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, output_scores=True, return_dict_in_generate=True,
                       custom_generate=treespec.custom_generate("ngram", "cpu"))


def test_custom_generate_keeps_the_users_processors_and_criteria_and_refuses_beams():
    """A user's processors of transformers' own types (one replacing what the config builds),
    a user's stopping criterion and max_time reach the drop-in as they reach generate; beam
    search and the rest that cannot be exact are refused, not run greedily."""
    model = target(0)
    ids = torch.tensor([[5, 9, 5, 9, 2]])
    decode = treespec.custom_generate(drafter("twin", 0), "cpu")
    procs = LogitsProcessorList([SuppressTokensLogitsProcessor([3, 7]), RepetitionPenaltyLogitsProcessor(2.0)])
    crit = StoppingCriteriaList([EndAtLength(ids.shape[1] + 7)])
    for kw in (dict(logits_processor=procs, repetition_penalty=1.1), dict(stopping_criteria=crit),
               dict(max_time=1e-9), dict(logits_processor=procs, stopping_criteria=crit, no_repeat_ngram_size=2)):
        kw = dict(max_new_tokens=10, do_sample=False, **kw)
        assert torch.equal(model.generate(ids, custom_generate=decode, **kw), model.generate(ids, **kw)), kw
    for kw in (dict(num_beams=3), dict(do_sample=True, num_return_sequences=2), dict(guidance_scale=2.0)):
        with pytest.raises(ValueError, match="cannot run under speculation"):
            model.generate(ids, max_new_tokens=4, custom_generate=decode, **kw)


def test_custom_generate_on_a_padded_batch_asks_criteria_of_the_padded_row():
    """A length criterion and a user's MaxLengthCriteria count a row's padding, as generate
    counts it; min_new_tokens counts new tokens only (it bans an EOS inside its window, no
    longer); two user processors of one type, one equal to the config's, both apply."""
    model = target(0)
    decode = treespec.custom_generate("ngram", "cpu")
    ids = torch.tensor([[0, 0, 0, 5, 9, 5], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    for crit in (EndAtLength(10), MaxLengthCriteria(11)):
        kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                  stopping_criteria=StoppingCriteriaList([crit]))
        assert torch.equal(model.generate(ids, custom_generate=decode, **kw), model.generate(ids, **kw))
    for seed in range(40):  # a row whose greedy answer has an EOS just past min_new_tokens
        g = torch.Generator().manual_seed(seed)
        short, full = torch.randint(1, V, (3,), generator=g).tolist(), torch.randint(1, V, (6,), generator=g).tolist()
        alone = hf(model, short, 12, do_sample=False)
        if alone[6] not in alone[:6]:
            break
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, min_new_tokens=6, eos_token_id=alone[6],
              pad_token_id=0)
    ids = torch.tensor([[0, 0, 0, *short], full])
    got = model.generate(ids, custom_generate=decode, **kw)
    assert torch.equal(got, model.generate(ids, **kw)) and got[0, 6:13].tolist() == alone[:7]
    bias = lambda: LogitsProcessorList([SequenceBiasLogitsProcessor({(47,): -100.0}),  # noqa: E731
                                        SequenceBiasLogitsProcessor({(20,): -100.0})])
    ids = torch.tensor([[5, 9, 5, 9, 2]])
    kw = dict(max_new_tokens=8, do_sample=False, sequence_bias={(47,): -100.0})
    assert torch.equal(model.generate(ids, custom_generate=decode, logits_processor=bias(), **kw),
                       model.generate(ids, logits_processor=bias(), **kw))


def test_custom_generate_samples_with_the_seed_torch_was_given():
    model = target(1)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    kw = dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20)
    runs = []
    for d, tree in (("ngram", "cpu"), (drafter("twin", 1), "chain-3")):
        torch.manual_seed(11)
        runs.append(model.generate(ids, custom_generate=treespec.custom_generate(d, tree), **kw))
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (1, 17)


def test_output_scores_are_the_processed_logits_generate_reports():
    """Each generated token's processed logits, as generate(output_scores=True) gives them:
    the greedy token is their argmax, and they equal HF's (fp32, a tiny model)."""
    model = target(0)
    prompt = [3, 1, 4, 1, 5, 9]
    kw = dict(repetition_penalty=1.4, no_repeat_ngram_size=2)
    out = treespec.generate(model, drafter("twin", 0), "cpu", prompt, max_new_tokens=10, output_scores=True, **kw)
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, **kw)
    assert out.sequences[0] == ref.sequences[0, len(prompt):].tolist()
    assert out.scores[0].shape == (10, V)
    torch.testing.assert_close(out.scores[0], torch.cat(ref.scores), rtol=1e-4, atol=1e-4)
    assert out.scores[0].argmax(-1).tolist() == out.sequences[0]
    steps = list(treespec.stream(model, drafter("twin", 0), "cpu", [prompt, prompt[:2]], max_new_tokens=10,
                                 output_scores=True, **kw))
    assert all(len(s.scores[i]) == len(s.tokens[i]) for s in steps for i in range(2))
    assert treespec.generate(model, "ngram", "cpu", prompt, max_new_tokens=3).scores is None
    with pytest.raises(ValueError, match="output_logits"):
        treespec.generate(model, "ngram", "cpu", prompt, output_logits=True)


def test_a_near_tie_is_judged_on_the_processed_scores():
    """bench's judge of a bf16 difference (treespec.divergence) must rank tokens as greedy did:
    after the options' processors. A case where the raw logits call it a bug and the processed
    scores a tie."""
    from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from treespec.divergence import classify_divergence

    model = target(0)
    for prompt in ([a, b, c] for a in range(V) for b in range(8) for c in range(4)):
        with torch.no_grad():
            raw = model(torch.tensor([prompt])).logits[0, -1].float()
        top = raw.topk(2)
        first, second = int(top.indices[0]), int(top.indices[1])
        if first in prompt and second not in prompt and float(top.values[1]) > 0 and float(top.values[0] - top.values[1]) > 0.5:
            break
    # The penalty that brings `first` just below `second`: a tie after processing.
    penalty = float(raw[first] / raw[second]) * (1 + 1e-6)
    proc = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty)])
    raw_judged = classify_divergence(model, prompt, [second], [first], 1e-2)
    processed = classify_divergence(model, prompt, [second], [first], 1e-2, proc)
    assert not raw_judged.near_tie and raw_judged.fp32_shortfall > 0.5
    assert processed.near_tie and processed.fp32_shortfall < 1e-3


def test_a_numpy_integer_seed_is_a_seed():
    import numpy as np

    model = target(1)
    kw = dict(max_new_tokens=8, temperature=0.9)
    want = treespec.generate(model, "ngram", "cpu", [3, 1, 4], seed=5, **kw).sequences
    assert treespec.generate(model, "ngram", "cpu", [3, 1, 4], seed=np.int64(5), **kw).sequences == want
    with pytest.raises(ValueError, match="seed must be an int or one int per request"):
        treespec.generate(model, "ngram", "cpu", [3, 1, 4], seed=0.5, **kw)
