"""The split backend (treespec/split_attention.py) against the reference torch backend.

Split attention attends each request's committed prefix without a mask (a fused kernel that
returns its log-sum-exp), its tree block with the mask, and merges the two by their
log-sum-exps; it must give the torch backend's outputs on any planned batch: random trees and
drafter-style blocks (more keys than new tokens), ragged prefixes (none at all included), GQA,
head dims 8 and 16, fp32 and bf16, K/V read as views or gathered, sliding windows. Then the
merge alone, the fused kernel's check, the name, and greedy output through a real forward.
"""

from __future__ import annotations

import argparse
import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
import treespec.split_attention as split_attention
from helpers.caches import random_cache
from helpers.references import hf_greedy
from helpers.tiny import tiny_model
from helpers.trees import parent_arrays
from treespec import Tree
from treespec.attention import SplitBackend, TorchBackend, backend_for, get_backend, make_batch
from treespec.drafters.model import ModelDrafter
from treespec.drafters.ngram import NgramDrafter
from treespec.split_attention import fused_works, masked_attention, merge_attention

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture
def fresh_check():
    """The fused kernel's once-per-process check forgotten before and after the test."""
    fused_works.cache_clear()
    yield
    fused_works.cache_clear()


@st.composite
def tree_block(draw):
    """``(local mask [n, m], key positions past the prefix [m])`` of a random tree: its ancestor
    mask (verification, m = n), or a drafter's pass over its deepest level with the earlier
    levels as extra keys before it (m > n)."""
    tree = Tree(draw(parent_arrays(1, 12)))
    mask = tree.attention_mask()
    if draw(st.booleans()) and tree.max_depth > 0:
        last = torch.nonzero(tree.depth == tree.max_depth).flatten()
        order = torch.cat([torch.nonzero(tree.depth < tree.max_depth).flatten(), last])
        return mask[last][:, order], tree.depth[order]
    return mask, tree.depth


def split_and_torch_batches(prefixes, blocks, heads_kv, head_dim, cache_dtype, page_size, rows, seed, device="cpu"):
    """A one-layer cache of random K/V holding ``prefixes`` committed tokens per request (in one
    block of rows, read as views, or on pages handed out in a scrambled order, gathered), and the
    same forward planned for the split and the torch backend."""
    cache, seqs = random_cache(prefixes, blocks, page_size, rows, seed, heads_kv, head_dim, cache_dtype, device)
    args = (seqs, prefixes, [m for m, _ in blocks], [L + d for L, (_, d) in zip(prefixes, blocks)])
    return make_batch(cache, *args, SplitBackend()), make_batch(cache, *args, TorchBackend())


