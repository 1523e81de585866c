"""Attention backends: FlashInfer's plan arguments against the reference torch plan, backend
selection, and (on a CUDA machine with flashinfer) the two backends' logits side by side.

``flashinfer_plan_args`` is pure index arithmetic, so it is checked on the CPU: its page
table (``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``) must address exactly the slots
the torch backend gathers, and its flattened custom mask must be the torch backend's
dense mask, request by request.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from tiny import tiny_model
from treespec import Tree
from treespec.attention import TorchBackend, flashinfer_plan_args, get_backend, make_batch
from treespec.drafters.ngram import NgramDrafter
from treespec.kv_cache import PagedKVCache
from treespec.mask import causal_mask, flat_batch_mask
from treespec.runner import ModelRunner

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def local_mask(draw):
    """A tree's ancestor mask, or (drafter route) the rows of its last level over all of it."""
    n = draw(st.integers(1, 8))
    tree = Tree([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)])
    mask = tree.attention_mask()
    if draw(st.booleans()) and tree.max_depth > 0:
        last = torch.nonzero(tree.depth == tree.max_depth).flatten()
        order = torch.cat([torch.nonzero(tree.depth < tree.max_depth).flatten(), last])
        return mask[last][:, order], tree.depth[order]  # [n_last, n]
    return mask, tree.depth


