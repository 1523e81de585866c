"""Attention backends against the reference torch backend: FlashInfer's plan arguments against
the torch plan, the flex backend's block masks and outputs, backend selection, and (on a CUDA
machine) each backend's tree logits beside the torch backend's.

``flashinfer_plan_args`` is pure index arithmetic, so it is checked on the CPU: its page
table (``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``) must address exactly the slots
the torch backend gathers, and its flattened custom mask must be the torch backend's
dense mask, request by request.

The flex backend runs on the CPU too: unfused (its default there) it applies only the block
mask's mask_mod, so its tile tables are checked against ``create_block_mask``'s and, once,
through the compiled CPU kernel, which skips the tiles the tables leave out.
"""

from __future__ import annotations

import gc
import shutil
import sys
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from helpers.caches import random_cache
from helpers.tiny import tiny_model
from treespec import Tree
from treespec.attention import (
    FlashInferBackend, FlashInferPlan, FlexBackend, TorchBackend, backend_for, flashinfer_available,
    flashinfer_plan_args, flex_block_mask, flex_problem, get_backend,
    make_batch,
)
from treespec.drafters.model import ModelDrafter
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
    assert type(get_backend("torch", "cpu")) is TorchBackend
    assert type(get_backend("auto", "cpu")) is TorchBackend  # auto never picks flex
    flex = get_backend("flex", "cpu")
    assert type(flex) is FlexBackend and not flex.compile  # unfused on a CPU unless asked
    with pytest.raises(ValueError, match="CUDA"):
        get_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="unknown attention_backend .*'flex'"):
        get_backend("bogus", "cpu")
    with pytest.raises(ValueError, match="flex' runs on CPU and CUDA devices, not meta"):
        get_backend("flex", "meta")


def test_one_backend_per_model_and_device():
    """``backend_for`` builds a model's backend once and hands out the same object after that
    (``auto`` is the backend it stands for), one per model and per name, and lets it go with
    its model; every ModelRunner of the model (one per ``generate`` call) gets it."""
    a, b = tiny_model("llama", 0), tiny_model("llama", 1)
    kept = backend_for(a, "torch", "cpu")
    assert type(kept) is TorchBackend
    assert backend_for(a, "auto", "cpu") is kept and backend_for(a, "torch", torch.device("cpu")) is kept
    assert type(backend_for(a, "flex", "cpu")) is FlexBackend
    assert backend_for(b, "torch", "cpu") is not kept
    assert ModelRunner(a).backend is kept and ModelRunner(a, "torch").backend is kept
    gone = weakref.ref(kept)
    del a, kept
    gc.collect()
    assert gone() is None


def test_generate_calls_reuse_the_target_and_draft_backends(monkeypatch):
    """Two ``generate`` calls plan every forward, the target's and a draft model's, on the same
    two backend objects."""
    planned = []
    plan = TorchBackend.plan
    monkeypatch.setattr(TorchBackend, "plan", lambda self, batch: planned.append(self) or plan(self, batch))
    model, draft = tiny_model("llama", 0), tiny_model("llama", 0)
    used = []
    for _ in range(2):
        planned.clear()
        treespec.generate(model, ModelDrafter(draft), "chain-3", [[1, 2, 3, 4]], max_new_tokens=6)
        used.append({id(b) for b in planned})
    assert used[0] == used[1] == {id(backend_for(model, "torch", "cpu")), id(backend_for(draft, "torch", "cpu"))}


class _FakeWrapper:
    """Stands in for FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper``: records ``plan``."""

    def __init__(self):
        self.plans = []

    def plan(self, *args, **kw):
        self.plans.append((args, kw))

    def run(self, q, kv):
        return torch.zeros_like(q)