@settings(max_examples=60, **SETTINGS)
@given(prefixes=st.lists(st.integers(0, 40), min_size=1, max_size=3),
       blocks=st.lists(tree_block(), min_size=3, max_size=3),
       heads=st.sampled_from([(1, 1), (2, 2), (4, 2), (3, 1), (6, 3)]),
       head_dim=st.sampled_from([8, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       cache_fp32=st.booleans(),
       page_size=st.sampled_from([1, 4, 16]),
       rows=st.booleans(),
       window=st.sampled_from([None, None, 3, 9]),
       seed=st.integers(0, 1000))
def test_split_attends_like_torch(prefixes, blocks, heads, head_dim, dtype, cache_fp32, page_size, rows, window,
                                  seed):
    """Random batches: the split backend's outputs are the torch backend's, up to the order of fp32
    sums (bf16: both attend in fp32 on a CPU, so up to one bf16 rounding of the output)."""
    blocks = blocks[: len(prefixes)]
    H, Hkv = heads
    cache_dtype = torch.float32 if cache_fp32 else dtype
    split, ref = split_and_torch_batches(prefixes, blocks, Hkv, head_dim, cache_dtype, page_size, rows, seed)
    q = torch.randn(sum(m.shape[0] for m, _ in blocks), H, head_dim, generator=torch.Generator().manual_seed(seed))
    q = q.to(dtype)
    out = split.backend.run(split, 0, q, head_dim**-0.5, window)
    want = ref.backend.run(ref, 0, q, head_dim**-0.5, window)
    assert out.shape == q.shape and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(out, want, **tol)


def test_the_cpu_runs_the_fused_kernel(fresh_check, monkeypatch):
    """On this torch the CPU's fused kernel passes its check for every head dim the tests draw,
    and a forward runs it, for the prefix without a mask and for the tree block with one (so
    the test above covers the kernel, not only the written-out fallback)."""
    for d in (8, 16, 64):
        assert fused_works("cpu", torch.float32, d)
    calls = []
    fused = split_attention._fused
    monkeypatch.setattr(split_attention, "_fused", lambda *a: calls.append(len(a) > 4) or fused(*a))
    tree = Tree([-1, 0, 0, 1])
    split, _ = split_and_torch_batches([7], [(tree.attention_mask(), tree.depth)], 2, 8, torch.float32, 4, False, 0)
    split.backend.run(split, 0, torch.randn(4, 4, 8), 0.3)
    assert sorted(calls) == [False, True]  # the prefix, unmasked; the tree block, masked


def test_written_out_prefix_attends_like_torch(monkeypatch):
    """Where no fused kernel works, the prefix is attended written out, with the same outputs."""
    monkeypatch.setattr(split_attention, "fused_works", lambda *a: False)
    tree = Tree([-1, 0, 0, 1, 2])
    blocks = [(tree.attention_mask(), tree.depth)] * 2
    split, ref = split_and_torch_batches([20, 0], blocks, 2, 8, torch.float32, 4, False, 0)
    q = torch.randn(10, 4, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(split.backend.run(split, 0, q, 0.3), ref.backend.run(ref, 0, q, 0.3),
                               rtol=1e-5, atol=2e-6)


def test_a_fused_kernel_that_disagrees_is_not_used(monkeypatch, fresh_check, caplog):
    """The once-per-(device, dtype, head dim) check catches a kernel whose log-sum-exp is off
    (here: in base 2, not e) and one that raises; both leave the prefix written out."""
    right = split_attention._fused
    monkeypatch.setattr(split_attention, "_fused", lambda *a: (right(*a)[0], right(*a)[1] / math.log(2)))
    with caplog.at_level(logging.WARNING, logger="treespec.split_attention"):
        assert not fused_works("cpu", torch.float32, 8)
    assert "disagrees" in caplog.text

    def refuses(*a):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(split_attention, "_fused", refuses)
    assert not fused_works("cpu", torch.float32, 16)
    fused_works.cache_clear()
    monkeypatch.setattr(split_attention, "_fused", right)
    assert fused_works("cpu", torch.float32, 16)


# ---- the merge ------------------------------------------------------------------------------

def _parts(seed: int, rows: int = 5, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d, generator=g), torch.randn(rows, generator=g) * 3


def test_merging_an_empty_part_returns_the_other_exactly():
    o, lse = _parts(0)
    empty_o, empty_lse = torch.zeros_like(o), torch.full_like(lse, -math.inf)
    for out, got_lse in (merge_attention(o, lse, empty_o, empty_lse), merge_attention(empty_o, empty_lse, o, lse)):
        assert torch.equal(out, o) and torch.equal(got_lse, lse)
    out, got_lse = merge_attention(empty_o, empty_lse, empty_o, empty_lse)  # no key at all: zeros, not NaN
    assert torch.equal(out, empty_o) and torch.equal(got_lse, empty_lse)


def test_a_row_that_sees_no_key_is_an_empty_part():
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 6, 4), torch.randn(1, 6, 4)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1] = False
    out, lse = masked_attention(q, k, v, 0.5, mask)
    assert torch.equal(out[0, 0, 1], torch.zeros(4)) and lse[0, 0, 1] == -math.inf
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, 0, [0, 2]]).all()


@pytest.mark.parametrize("cut", [1, 7, 12])
def test_merged_halves_are_attention_over_the_union(cut):
    """Attention over keys 0..cut-1 and over cut..12, merged, is attention over all 13 keys
    (and its log-sum-exp theirs), whichever masks the second part carries."""
    g = torch.Generator().manual_seed(cut)
    q, k, v = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 13, 8, generator=g), torch.randn(2, 13, 8, generator=g)
    mask = torch.rand(4, 13, generator=g) < 0.6
    mask[:, :cut] = True  # the prefix: no mask
    whole, whole_lse = masked_attention(q, k, v, 0.4, mask)
    first = masked_attention(q, k[:, :cut], v[:, :cut], 0.4)
    second = masked_attention(q, k[:, cut:], v[:, cut:], 0.4, mask[:, cut:])
    out, lse = merge_attention(*first, *second)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-6)
    want = torch.softmax((q @ k.transpose(-1, -2)[:, None] * 0.4).masked_fill(~mask, -math.inf), -1) @ v[:, None]
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-6)


