"""Greedy treespec output equals ``model.generate(do_sample=False)``, token for token.

The property test draws the model family and seed, a ragged batch of prompts in every
accepted input form, a tree configuration (presets, random dynamic and static trees) and a
drafter (prompt lookup, a weak one-layer draft model, an exact copy of the target), and
compares every request against Hugging Face's own greedy decoding of that prompt alone.
The other tests pin EOS handling, the metrics, restoring the attention implementation
even when generation fails, and the tree limits (budget and maximum position).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from helpers.references import hf_greedy
from helpers.tiny import dynamic_configs, model_cache, tiny_model
from treespec import AutoProfile, Tree, TreeConfig
from treespec.costs import CostCurve
from treespec.drafters.base import DraftSession, Drafter
from treespec.drafters.model import ModelDrafter
from treespec.drafters.hybrid import HybridDrafter
from treespec.drafters.ngram import NgramDrafter

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

target = model_cache()
twin = model_cache()  # the target's weights under a separate config object (so acceptance is ~100%)


@functools.lru_cache(maxsize=None)
def weak_draft(family: str, seed: int):
    return tiny_model(family, seed + 1000, layers=1)


@functools.lru_cache(maxsize=None)
def reference(family: str, seed: int, prompt: tuple[int, ...], n: int) -> list[int]:
    return hf_greedy(target(family, seed), list(prompt), n)


def make_drafter(kind: str, family: str, seed: int):
    if kind.endswith("+lookup"):  # prompt lookup grafted onto a model drafter's trees
        return HybridDrafter(make_drafter(kind[: -len("+lookup")], family, seed),
                             NgramDrafter(max_ngram=2, min_ngram=1, max_matches=2, depth=5, num_nodes=6))
    if kind == "ngram":
        return NgramDrafter()
    if kind == "weak":
        return ModelDrafter(weak_draft(family, seed))
    return ModelDrafter(twin(family, seed))


# ---- strategies ---------------------------------------------------------------------------

@st.composite
def random_static(draw):
    n = draw(st.integers(1, 7))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n + 1)]
    return TreeConfig.static(Tree(parents).to_paths())


def random_auto():
    """The "auto" presets, or auto sizing within a random dynamic maximum, either objective."""
    sized = st.tuples(dynamic_configs(max_top_k=3, max_nodes=12), st.sampled_from(["step", "rate"]))
    return st.one_of(st.sampled_from(["auto", "auto-rate"]),
                     sized.map(lambda c: TreeConfig.auto(c[0].depth, c[0].top_k, c[0].num_nodes, c[1])))


tree_configs = st.one_of(
    st.sampled_from(["chain-1", "chain-3", "cpu", "cpu-tiny", "eagle1"]),
    dynamic_configs(max_top_k=3, max_nodes=12),
    random_static(),
    random_auto(),
)

prompt_lists = st.lists(st.lists(st.integers(0, 63), min_size=1, max_size=12), min_size=1, max_size=4)


def as_input(prompts: list[list[int]], form: str):
    """The prompts in one of the input forms treespec accepts."""
    if form == "lists":
        return [list(p) for p in prompts]
    dtype = torch.int32 if form == "int32" else torch.int64
    tensors = [torch.tensor(p, dtype=dtype) for p in prompts]
    if len(tensors) == 1 and form == "int64":
        return tensors[0]  # a bare 1-D tensor is one prompt
    return tensors


# ---- greedy equality ----------------------------------------------------------------------

@settings(max_examples=24, **SETTINGS)
@given(
    family=st.sampled_from(FAMILIES),
    seed=st.integers(0, 3),
    prompts=prompt_lists,
    form=st.sampled_from(["lists", "int32", "int64"]),
    tree_cfg=tree_configs,
    drafter=st.sampled_from(["ngram", "weak", "twin", "weak+lookup", "twin+lookup"]),
    max_new=st.integers(1, 20),
    verify_cost=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_greedy_equals_hf_generate(family, seed, prompts, form, tree_cfg, drafter, max_new, verify_cost):
    model = target(family, seed)
    # "auto" chooses each step's size from a cost curve: flat (the whole tree), a quarter-ish
    # step per token (sizes vary), or a whole step per token (the root alone).
    profile = AutoProfile(costs=CostCurve((1, 2, 64), (1.0, 1.0 + verify_cost, 1.0 + 63 * verify_cost)))
    out = treespec.generate(model, make_drafter(drafter, family, seed), tree_cfg,
                            as_input(prompts, form), max_new_tokens=max_new, auto_profile=profile)
    assert len(out.sequences) == len(prompts)
    for p, seq in zip(prompts, out.sequences):
        ref = reference(family, seed, tuple(p), max_new)
        assert len(ref) == max_new  # no EOS configured: HF runs the full budget
        assert seq == ref


def test_single_prompt_forms_agree():
    """A list of ints, a 1-D tensor, a [1, L] tensor, int32 or int64: one prompt, one output."""
    model = target("llama", 1)
    p = [5, 9, 9, 2, 17, 40, 3]
    ref = reference("llama", 1, tuple(p), 12)
    forms = [p, torch.tensor(p), torch.tensor(p, dtype=torch.int32), torch.tensor([p]),
             torch.tensor([p], dtype=torch.int32)]
    for form in forms:
        out = treespec.generate(model, NgramDrafter(), "cpu-tiny", form, max_new_tokens=12)
        assert out.sequences == [ref]


def test_int32_and_int64_batches_identical():
    model = target("qwen2", 2)
    prompts = [[1, 2, 3, 1, 2], [60, 61], [7] * 11]
    outs = [
        treespec.generate(model, ModelDrafter(twin("qwen2", 2)), "cpu",
                          [torch.tensor(p, dtype=dt) for p in prompts], max_new_tokens=15).sequences
        for dt in (torch.int32, torch.int64)
    ]
    assert outs[0] == outs[1]
    assert outs[0] == [reference("qwen2", 2, tuple(p), 15) for p in prompts]


def test_2d_tensor_batch():
    """A [B, L] tensor with B > 1 is B prompts of equal length."""
    model = target("mistral", 0)
    ids = torch.tensor([[3, 4, 5, 6], [6, 5, 4, 3]])
    out = treespec.generate(model, NgramDrafter(), "chain-3", ids, max_new_tokens=9)
    assert out.sequences == [reference("mistral", 0, tuple(r), 9) for r in ids.tolist()]


# ---- EOS ------------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter", ["ngram", "twin"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eos_stops_like_hf(family, drafter):
    model = target(family, 0)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7], [33]]
    refs = [reference(family, 0, tuple(p), 20) for p in prompts]
    # An EOS id that request 0 produces at index 5 (its first occurrence or earlier).
    eos = refs[0][5]
    out = treespec.generate(model, make_drafter(drafter, family, 0), "cpu", prompts,
                            max_new_tokens=20, eos_token_id=eos)
    for p, ref, seq in zip(prompts, refs, out.sequences):
        hf = hf_greedy(model, p, 20, eos_token_id=eos, pad_token_id=0)
        expected = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert hf == expected  # sanity of the expectation itself
        assert seq == expected
    assert out.sequences[0][-1] == eos and len(out.sequences[0]) <= 6
    assert out.metrics.num_generated == sum(map(len, out.sequences))


def test_eos_list_and_generation_config():
    """Several EOS ids; and the model's generation_config.eos_token_id when none is given."""
    model = tiny_model("llama", 3)  # private copy: its generation_config is edited
    p = [4, 4, 8, 15, 16, 23, 42]
    ref = hf_greedy(model, p, 20)
    eos = [ref[7], ref[3]]
    cut = min(ref.index(e) for e in eos) + 1
    out = treespec.generate(model, NgramDrafter(), "cpu", [p], max_new_tokens=20, eos_token_id=eos)
    assert out.sequences == [ref[:cut]]
    model.generation_config.eos_token_id = ref[3]
    out = treespec.generate(model, NgramDrafter(), "cpu", [p], max_new_tokens=20)
    assert out.sequences == [ref[: ref.index(ref[3]) + 1]]
    assert out.sequences[0] == hf_greedy(model, p, 20, pad_token_id=0)