def test_flashinfer_backend_plans_its_wrapper_once_per_forward():
    """A FlashInfer backend shared by forwards (without the package: its wrapper faked) gets a
    typed plan per forward, plans the wrapper at the forward's first layer only, and again for
    the next forward, with that forward's index data."""
    backend = FlashInferBackend.__new__(FlashInferBackend)  # no flashinfer here: no workspace
    backend.wrapper = _FakeWrapper()
    for sizes in ([3, 2], [1]):
        _, batch = build_batch([4, 1][: len(sizes)], [(causal_mask(n), torch.arange(n)) for n in sizes], 4, 0)
        batch.backend = backend
        batch.plan = backend.plan(batch)
        assert isinstance(batch.plan, FlashInferPlan) and batch.plan.planned_scale is None
        want = flashinfer_plan_args(batch)
        q = torch.zeros(sum(sizes), 2, 2)  # [T, H, D]
        for _ in range(3):  # the forward's layers (the one-layer cache's, read thrice)
            backend.run(batch, 0, q, 0.5)
        assert batch.plan.planned_scale == 0.5
        args, kw = backend.wrapper.plans[-1]
        assert torch.equal(args[1], want.kv_indptr) and torch.equal(kw["custom_mask"], want.custom_mask)
    assert len(backend.wrapper.plans) == 2


def test_flex_on_a_torch_without_flex_attention_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)  # import fails
    assert "PyTorch 2.5 or later" in flex_problem("cpu")
    model = tiny_model("llama", 0)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"'flex' needs torch.nn.attention.flex_attention .*use 'torch'"):
        treespec.generate(model, NgramDrafter(), "cpu", [[1, 2, 3]], max_new_tokens=3, attention_backend="flex")
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("dtype, head_dim, problem", [
    (torch.float32, 64, "runs float16 and bfloat16 models"),
    (torch.bfloat16, 8, "takes head sizes 64, 128, 256"),
    (torch.float16, 128, None),
    (torch.bfloat16, None, None),  # not known: not checked
])
def test_flashinfer_is_asked_only_for_what_its_kernels_take(dtype, head_dim, problem, monkeypatch):
    """FlashInfer's FA2 kernels take fp16/bf16 and head sizes 64/128/256: asked for anything else
    it refuses in one line (on a CUDA device, before importing it), and ``auto`` picks torch
    instead, even where FlashInfer is installed."""
    import treespec.attention as attention

    monkeypatch.setattr(attention, "flashinfer_available", lambda: True)
    got = attention.flashinfer_problem(dtype, head_dim)
    assert got is None if problem is None else got.startswith(problem)
    assert attention.backend_name("auto", "cuda", dtype, head_dim) == ("torch" if problem else "flashinfer")
    assert attention.backend_name("auto", "cpu", dtype, head_dim) == "torch"
    if problem:
        with pytest.raises(ValueError, match=f"attention_backend='flashinfer' {problem}.*use 'torch' or 'flex'"):
            get_backend("flashinfer", "cuda", dtype, head_dim)
    owner = tiny_model("llama", 0, hidden=256, heads=4).to(torch.bfloat16)  # head size 64
    assert attention.attention_shape(owner) == (torch.bfloat16, 64)


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


# ---- flex -----------------------------------------------------------------------------------

@settings(max_examples=30, **SETTINGS)
@given(R=st.integers(1, 3), n=st.integers(1, 40), kv=st.integers(1, 70), block=st.sampled_from([4, 8, 128]),
       density=st.sampled_from([0.0, 0.3, 0.9, 1.0]), seed=st.integers(0, 1000))