def build_batch(prefixes, masks, page_size, shuffle_seed):
    """A cache whose sequences hold ``prefixes`` committed tokens, pages handed out in a
    scrambled order (so page tables are not contiguous), and one planned torch batch."""
    total_pages = sum(-(-(L + m.shape[1]) // page_size) for L, (m, _) in zip(prefixes, masks)) + 3
    cache = PagedKVCache(1, 1, 2, total_pages, page_size)
    g = torch.Generator().manual_seed(shuffle_seed)
    cache._free = torch.randperm(total_pages, generator=g).tolist()
    seqs = []
    for L in prefixes:
        s = cache.add_sequence()
        cache.reserve(s, L)
        cache.commit(s, torch.arange(L))
        seqs.append(s)
    key_pos = [L + d for L, (_, d) in zip(prefixes, masks)]
    batch = make_batch(cache, seqs, prefixes, [m for m, _ in masks], key_pos, TorchBackend())
    return cache, batch


@settings(max_examples=40, **SETTINGS)
@given(prefixes=st.lists(st.integers(0, 13), min_size=1, max_size=4),
       masks=st.lists(local_mask(), min_size=4, max_size=4),
       page_size=st.sampled_from([1, 4, 5]),
       shuffle_seed=st.integers(0, 1000))
def test_flashinfer_plan_args_match_torch_plan(prefixes, masks, page_size, shuffle_seed):
    masks = masks[: len(prefixes)]
    cache, batch = build_batch(prefixes, masks, page_size, shuffle_seed)
    plan = batch.plan
    args = flashinfer_plan_args(batch)
    gather = _index(plan.gather_slots)
    if isinstance(plan.gather_slots, slice):  # one request on consecutive slots: read as a view
        assert len(prefixes) == 1
        gather = gather[None]
    for t in (args.qo_indptr, args.kv_indptr, args.kv_indices, args.kv_last_page_len):
        assert t.dtype == torch.int32
    n = [m.shape[0] for m, _ in masks]
    kv = [L + m.shape[1] for L, (m, _) in zip(prefixes, masks)]
    assert args.qo_indptr.tolist() == [0] + torch.tensor(n).cumsum(0).tolist()
    assert batch.kv_lens.tolist() == kv
    off = 0
    for b in range(len(prefixes)):
        pages = args.kv_indices[args.kv_indptr[b]: args.kv_indptr[b + 1]].tolist()
        last = int(args.kv_last_page_len[b])
        assert 1 <= last <= page_size
        assert len(pages) == -(-kv[b] // page_size)
        slots = [p * page_size + o for p in pages[:-1] for o in range(page_size)]
        slots += [pages[-1] * page_size + o for o in range(last)]
        assert slots == gather[b, : kv[b]].tolist()
        block = args.custom_mask[off: off + n[b] * kv[b]].reshape(n[b], kv[b])
        assert torch.equal(block, plan.mask[b, 0, : n[b], : kv[b]].cpu())
        off += n[b] * kv[b]
    assert off == args.custom_mask.numel()
    # The new tokens' write slots are the last n_b slots of each request's span.
    want = torch.cat([gather[b, kv[b] - n[b]: kv[b]] for b in range(len(prefixes))])
    assert torch.equal(_index(batch.write_slots), want)


def _index(slots):
    """A slot index as a tensor (the plan keeps consecutive slots as a slice)."""
    return torch.arange(slots.start, slots.stop) if isinstance(slots, slice) else slots


def test_consecutive_slots_become_slices():
    from treespec.kv_cache import as_slice

    assert as_slice(torch.tensor([4, 5, 6])) == slice(4, 7)
    assert as_slice(torch.tensor([9])) == slice(9, 10)
    for t in (torch.tensor([4, 6, 7]), torch.tensor([3, 2, 4]), torch.tensor([], dtype=torch.int64),
              torch.tensor([[1, 2]])):
        assert as_slice(t) is t


def test_plan_args_agree_with_flat_batch_mask():
    """For square (verification) masks, the flat mask and its indptrs equal mask.py's."""
    trees = [Tree([-1, 0, 0, 1]), Tree([-1]), Tree([-1, 0, 1, 1, 0])]
    prefixes = [5, 0, 9]
    masks = [(t.attention_mask(), t.depth) for t in trees]
    _, batch = build_batch(prefixes, masks, 4, 0)
    args = flashinfer_plan_args(batch)
    flat = flat_batch_mask([m for m, _ in masks], prefixes)
    assert torch.equal(args.custom_mask, flat.mask)
    assert torch.equal(args.qo_indptr, flat.qo_indptr)
    assert batch.kv_lens.tolist() == flat.kv_lens.tolist()


def test_plan_args_literal():
    """Two requests, page size 4, pages handed out in order: a literal expectation."""
    cache = PagedKVCache(1, 1, 2, num_pages=8, page_size=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 5)
    cache.commit(a, torch.arange(5))  # a: pages [0, 1]
    cache.reserve(b, 2)
    cache.commit(b, torch.arange(2))  # b: page [2]
    tree = Tree([-1, 0, 0])  # root + two children
    batch = make_batch(cache, [a, b], [5, 2], [tree.attention_mask(), causal_mask(1)],
                       [5 + tree.depth, torch.tensor([2])], TorchBackend())
    args = flashinfer_plan_args(batch)
    assert args.qo_indptr.tolist() == [0, 3, 4]
    assert args.kv_indptr.tolist() == [0, 2, 3]   # a: 8 tokens in 2 pages, b: 3 in 1
    assert args.kv_indices.tolist() == [0, 1, 2]
    assert args.kv_last_page_len.tolist() == [4, 3]
    T, F = True, False
    want_a = [[T] * 5 + [T, F, F], [T] * 5 + [T, T, F], [T] * 5 + [T, F, T]]
    want_b = [[T, T, T]]
    assert args.custom_mask.tolist() == sum(want_a, []) + sum(want_b, [])


# ---- backend selection ----------------------------------------------------------------------

def test_get_backend():
    assert isinstance(get_backend("torch", "cpu"), TorchBackend)
    assert isinstance(get_backend("auto", "cpu"), TorchBackend)
    with pytest.raises(ValueError, match="CUDA"):
        get_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="unknown attention_backend"):
        get_backend("bogus", "cpu")


def test_flashinfer_on_cpu_model_raises_and_restores():
    model = tiny_model("llama", 0)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="CUDA"):
        ModelRunner(model, "flashinfer")
    with pytest.raises(ValueError, match="CUDA"):
        treespec.generate(model, NgramDrafter(), "cpu", [[1, 2, 3]], max_new_tokens=3, attention_backend="flashinfer")
    with pytest.raises(ValueError, match="unknown attention_backend"):
        treespec.generate(model, NgramDrafter(), "cpu", [[1, 2, 3]], max_new_tokens=3, attention_backend="bogus")
    assert model.config._attn_implementation == before


# ---- CUDA -----------------------------------------------------------------------------------

def _flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


def _tree_logits(runner, prompts, trees, page_size):
    cache = runner.new_cache([len(p) + t.num_nodes for p, t in zip(prompts, trees)], page_size)
    seqs = [cache.add_sequence() for _ in prompts]
    dev = runner.device
    with runner.attached():
        runner.forward(cache, seqs, [torch.tensor(p, device=dev) for p in prompts],
                       [torch.arange(len(p)) for p in prompts], [causal_mask(len(p)) for p in prompts],
                       logits_rows=[[len(p) - 1] for p in prompts])
        for s, p in zip(seqs, prompts):
            cache.commit(s, torch.arange(len(p)))
        out = runner.forward(cache, seqs, [t.tokens.to(dev) for t in trees],
                             [t.position_ids(len(p)) for p, t in zip(prompts, trees)],
                             [t.attention_mask() for t in trees])
    return [l.float().cpu() for l in out.logits]


@pytest.mark.cuda
@pytest.mark.skipif(not _flashinfer_importable(), reason="needs flashinfer: pip install 'treespec[cuda]'")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("page_size", [4, 16])
def test_flashinfer_matches_torch_backend_fp16(page_size):
    model = tiny_model("llama", 0, peak=1.0).to("cuda", torch.float16)  # logits O(1): atol means something
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6], list(range(20, 40))]
    trees = [Tree([-1, 0, 0, 1, 1, 2, 5], [3, 4, 5, 6, 7, 8, 9]), Tree([-1], [1]), Tree.chain(4, [9, 8, 7, 6, 5])]
    ref = _tree_logits(ModelRunner(model, "torch"), prompts, trees, page_size)
    fi = _tree_logits(ModelRunner(model, "flashinfer"), prompts, trees, page_size)
    for r, f in zip(ref, fi):
        assert r.shape == f.shape
        assert (r - f).abs().max() < 1e-2
    # Greedy generation agrees between the backends (peaked logits: no fp16 near-ties).
    peaked = tiny_model("llama", 0).to("cuda", torch.float16)
    outs = [treespec.generate(peaked, NgramDrafter(), "cpu", prompts, max_new_tokens=16, attention_backend=b).sequences
            for b in ("torch", "flashinfer")]
    assert outs[0] == outs[1]
    assert all(len(s) == 16 for s in outs[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_cache_keeps_half_precision_kv_in_fp32_with_identical_logits(dtype):
    """A bf16/fp16 model's K/V are kept in fp32 on a CPU (the torch backend attends in fp32):
    the values are exact, so prefill and a tree forward give the logits a cache of the
    model's own dtype gives, bit for bit."""
    model = tiny_model("llama", seed=3).to(dtype)
    runner = ModelRunner(model, "torch")
    prompt = torch.tensor([1, 5, 9, 3, 7, 5, 9, 2, 4])
    tree = Tree([-1, 0, 0, 1, 1, 2], torch.tensor([7, 3, 8, 11, 2, 5]))
    logits = {}
    for kept in (None, dtype):
        cache = runner.new_cache([32])
        if kept is not None:  # the same cache in the model's own dtype
            cache.k = [k.to(kept) for k in cache.k]
            cache.v = [v.to(kept) for v in cache.v]
        else:
            assert cache.k[0].dtype == torch.float32
        seq = cache.add_sequence()
        with runner.attached():
            pre = runner.forward(cache, [seq], [prompt], [torch.arange(9)], [causal_mask(9)])
            cache.commit(seq, torch.arange(9))
            out = runner.forward(cache, [seq], [tree.tokens], [tree.position_ids(9)], [tree.attention_mask()])
        logits[kept] = torch.cat([pre.logits[0], out.logits[0]])
    assert torch.equal(logits[None], logits[dtype])


@settings(max_examples=40, **SETTINGS)
@given(prefixes=st.lists(st.integers(0, 13), min_size=2, max_size=5),
       masks=st.lists(local_mask(), min_size=5, max_size=5),
       active=st.lists(st.booleans(), min_size=5, max_size=5),
       page_size=st.sampled_from([1, 4, 5]),
       window=st.sampled_from([None, 3]),
       seed=st.integers(0, 1000))
def test_block_view_attends_like_the_gather(prefixes, masks, active, page_size, window, seed):
    """Requests in rows of one block (add_sequences) are read as a view of the cache, over
    every row between the batch's first and last, finished rows included: the outputs must be
    those of the page-by-page gather, for any subset of the rows."""
    B = len(prefixes)
    masks = masks[:B]
    rows = [b for b in range(B) if active[b]] or [0]
    g = torch.Generator().manual_seed(seed)
    longest = max(L + m.shape[1] for L, (m, _) in zip(prefixes, masks))
    cache = PagedKVCache(1, 2, 4, B * (-(-longest // page_size) + 1), page_size)
    seqs = cache.add_sequences(B, longest)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    for s, L in zip(seqs, prefixes):
        cache.reserve(s, L)
        cache.commit(s, torch.arange(L))
    pick = [seqs[b] for b in rows]
    args = (pick, [prefixes[b] for b in rows], [masks[b][0] for b in rows],
            [prefixes[b] + masks[b][1] for b in rows], TorchBackend())
    view = make_batch(cache, *args)
    assert (view.plan.view is not None) == (len(rows) > 1)  # one request reads a slice anyway
    q = torch.randn(sum(masks[b][0].shape[0] for b in rows), 4, 4, generator=g)
    out = view.backend.run(view, 0, q, 0.5, window)
    cache._block = None  # the same cache, read by gathering
    gather = make_batch(cache, *args)
    assert gather.plan.view is None
    torch.testing.assert_close(out, gather.backend.run(gather, 0, q, 0.5, window), rtol=1e-5, atol=1e-6)
