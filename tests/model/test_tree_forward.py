"""One tree forward over the paged cache equals causal recomputation of every path.

For a prompt P already in a :class:`PagedKVCache` (page size 4, so several pages) and a
tree whose root is the next token, the logits at node i must equal the logits of the plain
model (its own attention implementation, no cache) on ``P + tokens(root .. i)`` at the
last position. Checked for random trees, for batches with ragged prefixes, for trees built
level by level (the drafter's ``extra_keys`` route), and for sliding-window attention; a
wrong mask must fail the same comparison.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from helpers.tiny import model_cache, tiny_model
from helpers.trees import trees
from treespec import Tree
from treespec.attention import TorchBackend, make_batch
from treespec.drafters.model import ModelDrafter
from treespec.kv_cache import PagedKVCache
from treespec.drafters.ngram import NgramDrafter
from treespec.mask import causal_mask
from treespec.runner import ModelRunner

V = 64
ATOL = 1e-4
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
model_of = model_cache()


@torch.no_grad()
def path_logits(model, prompt: list[int], tree: Tree) -> torch.Tensor:
    """float ``[n, V]``: node i's logits from a causal forward of ``prompt + path(i)``."""
    out = torch.empty(tree.num_nodes, model.config.vocab_size)
    tokens = tree.tokens.tolist()
    for leaf_path in tree.paths():
        ids = torch.tensor([prompt + [tokens[j] for j in leaf_path]])
        logits = model(ids).logits[0]  # [len, V]
        for d, j in enumerate(leaf_path):
            out[j] = logits[len(prompt) + d]
    return out


def prefill_prompts(runner: ModelRunner, cache, prompts: list[list[int]]) -> list[int]:
    """Prefill every prompt in one packed forward and commit it; returns the sequences."""
    seqs = [cache.add_sequence() for _ in prompts]
    runner.forward(cache, seqs, [torch.tensor(p) for p in prompts], [torch.arange(len(p)) for p in prompts],
                   [causal_mask(len(p)) for p in prompts], logits_rows=[[len(p) - 1] for p in prompts])
    for s, p in zip(seqs, prompts):
        cache.commit(s, torch.arange(len(p)))
    return seqs


def tree_forward(model, prompts, tree_list, masks=None, page_size=4):
    runner = ModelRunner(model, "torch")
    cache = runner.new_cache([len(p) + t.num_nodes for p, t in zip(prompts, tree_list)], page_size)
    with runner.attached():
        seqs = prefill_prompts(runner, cache, prompts)
        out = runner.forward(
            cache, seqs, [t.tokens for t in tree_list], [t.position_ids(len(p)) for p, t in zip(prompts, tree_list)],
            masks if masks is not None else [t.attention_mask() for t in tree_list],
        )
    assert cache.seq_lens == [len(p) for p in prompts]  # a forward commits nothing
    return out.logits


# ---- single request -----------------------------------------------------------------------

@settings(max_examples=15, **SETTINGS)
@given(family=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]),
       prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=14),
       tree=trees(max_nodes=12, vocab=V))
def test_tree_logits_equal_path_recomputation(family, prompt, tree):
    model = model_of(family)
    got = tree_forward(model, [prompt], [tree])[0]
    assert got.shape == (tree.num_nodes, V)
    want = path_logits(model, prompt, tree)
    assert (got - want).abs().max() < ATOL


BRANCHY = Tree([-1, 0, 0, 1, 2, 1, 4], [5, 6, 7, 8, 9, 10, 11])  # two branches under the root