def test_flex_block_mask_tables_are_create_block_masks(R, n, kv, block, density, seed):
    """The tile tables built from the dense mask are the ones ``create_block_mask`` builds by
    evaluating the same mask at every (query, key): skipped, partial and full tiles alike."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(R, n, kv, generator=g) < density
    mask[:, :, : kv // 2] |= torch.rand(R, 1, 1, generator=g) < 0.5  # a prefix every query sees: full tiles
    ours = flex_block_mask(mask, block)
    want = create_block_mask(lambda b, h, q, k: mask[b, q, k], R, None, n, kv, device="cpu", BLOCK_SIZE=block)
    assert ours.seq_lengths == want.seq_lengths == (n, kv)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, name), getattr(want, name)), name
    seen = ours.to_dense()[:, 0]  # [R, nq, nk]: tiles computed, partial or full
    for r in range(R):
        for i in range(seen.shape[1]):
            for j in range(seen.shape[2]):
                tile = mask[r, i * block: (i + 1) * block, j * block: (j + 1) * block]
                assert bool(seen[r, i, j]) == bool(tile.any())


@settings(max_examples=30, **SETTINGS)
@given(prefixes=st.lists(st.integers(0, 13), min_size=1, max_size=4),
       masks=st.lists(local_mask(), min_size=4, max_size=4),
       page_size=st.sampled_from([1, 4, 5]),
       window=st.sampled_from([None, 3]),
       rows=st.booleans(),
       seed=st.integers(0, 1000))
def test_flex_attends_like_torch(prefixes, masks, page_size, window, rows, seed):
    """Random trees (and drafter-style last levels), ragged prefixes, GQA, sliding windows, K/V
    read as a view or gathered: flex gives the torch backend's outputs."""
    masks = masks[: len(prefixes)]
    cache, seqs = random_cache(prefixes, masks, page_size, rows, seed)
    args = (seqs, prefixes, [m for m, _ in masks], [L + d for L, (_, d) in zip(prefixes, masks)])
    ref, flex = make_batch(cache, *args, TorchBackend()), make_batch(cache, *args, FlexBackend("cpu"))
    q = torch.randn(sum(m.shape[0] for m, _ in masks), 4, 4, generator=torch.Generator().manual_seed(seed))
    out = flex.backend.run(flex, 0, q, 0.5, window)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref.backend.run(ref, 0, q, 0.5, window), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's compiler
