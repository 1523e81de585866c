"""Drafts that honour hard constraints (treespec.constraints): the tokens DraftRules bans after a
path are exactly those transformers' processors set to -inf there; pruning drops exactly the
nodes that carry one; builders fill the slots with allowed tokens; and in the engine no tree
that reaches verification holds a node the options forbid, whatever the drafter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

import treespec
from treespec.engine import loop
from helpers.tiny import tiny_model
from helpers.trees import trees
from treespec import Tree, TreeConfig
from treespec.builder import build_dynamic_trees, build_static_trees
from treespec.constraints import DraftRules, draft_constrain
from treespec.processing import NodeProcessor, resolve_generation_config

V = 16  # the vocabulary of the vocab16_model fixture
EOS = 2


hard = st.fixed_dictionaries({}, optional={
    "no_repeat_ngram_size": st.integers(1, 4),
    "min_new_tokens": st.integers(1, 6),
    "min_length": st.integers(1, 14),
    "bad_words_ids": st.lists(st.lists(st.integers(3, V - 1), min_size=1, max_size=3), min_size=1, max_size=3),
    "sequence_bias": st.dictionaries(st.lists(st.integers(3, V - 1), min_size=1, max_size=2).map(tuple),
                                     st.sampled_from([-3.0, 2.0, float("-inf")]), min_size=1, max_size=3),
    "suppress_tokens": st.lists(st.integers(3, V - 1), min_size=1, max_size=3),
    "begin_suppress_tokens": st.lists(st.integers(3, V - 1), min_size=1, max_size=2),
    "repetition_penalty": st.floats(0.5, 2.0),  # soft: bans nothing
})


def processors(model, options, prompt_len):
    cfg = resolve_generation_config(model, GenerationConfig(max_new_tokens=32, **options))
    return NodeProcessor.build(model, cfg, prompt_len).processors


def minus_inf(procs, sequence) -> set[int]:
    """What the processors themselves forbid after ``sequence``."""
    out = procs(torch.tensor([sequence]), torch.zeros(1, V))[0]
    return set(torch.nonzero(torch.isneginf(out)).flatten().tolist())


tokens = st.lists(st.integers(0, V - 1), min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(options=hard, history=tokens, more=st.lists(st.integers(0, V - 1), max_size=6),
       paths=st.lists(st.lists(st.integers(0, V - 1), max_size=5), min_size=1, max_size=4), data=st.data())
def test_banned_is_what_the_processors_set_to_minus_inf(vocab16_model, options, history, more, paths, data):
    procs = processors(vocab16_model, options, prompt_len=data.draw(st.integers(1, len(history))))
    sequence = list(history)
    rules = DraftRules.from_processors(procs, sequence)
    if rules is None:  # nothing hard among the options: the processors never ban either
        for path in paths:
            assert minus_inf(procs, history + more + path) == set()
        return
    for path in paths:
        assert rules.banned(path) == minus_inf(procs, sequence + path), (options, sequence, path)
    sequence.extend(more)  # the engine extends the list as it commits; the n-gram index follows
    for path in paths:
        assert rules.banned(path) == minus_inf(procs, sequence + path), (options, sequence, path)


def test_an_ngram_spanning_a_short_history_and_the_path(vocab16_model):
    """A history shorter than n-1: the n-gram (3, 4, 5, 6) starts in it and ends in the path."""
    procs = processors(vocab16_model, dict(no_repeat_ngram_size=4), prompt_len=1)
    rules = DraftRules.from_processors(procs, [3, 4])
    assert rules.banned([5, 6, 3, 4, 5]) == minus_inf(procs, [3, 4, 5, 6, 3, 4, 5]) == {6}


@settings(max_examples=80, deadline=None)
@given(options=hard, history=tokens, tree=trees(max_nodes=13, vocab=V))
def test_prune_keeps_exactly_the_nodes_whose_path_is_allowed(vocab16_model, options, history, tree):
    procs = processors(vocab16_model, options, prompt_len=1)
    rules = DraftRules.from_processors(procs, list(history))
    if rules is None:
        return
    mask = tree.attention_mask()
    allowed = []
    for i in range(1, tree.num_nodes):
        path = [int(t) for t in tree.tokens[mask[i]][1:]]
        if all(path[j] not in minus_inf(procs, history + path[:j]) for j in range(len(path))):
            allowed.append(path)
    pruned = rules.prune(tree)
    assert sorted(_token_paths(pruned)) == sorted(allowed)


def _token_paths(tree: Tree) -> list[list[int]]:
    mask = tree.attention_mask()
    return [[int(t) for t in tree.tokens[mask[i]][1:]] for i in range(1, tree.num_nodes)]


def _table_step(table):
    """A draft whose next-token log-probs depend on the frontier token alone."""
    return lambda f: (table[f.tokens], None)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_builders_fill_the_slots_with_allowed_tokens(vocab16_model, kind):
    torch.manual_seed(0)
    table = torch.randn(V, V).log_softmax(-1)
    history = [5, 6, 7, 5, 6]
    options = dict(no_repeat_ngram_size=2, suppress_tokens=[3, 4])
    rules = DraftRules.from_processors(processors(vocab16_model, options, 1), history)
    constrain = draft_constrain([rules])
    root = torch.tensor([6])
    if kind == "dynamic":
        cfg = TreeConfig.dynamic(top_k=3, depth=4, num_nodes=10)
        plain, = build_dynamic_trees(root, table[root], _table_step(table), cfg)
        tree, = build_dynamic_trees(root, table[root], _table_step(table), cfg, constrain=constrain)
        assert tree.num_drafted == cfg.num_nodes
    else:
        shape = TreeConfig.preset("eagle1").static_tree()
        plain, = build_static_trees(root, table[root], _table_step(table), shape)
        tree, = build_static_trees(root, table[root], _table_step(table), shape, constrain=constrain)
        assert tree.parents.tolist() == shape.parents.tolist()
    assert rules.prune(tree) is tree  # nothing left to prune: every slot holds an allowed token
    assert rules.prune(plain) is not plain  # the unconstrained draft proposes what is banned
    assert draft_constrain([None]) is None and draft_constrain(None) is None


def _drafter(kind: str, tmp_path):
    from helpers.eagle_heads import eagle3_checkpoint, eagle_target, write_head

    from treespec.drafters import HybridDrafter, ModelDrafter, NgramDrafter

    model = eagle_target("eagle3", 0, "llama")
    vocab = model.config.vocab_size
    if kind == "eagle3":  # a head with its own, smaller vocabulary: bans are mapped to its ids
        return model, treespec.load_draft(write_head(tmp_path, *eagle3_checkpoint(0)), model)
    weak = ModelDrafter(tiny_model("llama", 7, vocab=vocab, layers=1))
    return model, {"model": weak, "ngram": NgramDrafter(),
                   "hybrid": HybridDrafter(weak, NgramDrafter(max_ngram=2, max_matches=2, depth=4, num_nodes=5))}[kind]


@pytest.mark.parametrize("kind, tree", [("eagle3", "eagle1"), ("eagle3", "chain-3"), ("model", "cpu"),
                                        ("ngram", "cpu"), ("hybrid", "auto")])
def test_no_verified_tree_holds_a_forbidden_node(monkeypatch, tmp_path, kind, tree):
    model, draft = _drafter(kind, tmp_path)
    options = dict(no_repeat_ngram_size=2, bad_words_ids=[[5], [9, 10]], suppress_tokens=[4], min_new_tokens=6)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1], [2, 7, 1, 8, 2, 7, 1, 8]]
    procs = [processors(model, options | dict(eos_token_id=11), len(p)) for p in prompts]
    checked, pruned = [0], []
    draft_step, prune = loop._draft, DraftRules.prune

    def spy_draft(*args):
        trees = draft_step(*args)
        for row, t in zip(args[4], trees):  # the active requests' records
            b, r = row.index, row.rules
            for path in _token_paths(t):  # allowed after the request's history and its parent's path
                assert path[-1] not in minus_inf(procs[b], list(r.sequence) + path[:-1]), (b, path)
                checked[0] += 1
        return trees

    def spy_prune(self, t):
        out = prune(self, t)
        pruned.append(out is not t)
        return out

    monkeypatch.setattr(loop, "_draft", spy_draft)
    monkeypatch.setattr(DraftRules, "prune", spy_prune)
    out = treespec.generate(model, draft, tree, prompts, max_new_tokens=16, eos_token_id=11, **options)
    hf = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=16,
                         do_sample=False, eos_token_id=11, **options)[0, len(p):].tolist() for p in prompts]
    assert out.sequences == hf
    if kind in ("eagle3", "model"):  # the builder masked first: the engine's prune found nothing
        assert checked[0] > 0 and pruned and not any(pruned)
    else:  # prompt lookup copies seen bigrams, exactly what no_repeat_ngram_size=2 bans: pruned
        assert any(pruned)


def test_the_repetition_penalty_reaches_the_drafts_log_probs(vocab16_model):
    history = [5, 6, 7, 5]
    rules = DraftRules.from_processors(processors(vocab16_model, dict(repetition_penalty=1.5), 1), history)
    assert rules is not None and not rules.bans and rules.penalty == 1.5
    torch.manual_seed(1)
    logp = torch.randn(1, 2, V).log_softmax(-1)
    paths = torch.tensor([[[9], [3]]])
    got = draft_constrain([rules])(1, paths, logp)
    for j, path in enumerate([[9], [3]]):
        seen = torch.zeros(V, dtype=torch.bool)
        seen[history + path] = True
        want = torch.where(seen, logp[0, j] * 1.5, logp[0, j]).log_softmax(-1)
        torch.testing.assert_close(got[0, j], want)
    tree = Tree([-1, 0], [7, 5])
    assert rules.prune(tree) is tree  # a penalty bans nothing