def test_a_new_token_that_sees_no_tree_key_sees_its_prefix():
    """A row of the local mask with no key (never in a real forward: a token sees itself): the
    CPU's fused kernel would call its log-sum-exp 0, so the row is written out, an empty part,
    and the merge gives the prefix's attention alone, as the torch backend does."""
    mask = Tree([-1, 0, 0]).attention_mask()
    mask[1] = False
    split, ref = split_and_torch_batches([9], [(mask, torch.tensor([0, 1, 1]))], 2, 8, torch.float32, 4, True, 5)
    q = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(split.backend.run(split, 0, q, 0.3), ref.backend.run(ref, 0, q, 0.3),
                               rtol=1e-5, atol=2e-6)


def test_a_request_without_prefix_is_its_tree_block():
    """L = 0: no prefix part, no merge; literally the tree block's masked softmax."""
    tree = Tree([-1, 0, 0])
    split, ref = split_and_torch_batches([0], [(tree.attention_mask(), tree.depth)], 1, 4, torch.float32, 4, False, 3)
    assert split.plan.requests[0].prefix is None
    q = torch.randn(3, 1, 4, generator=torch.Generator().manual_seed(2))
    out = split.backend.run(split, 0, q, 0.5)
    k, v = split.cache.gather(0, split.cache.span(split.seqs[0], 0, 3))
    k, v = k[:, 0], v[:, 0]  # [3, D]: the one KV head
    s = (q[:, 0] @ k.T * 0.5).masked_fill(~tree.attention_mask(), -math.inf)
    torch.testing.assert_close(out[:, 0], torch.softmax(s, -1) @ v, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref.backend.run(ref, 0, q, 0.5), rtol=1e-5, atol=1e-6)


# ---- the name -------------------------------------------------------------------------------

def test_split_is_a_backend_name():
    assert type(get_backend("split", "cpu")) is SplitBackend
    model = tiny_model("llama", 0)
    assert type(backend_for(model, "split", "cpu")) is SplitBackend
    assert backend_for(model, "split", "cpu") is backend_for(model, "split", "cpu")
    with pytest.raises(ValueError, match="unknown attention_backend 'splitt'.*'split'"):
        get_backend("splitt", "cpu")
    from treespec.cli.common import add_runtime

    parser = argparse.ArgumentParser()
    add_runtime(parser)
    assert parser.parse_args(["--backend", "split"]).backend == "split"


# ---- a real forward -------------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6], list(range(20, 40))]


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_split_greedy_output_equals_torchs_and_hf(draft):
    """A tiny llama (GQA: 4 heads over 2) through generate: the same tokens through split as
    through torch and as HF generate alone; through a draft model its trees grow level by level
    (tree blocks with more keys than new tokens) and its drafts are accepted."""
    model = tiny_model("llama", 0)

    def drafter(backend):
        return NgramDrafter() if draft == "ngram" else ModelDrafter(tiny_model("llama", 0), attention_backend=backend)

    outs = [treespec.generate(model, drafter(b), "chain-3" if draft == "model" else "cpu", PROMPTS,
                              max_new_tokens=12, attention_backend=b) for b in ("torch", "split")]
    assert outs[1].sequences == outs[0].sequences == [hf_greedy(model, p, 12) for p in PROMPTS]
    if draft == "model":
        assert outs[1].metrics.acceptance_counts and outs[1].metrics.acceptance_counts[0] > 0


def test_split_with_sliding_window_layers_equals_hf():
    """Qwen2 with layer 1 windowed (4 keys): that layer takes the written-out windowed path."""
    model = tiny_model("qwen2", 0, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    out = treespec.generate(model, NgramDrafter(), "cpu", PROMPTS[:2], max_new_tokens=12, attention_backend="split")
    assert out.sequences == [hf_greedy(model, p, 12) for p in PROMPTS[:2]]


# ---- CUDA -----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_split_on_cuda_runs_its_fused_kernel_and_attends_like_torch(dtype, fresh_check):
    """On CUDA the prefix goes through flash attention (fp16/bf16) or the memory-efficient kernel
    (fp32), each checked once against the written-out attention: the check must pass (else the
    split backend would run written out there), and a batch's outputs are the torch backend's."""
    assert fused_works(str(torch.device("cuda", torch.cuda.current_device())), dtype, 64)
    trees = [Tree([-1, 0, 0, 1, 2, 2]), Tree([-1]), Tree.chain(4)]  # 6 + 1 + 5 new tokens
    blocks = [(t.attention_mask(), t.depth) for t in trees]
    split, ref = split_and_torch_batches([300, 0, 37], blocks, 2, 64, dtype, 16, False, 0, "cuda")
    q = torch.randn(12, 8, 64, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(split.backend.run(split, 0, q, 0.125), ref.backend.run(ref, 0, q, 0.125),
                               rtol=tol, atol=tol)