def test_eos_as_first_token():
    model = target("qwen2", 1)
    p = [10, 20, 30]
    first = reference("qwen2", 1, tuple(p), 1)[0]
    out = treespec.generate(model, NgramDrafter(), "cpu", [p, [11, 12]], max_new_tokens=10,
                            eos_token_id=first)
    assert out.sequences[0] == [first]
    ref1 = reference("qwen2", 1, (11, 12), 10)
    assert out.sequences[1] == (ref1[: ref1.index(first) + 1] if first in ref1 else ref1)


# ---- metrics --------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter,tree", [("ngram", "cpu"), ("weak", "eagle1"), ("twin", "cpu"), ("twin", "chain-3")])
def test_metrics_sanity(drafter, tree):
    model = target("llama", 0)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [50, 51, 52], [7, 7]]
    out = treespec.generate(model, make_drafter(drafter, "llama", 0), tree, prompts, max_new_tokens=20)
    m = out.metrics
    assert m.num_generated == sum(len(s) for s in out.sequences) == 60
    for r, s in zip(m.requests, out.sequences):
        assert r.num_generated == len(s)
        assert r.num_steps == len(r.accepted)
        assert 1 + sum(a + 1 for a in r.accepted) == len(s)  # prefill's token + per-step commits
    assert m.num_request_steps == sum(r.num_steps for r in m.requests)
    assert m.mean_accepted_length >= 1
    counts = m.acceptance_counts
    assert all(a >= b for a, b in zip(counts, counts[1:]))
    assert all(c <= m.num_request_steps for c in counts)
    assert all(0 <= x <= 1 for x in m.acceptance_rate_by_position)
    assert m.num_steps >= max(r.num_steps for r in m.requests)
    assert m.tree_tokens >= m.num_request_steps  # at least the root per request and step
    if drafter == "twin":
        assert m.mean_accepted_length > 2