@pytest.mark.parametrize("wrong", ["all_ones", "causal"])
def test_wrong_mask_fails_the_comparison(wrong):
    """The comparison has teeth: attending to siblings (a full or a plain causal mask
    instead of the ancestor mask) changes the logits by far more than the tolerance."""
    model = model_of("llama")
    prompt = [1, 2, 3, 4, 5, 6]
    n = BRANCHY.num_nodes
    mask = torch.ones(n, n, dtype=torch.bool) if wrong == "all_ones" else causal_mask(n)
    want = path_logits(model, prompt, BRANCHY)
    right = tree_forward(model, [prompt], [BRANCHY])[0]
    bad = tree_forward(model, [prompt], [BRANCHY], masks=[mask])[0]
    assert (right - want).abs().max() < ATOL
    assert (bad - want).abs().max() > 1e-1
    # A causal mask equals the ancestor mask on rows 0 and 1 only (node 2 would see node 1).
    if wrong == "causal":
        assert (bad[[0, 1]] - want[[0, 1]]).abs().max() < ATOL


def test_wrong_positions_fail_the_comparison():
    """RoPE positions must be prefix + depth, not prefix + node index."""
    model = model_of("qwen2")
    prompt = [9, 8, 7, 6, 5]
    runner = ModelRunner(model, "torch")
    cache = runner.new_cache([len(prompt) + BRANCHY.num_nodes], 4)
    with runner.attached():
        seqs = prefill_prompts(runner, cache, [prompt])
        out = runner.forward(cache, seqs, [BRANCHY.tokens], [len(prompt) + torch.arange(BRANCHY.num_nodes)],
                             [BRANCHY.attention_mask()])
    assert (out.logits[0] - path_logits(model, prompt, BRANCHY)).abs().max() > 100 * ATOL


# ---- batches ------------------------------------------------------------------------------

@settings(max_examples=10, **SETTINGS)
@given(family=st.sampled_from(["llama", "qwen3", "mistral"]),
       prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=13), min_size=2, max_size=3),
       tree_list=st.lists(trees(max_nodes=12, vocab=V), min_size=3, max_size=3),
       page_size=st.sampled_from([1, 4, 16]))
def test_batched_tree_forward(family, prompts, tree_list, page_size):
    """Several requests with different prefix lengths and trees in one packed forward."""
    model = model_of(family)
    tree_list = tree_list[: len(prompts)]
    got = tree_forward(model, prompts, tree_list, page_size=page_size)
    for p, t, g in zip(prompts, tree_list, got):
        assert (g - path_logits(model, p, t)).abs().max() < ATOL


def test_tree_built_level_by_level_with_extra_keys():
    """A drafter's route: level d is forwarded after levels < d are already in the cache
    (uncommitted), seeing them through ``extra_keys``; logits equal the one-shot forward."""
    model = model_of("llama", 1)
    tree = Tree([-1, 0, 0, 1, 1, 2, 3, 5], [3, 10, 11, 12, 13, 14, 15, 16])
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 4]]
    runner = ModelRunner(model, "torch")
    cache = runner.new_cache([len(p) + tree.num_nodes for p in prompts], 4)
    anc = tree.attention_mask()
    got = [torch.empty(tree.num_nodes, V) for _ in prompts]
    with runner.attached():
        seqs = prefill_prompts(runner, cache, prompts)
        for d in range(tree.max_depth + 1):
            done = torch.nonzero(tree.depth < d).flatten()
            new = torch.nonzero(tree.depth == d).flatten()
            cols = torch.cat([done, new])  # cache order after the prefix: earlier levels, then new
            out = runner.forward(
                cache, seqs, [tree.tokens[new]] * len(prompts),
                [len(p) + tree.depth[new] for p in prompts], [anc[new][:, cols]] * len(prompts),
                extra_keys=[len(p) + tree.depth[done] for p in prompts],
            )
            for b in range(len(prompts)):
                got[b][new] = out.logits[b]
    for p, g in zip(prompts, got):
        assert (g - path_logits(model, p, tree)).abs().max() < ATOL


# ---- sliding window -----------------------------------------------------------------------

SW = dict(sliding_window=4)


