"""Generation options on trees (treespec.processing): each node processed with its own path
equals transformers' processors on that node's history alone; options that cannot be exact
are refused by name. The per-node choice (treespec.accept): choosing at the reached nodes alone
gives the verdict of choosing at every node; Gumbel-max noise is a function of (seed, position)
and its argmax is an exact sample."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from helpers.stats import chi_square, token_counts, token_probs
from helpers.trees import trees
from treespec import Tree
from transformers import TopPLogitsWarper

from treespec.accept import RequestDecoding, accept, gumbel_noise
from treespec.processing import NodeProcessor, SortFreeTopP, path_tokens, resolve_generation_config

VOCAB = 16


configs = st.fixed_dictionaries({}, optional={
    "repetition_penalty": st.floats(0.5, 2.0),
    "no_repeat_ngram_size": st.integers(1, 3),
    "min_new_tokens": st.integers(1, 6),
    "min_length": st.integers(1, 12),
    "bad_words_ids": st.lists(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=2), min_size=1, max_size=3),
    "sequence_bias": st.dictionaries(st.tuples(st.integers(3, VOCAB - 1)), st.floats(-3, 3), min_size=1, max_size=2),
    "suppress_tokens": st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=3),
    "begin_suppress_tokens": st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=2),
    "exponential_decay_length_penalty": st.tuples(st.integers(0, 4), st.floats(1.01, 1.5)),
    "forced_eos_token_id": st.just(2),
})


@settings(max_examples=80, deadline=None)
@given(tree=trees(max_nodes=13, vocab=VOCAB), options=configs, sample=st.booleans(), history=st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                                max_size=8), data=st.data())
def test_each_node_is_processed_with_its_own_path(vocab16_model, tree, options, sample, history, data):
    if sample:
        options.update(do_sample=True, temperature=data.draw(st.floats(0.3, 1.5)),
                       top_p=data.draw(st.floats(0.5, 1.0)), typical_p=data.draw(st.floats(0.5, 1.0)))
    cfg = resolve_generation_config(vocab16_model, GenerationConfig(max_new_tokens=8, **options))
    proc = NodeProcessor.build(vocab16_model, cfg, prompt_len=data.draw(st.integers(1, len(history))))
    logits = torch.randn(tree.num_nodes, VOCAB)
    got = proc(torch.tensor(history), logits, tree)
    for i in range(tree.num_nodes):
        path = [int(t) for t in tree.tokens[tree.attention_mask()[i]][1:]]  # root excluded
        want = proc.processors(torch.tensor([history + path]), logits[i: i + 1].clone())[0]
        assert torch.equal(got[i], want), (i, path)


@settings(max_examples=80, deadline=None)
@given(tree=trees(max_nodes=13, vocab=VOCAB), options=configs, sample=st.booleans(), history=st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                                max_size=8), data=st.data())
def test_choosing_at_reached_nodes_chooses_as_every_node_would_where_verification_looks(vocab16_model, tree, options,
                                                                                        sample, history, data):
    # Verification processes only the nodes it reaches (choose_reached_nodes); its verdict must
    # be the one from every node's choice, and each reached node's choice the same.
    if sample:
        options.update(do_sample=True, temperature=data.draw(st.floats(0.3, 1.5)), top_p=data.draw(st.floats(0.5, 1.0)))
    cfg = resolve_generation_config(vocab16_model, GenerationConfig(max_new_tokens=8, **options))
    proc = NodeProcessor.build(vocab16_model, cfg, prompt_len=data.draw(st.integers(1, len(history))))
    decoding = RequestDecoding(proc, seed=data.draw(st.integers(0, 2 ** 31)) if sample else None)
    logits = torch.randn(tree.num_nodes, VOCAB)
    parents = tree.parents.tolist()
    for i in range(1, tree.num_nodes):  # a likely child at most nodes: long accepted paths
        if data.draw(st.booleans()):
            logits[parents[i], int(tree.tokens[i])] += 4
    full = decoding.choose_all_nodes(history, logits, tree)
    lazy = decoding.choose_reached_nodes(history, logits, tree)
    reached = lazy >= 0
    verdict = accept([tree], full[None])[0]
    assert accept([tree], lazy[None])[0] == verdict
    assert torch.equal(lazy[reached], full[reached])
    assert torch.nonzero(reached).flatten().tolist() == verdict.path  # the accepted path, nothing more


@settings(max_examples=80, deadline=None)
@given(tree=trees(max_nodes=13, vocab=VOCAB), dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_plain_greedy_choice_at_reached_nodes_takes_the_first_maximum_of_each_row(vocab16_model, tree, dtype, data):
    # Greedy with no processors walks the path with an argmax of each reached row widened to
    # fp32; it must choose what the tree-wide argmax in the logits' own dtype chooses, ties
    # included (few distinct values: most rows tie at their maximum, as bf16 logits often do).
    decoding = RequestDecoding(NodeProcessor.build(vocab16_model, resolve_generation_config(
        vocab16_model, GenerationConfig(max_new_tokens=8)), prompt_len=1))
    assert not decoding.processor
    logits = torch.randint(0, 3, (tree.num_nodes, VOCAB)).to(dtype)
    parents = tree.parents.tolist()
    for i in range(1, tree.num_nodes):
        if data.draw(st.booleans()):
            logits[parents[i], int(tree.tokens[i])] = 3
    full = logits.argmax(-1)
    lazy = decoding.choose_reached_nodes([1], logits, tree)
    reached = lazy >= 0
    verdict = accept([tree], full[None])[0]
    assert accept([tree], lazy[None])[0] == verdict
    assert torch.equal(lazy[reached], full[reached])
    assert torch.nonzero(reached).flatten().tolist() == verdict.path


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(2, 3000), scale=st.floats(0.1, 30), top_p=st.floats(0.01, 1.0),
       keep=st.integers(1, 3), K=st.sampled_from([4, 64, 256]), fill=st.sampled_from([float("-inf"), -1e4]),
       data=st.data())
def test_sort_free_top_p_equals_transformers(rows, vocab, scale, top_p, keep, K, fill, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
    x = torch.randn(rows, vocab, generator=g) * scale
    if data.draw(st.booleans()):  # ties: a few logits rounded onto a coarse grid
        x = (x * 2).round() / 2
    if data.draw(st.booleans()):  # tokens an earlier processor removed
        x[:, torch.randperm(vocab, generator=g)[: vocab // 3]] = float("-inf")
    if data.draw(st.booleans()):  # a row with nothing left, and a row with one token left
        x[0] = float("-inf")
        x[-1, 1:] = float("-inf")
    ids = torch.randint(0, vocab, (rows, 5), generator=g) if data.draw(st.booleans()) else None
    want = TopPLogitsWarper(top_p, filter_value=fill, min_tokens_to_keep=keep)(ids, x.clone())
    fast = SortFreeTopP(top_p, filter_value=fill, min_tokens_to_keep=keep)
    fast.K = K
    got = fast(ids, x.clone())
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_sort_free_top_p_sorts_nothing_where_the_cut_is_clear(monkeypatch):
    x = torch.zeros(2, 49152)
    x[:, :5] = torch.tensor([20.0, 19.0, 18.5, 16.0, 13.0])  # masses .62 .23 .14 .011: the cut at 0.95 is clear
    want = TopPLogitsWarper(0.95)(None, x.clone())
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda *a: pytest.fail("sorted a clear row"))
    assert torch.equal(SortFreeTopP(0.95)(None, x.clone()), want)


def test_node_processors_use_the_sort_free_top_p(vocab16_model):
    cfg = resolve_generation_config(vocab16_model, GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9))
    procs = NodeProcessor.build(vocab16_model, cfg, prompt_len=3).processors
    assert [type(p) for p in procs if isinstance(p, TopPLogitsWarper)] == [SortFreeTopP]


def test_path_tokens_literal():
    t = Tree([-1, 0, 0, 1, 1, 3], [5, 7, 9, 11, 7, 13])
    assert path_tokens(t, torch.tensor([3, 4]), 2).tolist() == [[7, 11], [7, 7]]
    assert path_tokens(t, torch.tensor([5]), 3).tolist() == [[7, 11, 13]]
    assert path_tokens(t, torch.tensor([0]), 0).shape == (1, 0)


@pytest.mark.parametrize("option, value", [
    ("num_beams", 2), ("num_return_sequences", 2), ("guidance_scale", 1.5), ("penalty_alpha", 0.6),
    ("encoder_repetition_penalty", 1.2), ("forced_bos_token_id", 1),
])
def test_options_that_cannot_be_exact_are_refused_by_name(vocab16_model, option, value):
    with pytest.raises(ValueError, match=f"{option}=.*cannot run under speculation"):
        resolve_generation_config(vocab16_model, GenerationConfig(do_sample=True, **{option: value}))


def test_unknown_options_are_refused(vocab16_model):
    with pytest.raises(ValueError, match="unknown generation options.*not_an_option"):
        resolve_generation_config(vocab16_model, None, not_an_option=3)


def test_gumbel_noise_depends_on_seed_and_position_only():
    a = gumbel_noise(7, [3, 4, 5], 50)
    assert torch.equal(a[1:], gumbel_noise(7, [4, 5], 50))  # a position's noise alone
    assert not torch.equal(a[0], a[1]) and not torch.equal(a, gumbel_noise(8, [3, 4, 5], 50))


def test_gumbel_argmax_is_an_exact_sample():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    p = torch.softmax(logits, -1)
    n = 20000
    picks = (logits + gumbel_noise(3, range(n), 5)).argmax(-1)
    counts = torch.bincount(picks, minlength=5)
    assert counts[4] == 0  # a banned token is never drawn
    stat, threshold = chi_square(token_counts(picks), token_probs(p))
    assert stat < threshold


def test_gumbel_matching_accepts_as_much_as_rejection_sampling():
    """Against top-k drafts, accepting a child exactly when it is the target's Gumbel sample
    accepts as many tokens on average as recursive rejection sampling (each child j is taken
    with probability p(x_j) under both rules): the engine's switch costs no acceptance."""
    from helpers.rejection_sampling import verify_sampling

    torch.manual_seed(1)
    parents = [-1, 0, 0, 0, 1, 1, 4, 2]
    n, V, N = len(parents), 12, 20000
    probs = torch.softmax(torch.randn(n, V) * 2.0, -1)
    tokens, seen = [0] * n, {}
    for i in range(1, n):  # each node's children: its parent's most probable tokens, in order
        j = seen.get(parents[i], 0)
        tokens[i] = int(probs[parents[i]].argsort(descending=True)[j])
        seen[parents[i]] = j + 1
    tree = Tree(parents, tokens)
    rejection = sum(v.num_accepted for v in verify_sampling([tree] * N, probs.expand(N, n, V), torch.rand(N, 4, 4)))
    g = -torch.log(-torch.log(torch.rand(N, int(tree.depth.max()) + 1, V)))
    gumbel = sum(v.num_accepted for v in accept([tree] * N, (probs.log()[None] + g[:, tree.depth]).argmax(-1)))
    assert rejection / N > 1.0  # the drafts are good enough for the comparison to mean something
    assert abs(gumbel - rejection) / N < 0.03  # about 4 standard errors of the difference