# ---- attention implementation is restored -------------------------------------------------

class _FailingSession(DraftSession):
    def __init__(self, fail_at: int):
        self.calls, self.fail_at = 0, fail_at

    def propose(self, requests, roots, max_depth):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("drafter failed on purpose")
        return [Tree([-1], [r]) for r in roots]

    def commit(self, requests, tokens, features):
        pass


class FailingDrafter(Drafter):
    def __init__(self, fail_at: int):
        self.fail_at = fail_at

    def start(self, model, ctx):
        return _FailingSession(self.fail_at)


def test_attn_implementation_restored():
    model = target("mistral", 1)
    draft = twin("mistral", 1)
    before, before_draft = model.config._attn_implementation, draft.config._attn_implementation
    treespec.generate(model, ModelDrafter(draft), "cpu", [[1, 2, 3]], max_new_tokens=5)
    assert model.config._attn_implementation == before
    assert draft.config._attn_implementation == before_draft


@pytest.mark.parametrize("fail_at", [1, 3])
def test_attn_implementation_restored_after_failure(fail_at):
    model = target("qwen3", 1)
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="on purpose"):
        treespec.generate(model, FailingDrafter(fail_at), "cpu", [[1, 2, 3], [4]], max_new_tokens=10)
    assert model.config._attn_implementation == before
    # The model still decodes normally with its own implementation.
    assert hf_greedy(model, [1, 2, 3], 6) == reference("qwen3", 1, (1, 2, 3), 6)


def test_attn_implementation_restored_after_stream_closed_early():
    model = target("llama", 2)
    before = model.config._attn_implementation
    it = treespec.stream(model, NgramDrafter(), "cpu", [[1, 2, 3]], max_new_tokens=10)
    next(it)
    assert model.config._attn_implementation != before  # attached while the stream is open
    it.close()
    assert model.config._attn_implementation == before


def test_attn_implementation_restored_after_bad_argument():
    model = target("llama", 2)
    before = model.config._attn_implementation
    with pytest.raises(ValueError):
        treespec.generate(model, NgramDrafter(), "cpu", [[1, 2, 64]], max_new_tokens=4)
    assert model.config._attn_implementation == before


# ---- tree limits ----------------------------------------------------------------------------

class OracleDrafter(Drafter):
    """Proposes the true greedy continuation as a chain far deeper than asked, plus a wrong
    sibling at every level: the engine must prune it to the budget and position limit."""

    def __init__(self, continuation: list[int], depth: int = 40):
        self.cont, self.depth = continuation, depth
        self.max_depth_seen: list[int] = []

    def start(self, model, ctx):
        drafter = self

        class Session(DraftSession):
            def __init__(self):
                self.done = list(ctx.first_tokens[:1])

            def propose(self, requests, roots, max_depth):
                drafter.max_depth_seen.extend(max_depth)
                nxt = drafter.cont[len(self.done):][: drafter.depth]
                parents, tokens = [-1], [roots[0]]
                for i, t in enumerate(nxt):
                    chain_parent = 0 if i == 0 else len(parents) - 1  # the previous right token
                    parents += [chain_parent, chain_parent]
                    tokens += [(t + 1) % 64, t]  # wrong sibling first
                return [Tree(parents, tokens)]

            def commit(self, requests, tokens, features):
                for t in tokens:  # empty once the request is done
                    self.done.extend(t)

        return Session()