@settings(max_examples=8, **SETTINGS)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=12), tree=trees(max_nodes=12, vocab=V))
def test_sliding_window_tree_logits(prompt, tree):
    """Mistral with a 4-token window: the torch backend's windowed tree mask equals HF's
    own sliding-window causal attention on each path."""
    model = model_of("mistral", 0, **SW)
    assert model.config.sliding_window == 4
    got = tree_forward(model, [prompt], [tree])[0]
    assert (got - path_logits(model, prompt, tree)).abs().max() < ATOL


def test_sliding_window_matters():
    """The window changes the logits of a long path (so the test above has teeth)."""
    prompt = list(range(10))
    tree = Tree.chain(3, [10, 11, 12, 13])
    windowed = path_logits(model_of("mistral", 0, **SW), prompt, tree)
    full = path_logits(model_of("mistral", 0), prompt, tree)
    assert (windowed - full).abs().max() > 1e-1


@pytest.mark.parametrize("tree_cfg", ["cpu", "chain-3", "eagle1"])
def test_sliding_window_greedy_equals_hf(tree_cfg):
    model = model_of("mistral", 0, **SW)
    draft = tiny_model("mistral", 0, **SW)  # same weights, separate config
    prompts = [[5, 3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [1]]
    for d in (NgramDrafter(), ModelDrafter(draft)):
        out = treespec.generate(model, d, tree_cfg, prompts, max_new_tokens=16)
        for p, seq in zip(prompts, out.sequences):
            ids = torch.tensor([p])
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
            assert seq == ref[0, len(p):].tolist()


def test_torch_backend_window_mask_by_hand():
    """The mask TorchBackend applies for a window: a hand-built one over key positions."""
    cache = PagedKVCache(1, 1, 4, num_pages=8, page_size=4)
    seq = cache.add_sequence()
    L = 6
    tree = Tree([-1, 0, 0, 1, 3], [1, 2, 3, 4, 5])
    cache.reserve(seq, L)
    cache.commit(seq, torch.arange(L))  # an (empty) committed prefix of L tokens
    backend = TorchBackend()
    batch = make_batch(cache, [seq], [L], [tree.attention_mask()], [tree.position_ids(L)], backend)
    # Keys: distinct one-hot values so the output reveals which keys each query attended.
    H, D = 1, 4
    kv = L + tree.num_nodes
    fk, fv = cache.flat(0)
    slots = cache.span(seq, 0, kv)
    fk[slots] = 0.0  # equal scores: softmax is uniform over the visible keys
    fv[slots] = torch.arange(kv, dtype=torch.float32)[:, None, None].expand(kv, 1, D)
    q = torch.zeros(tree.num_nodes, H, D)
    out = backend.run(batch, 0, q, 1.0, sliding_window=3)[:, 0, 0]  # mean visible key index
    kpos = torch.cat([torch.arange(L), tree.position_ids(L)])
    qpos = tree.position_ids(L)
    full = torch.cat([torch.ones(tree.num_nodes, L, dtype=torch.bool), tree.attention_mask()], 1)
    hand = full & (qpos[:, None] - kpos[None, :] < 3) & (kpos[None, :] <= qpos[:, None])
    want = (hand.float() * torch.arange(kv)).sum(1) / hand.sum(1)
    assert torch.allclose(out, want, atol=1e-5)
    no_window = backend.run(batch, 0, q, 1.0)[:, 0, 0]
    assert not torch.allclose(no_window, want, atol=1e-3)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_mixed_sliding_and_full_layers_greedy_equals_hf(family):
    """Qwen's per-layer windows (layer 0 full, layer 1 sliding): each layer gets its own."""
    kw = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model = model_of(family, 0, **kw)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    prompts = [[5, 3, 1, 4, 1, 5, 9, 2, 6], [2, 7]]
    out = treespec.generate(model, NgramDrafter(), "cpu", prompts, max_new_tokens=16)
    for p, seq in zip(prompts, out.sequences):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert seq == ref[0, len(p):].tolist()
    full = model_of(family, 0)
    ids = torch.tensor([prompts[0]])
    assert full.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                         do_sample=False)[0, 9:].tolist() != out.sequences[0]  # the window matters