@pytest.mark.filterwarnings("error:flex_attention called without torch.compile")  # the kernel, not its fallback
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="compiling flex_attention on a CPU needs a C++ compiler")
def test_flex_compiled_on_cpu_attends_like_torch_and_reads_the_tile_tables(monkeypatch, fresh_flex):
    """The compiled kernel (the path CUDA takes, here built for the CPU) skips the tiles the
    tables leave out and runs full tiles without the mask: with the right tables it gives the
    torch backend's outputs, and tables that call every tile full give something else. Two
    requests: a short one (its row's later key tiles are skipped) and one of 300 cached tokens
    and 130 new ones (its first query tile sees its first two key tiles whole)."""
    import treespec.attention as attention

    tree = Tree([-1, 0, 0, 1])
    masks = [(tree.attention_mask(), tree.depth), (causal_mask(130), torch.arange(130))]
    prefixes = [10, 300]
    cache, seqs = random_cache(prefixes, masks, 16, False, 0)
    args = (seqs, prefixes, [m for m, _ in masks], [L + d for L, (_, d) in zip(prefixes, masks)])
    ref, flex = make_batch(cache, *args, TorchBackend()), make_batch(cache, *args, FlexBackend("cpu", compile=True))
    q = torch.randn(134, 4, 4, generator=torch.Generator().manual_seed(1))
    want = ref.backend.run(ref, 0, q, 0.5)
    torch.testing.assert_close(flex.backend.run(flex, 0, q, 0.5), want, rtol=1e-5, atol=1e-5)

    def all_full(mask, block=attention.FLEX_BLOCK):
        from torch.nn.attention.flex_attention import BlockMask

        right = flex_block_mask(mask, block)
        nk = right.kv_indices.shape[-1]
        count = torch.full_like(right.kv_num_blocks, nk)
        return BlockMask.from_kv_blocks(torch.zeros_like(count), right.kv_indices, count, right.kv_indices.clone(),
                                        BLOCK_SIZE=block, mask_mod=right.mask_mod, seq_lengths=right.seq_lengths)

    monkeypatch.setattr(attention, "flex_block_mask", all_full)
    wrong = make_batch(cache, *args, FlexBackend("cpu", compile=True))
    assert (wrong.backend.run(wrong, 0, q, 0.5) - want).abs().max() > 0.1


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6], list(range(20, 40))]
TREES = [Tree([-1, 0, 0, 1, 1, 2, 5], [3, 4, 5, 6, 7, 8, 9]), Tree([-1], [1]), Tree.chain(4, [9, 8, 7, 6, 5])]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_tree_logits_equal_torchs_on_cpu(dtype):
    """On a CPU both backends attend in fp32 over the same fp32 cache (``kv_dtype``), so a bf16
    model's tree logits differ only where a last-bit difference in attention moves a bf16
    rounding."""
    model = tiny_model("llama", 0, peak=1.0).to(dtype)  # logits O(1): atol means something
    ref = _tree_logits(ModelRunner(model, "torch"), PROMPTS, TREES, 4)
    flex = _tree_logits(ModelRunner(model, "flex"), PROMPTS, TREES, 4)
    for r, f in zip(ref, flex):
        assert r.shape == f.shape
        torch.testing.assert_close(f, r, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_flex_greedy_output_equals_torchs_on_cpu():
    """Through a draft model (its trees grown level by level, the extra_keys route) whose drafts
    the target accepts: the same tokens through either backend."""
    model = tiny_model("llama", 0)
    outs = [treespec.generate(model, ModelDrafter(tiny_model("llama", 0), attention_backend=b), "chain-3",
                              PROMPTS, max_new_tokens=12, attention_backend=b) for b in ("torch", "flex")]
    assert outs[0].sequences == outs[1].sequences
    assert all(len(s) == 12 for s in outs[0].sequences)
    assert outs[1].metrics.acceptance_counts and outs[1].metrics.acceptance_counts[0] > 0  # drafts accepted


# ---- CUDA -----------------------------------------------------------------------------------

def cuda_model(seed: int = 0, **kw):
    """A tiny llama with head dim 64: the smallest that FlashInfer's kernels take (64, 128, 256)
    and above flex_attention's CUDA minimum (16)."""
    return tiny_model("llama", seed, hidden=256, heads=4, kv_heads=2, **kw)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("backend", [
    pytest.param("flex", marks=pytest.mark.skipif(bool(torch.cuda.is_available() and flex_problem("cuda")),
                                                  reason=f"flex: {torch.cuda.is_available() and flex_problem('cuda')}")),
    pytest.param("flashinfer", marks=pytest.mark.skipif(not flashinfer_available(),
                                                        reason="needs flashinfer: pip install 'treespec[cuda]'")),
])
@pytest.mark.filterwarnings("error:flex_attention called without torch.compile")  # the kernel, not its fallback
def test_backend_matches_torch_backend_on_cuda_fp16(backend, page_size, fresh_flex):
    model = cuda_model(peak=1.0).to("cuda", torch.float16)  # logits O(1): atol means something
    ref = _tree_logits(ModelRunner(model, "torch"), PROMPTS, TREES, page_size)
    other = _tree_logits(ModelRunner(model, backend), PROMPTS, TREES, page_size)
    for r, f in zip(ref, other):
        assert r.shape == f.shape
        assert (r - f).abs().max() < 1e-2
    # Greedy generation agrees between the backends (peaked logits: no fp16 near-ties).
    peaked = cuda_model().to("cuda", torch.float16)
    outs = [treespec.generate(peaked, NgramDrafter(), "cpu", PROMPTS, max_new_tokens=16, attention_backend=b).sequences
            for b in ("torch", backend)]
    assert outs[0] == outs[1]
    assert all(len(s) == 16 for s in outs[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_flex_on_cuda_refuses_a_head_dim_under_16():
    model = tiny_model("llama", 0).to("cuda")  # head dim 8
    with pytest.raises(ValueError, match="head dim of at least 16"):
        _tree_logits(ModelRunner(model, "flex"), PROMPTS[:1], TREES[:1], 16)


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
            cache = PagedKVCache(len(cache.k), *cache.k[0].shape[2:], cache.num_pages, cache.page_size, kept)
        else:
            assert cache.k[0].dtype == torch.float32
        assert cache.flat(0)[0].dtype == (kept or torch.float32)
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