@pytest.mark.parametrize("max_new", [1, 2, 7, 19])
def test_over_deep_trees_are_cut_to_the_budget(max_new):
    model = target("llama", 0)
    p = [3, 1, 4, 1, 5]
    ref = reference("llama", 0, tuple(p), 40)
    oracle = OracleDrafter(ref)
    out = treespec.generate(model, oracle, TreeConfig.dynamic(4, 3, 30), [p], max_new_tokens=max_new)
    assert out.sequences == [ref[:max_new]]
    assert len(out.sequences[0]) == max_new
    m = out.metrics
    assert m.num_generated == max_new
    # A perfect oracle commits all it may: the 30-node cut keeps 15 levels (16 tokens a step).
    assert m.num_steps == -(-(max_new - 1) // 16)
    assert m.mean_accepted_length == (max_new - 1) / max(m.num_steps, 1) or max_new == 1
    assert all(d <= max_new - 2 for d in oracle.max_depth_seen)


@pytest.mark.parametrize("drafter", ["oracle", "ngram", "twin"])
@pytest.mark.parametrize("prompt_len,max_new", [(10, 14), (12, 12), (20, 10), (23, 5)])
def test_small_max_position_embeddings(drafter, prompt_len, max_new):
    """Near max_position_embeddings = 24 treespec feeds no position HF would not feed, and
    drafts no deeper than the last position allows; past it (RoPE has no table, so HF
    itself goes on) the output still equals HF's."""
    extra = dict(max_position_embeddings=24)
    model = target("llama", 4, **extra)
    p = [(7 * i + 3) % 64 for i in range(prompt_len)]
    seen = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(int(kwargs["position_ids"].max())), with_kwargs=True)
    try:
        ref = hf_greedy(model, p, max_new)
        seen.clear()  # only treespec's forwards from here on
        if drafter == "oracle":
            d = OracleDrafter(ref + [0] * 40)
        elif drafter == "ngram":
            d = NgramDrafter()
        else:
            d = ModelDrafter(twin("llama", 4, **extra))
        out = treespec.generate(model, d, "cpu", [p], max_new_tokens=max_new)
    finally:
        hook.remove()
    # HF feeds positions up to prompt + max_new - 2 (the last token is never fed back).
    assert max(seen) <= prompt_len + max_new - 2
    if prompt_len + max_new <= 24:
        assert max(seen) <= 23
    assert out.sequences == [ref]


# ---- stream -------------------------------------------------------------------------------

def test_stream_matches_generate():
    model = target("llama", 1)
    prompts = [[1, 2, 3, 1, 2, 3], [40], [5, 6, 7, 8]]
    eos = reference("llama", 1, (40,), 10)[4]  # request 1 ends early
    gen = treespec.generate(model, NgramDrafter(), "cpu", prompts, max_new_tokens=10, eos_token_id=eos)
    steps = list(treespec.stream(model, NgramDrafter(), "cpu", prompts, max_new_tokens=10, eos_token_id=eos))
    assert [sum((s.tokens[i] for s in steps), []) for i in range(3)] == gen.sequences
    assert steps[0].step == 0 and all(len(t) == 1 for t in steps[0].tokens)  # prefill's token
    assert [s.step for s in steps] == list(range(len(steps)))
    for i in range(3):
        flags = [s.finished[i] for s in steps]
        end = flags.index(True)
        assert all(flags[end:])  # finished stays finished ...
        assert all(not s.tokens[i] for s in steps[end + 1:])  # ... and gets no more tokens
    assert all(steps[-1].finished)
    assert len(gen.sequences[1]) <= 5 and gen.sequences[1][-1] == eos


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_size_does_not_change_output(page_size):
    model = target("qwen3", 0)
    prompts = [[9] * 7, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3]]
    out = list(treespec.stream(model, ModelDrafter(twin("qwen3", 0)), "cpu", prompts, max_new_tokens=12,
                               page_size=page_size))
    seqs = [sum((s.tokens[i] for s in out), []) for i in range(3)]
    assert seqs == [reference("qwen3", 0, tuple(p), 12) for p in prompts]
