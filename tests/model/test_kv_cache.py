"""The paged KV cache: compaction after commit, and page accounting.

After any sequence of tree forwards and commits, the cache must hold exactly what a plain
causal prefill of the committed tokens would have written: the accepted nodes' K/V moved
to consecutive positions (their RoPE positions were prefix + depth, which is where they
land). Page bookkeeping: lookahead pages go back after a commit, a full cache raises, an
unreserved position has no slot, and the committed prefix is never overwritten.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.tiny import tiny_model
from treespec import Tree
from treespec.kv_cache import CacheFullError, PagedKVCache
from treespec.mask import causal_mask
from treespec.runner import ModelRunner
from treespec.accept import accept as verify_greedy

V = 64
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.lru_cache(maxsize=None)
def runner_of(family: str) -> ModelRunner:
    return ModelRunner(tiny_model(family, 0), "torch")


def prefill_seq(runner, cache, seq, tokens):
    L = cache.seq_lens[seq]
    out = runner.forward(cache, [seq], [torch.tensor(tokens)], [torch.arange(L, L + len(tokens))],
                         [causal_mask(len(tokens))], logits_rows=[[len(tokens) - 1]])
    cache.commit(seq, torch.arange(L, L + len(tokens)))
    return out.logits[0][-1]


def kv_of(cache: PagedKVCache, seq: int, layer: int):
    return cache.gather(layer, cache.span(seq, 0, cache.seq_lens[seq]))


def assert_same_kv(cache, seq, ref_cache, ref_seq, atol=1e-5):
    assert cache.seq_lens[seq] == ref_cache.seq_lens[ref_seq]
    for layer in range(len(cache.k)):
        k, v = kv_of(cache, seq, layer)
        rk, rv = kv_of(ref_cache, ref_seq, layer)
        assert (k - rk).abs().max() <= atol, f"K of layer {layer}"
        assert (v - rv).abs().max() <= atol, f"V of layer {layer}"


@st.composite
def tree_and_node(draw):
    n = draw(st.integers(1, 10))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens, used = [], {}
    for p in parents:
        t = draw(st.integers(0, V - 1))
        while t in used.setdefault(p, set()):
            t = (t + 1) % V
        used[p].add(t)
        tokens.append(t)
    tree = Tree(parents, tokens)
    return tree, draw(st.integers(0, n - 1))


@settings(max_examples=12, **SETTINGS)
@given(family=st.sampled_from(["llama", "qwen2", "mistral"]),
       prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=10),
       steps=st.lists(tree_and_node(), min_size=1, max_size=4),
       page_size=st.sampled_from([1, 3, 4]))
def test_compaction_equals_sequential_prefill(family, prompt, steps, page_size):
    """Commit an arbitrary root-to-node path of each step's tree; the cache then equals a
    fresh cache filled by one causal prefill of prompt + committed tokens."""
    runner = runner_of(family)
    total = len(prompt) + sum(t.num_nodes for t, _ in steps)
    cache = runner.new_cache([total], page_size)
    seq = cache.add_sequence()
    committed = list(prompt)
    with runner.attached():
        prefill_seq(runner, cache, seq, prompt)
        for tree, node in steps:
            L = cache.seq_lens[seq]
            runner.forward(cache, [seq], [tree.tokens], [tree.position_ids(L)], [tree.attention_mask()])
            path = tree.ancestors(node)
            cache.commit(seq, L + torch.tensor(path))
            committed += tree.tokens[path].tolist()
            assert cache.seq_lens[seq] == len(committed)
            assert len(cache.page_tables[seq]) == -(-len(committed) // page_size)  # lookahead returned
        ref = runner.new_cache([len(committed)], 4)
        ref_seq = ref.add_sequence()
        prefill_seq(runner, ref, ref_seq, committed)
    assert_same_kv(cache, seq, ref, ref_seq)


def test_compaction_under_greedy_verification():
    """Real steps: verify each tree greedily against the target and commit what it accepts
    (as the engine does), with two requests sharing the cache."""
    runner = runner_of("qwen2")
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 9]]
    cache = runner.new_cache([60, 60], 4)
    seqs = [cache.add_sequence() for _ in prompts]
    committed = [list(p) for p in prompts]
    with runner.attached():
        roots = [int(prefill_seq(runner, cache, s, p).argmax()) for s, p in zip(seqs, prompts)]
        for step in range(4):
            # Trees whose first branch is the target's own choice half the time.
            Ls = [cache.seq_lens[s] for s in seqs]
            probe = runner.forward(cache, seqs, [torch.tensor([r]) for r in roots],
                                   [torch.tensor([L]) for L in Ls], [causal_mask(1)] * 2)
            guesses = [int(l[0].argmax()) for l in probe.logits]
            cache.truncate(seqs[0], Ls[0]); cache.truncate(seqs[1], Ls[1])
            trees = [Tree([-1, 0, 0, 1, 2], [r, g if step % 2 == 0 else (g + 1) % V, (g + 2) % V, 5, 6])
                     for r, g in zip(roots, guesses)]
            out = runner.forward(cache, seqs, [t.tokens for t in trees], [t.position_ids(L) for t, L in zip(trees, Ls)],
                                 [t.attention_mask() for t in trees])
            n = max(t.num_nodes for t in trees)
            argmax = torch.stack([l.argmax(-1) for l in out.logits])[:, :n]
            verdicts = verify_greedy(trees, argmax)
            for b, (s, v, L) in enumerate(zip(seqs, verdicts, Ls)):
                cache.commit(s, L + torch.tensor(v.path))
                committed[b] += [roots[b]] + v.tokens[:-1]
                roots[b] = v.tokens[-1]
            if step % 2 == 0:
                assert all(v.num_accepted >= 1 for v in verdicts)
        for b, s in enumerate(seqs):
            ref = runner.new_cache([len(committed[b])], 4)
            rs = ref.add_sequence()
            prefill_seq(runner, ref, rs, committed[b])
            assert_same_kv(cache, s, ref, rs)


# ---- commit on synthetic data ---------------------------------------------------------------

def numbered_cache(page_size=4, pages=8, n=12, layers=2):
    """A cache whose K at logical position p holds the value p (V holds -p), L = 0."""
    cache = PagedKVCache(layers, 1, 2, pages, page_size)
    seq = cache.add_sequence()
    cache.reserve(seq, n)
    pos = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, 1, 2)
    for layer in range(layers):
        cache.write(layer, cache.span(seq, 0, n), pos, -pos)
    return cache, seq


@pytest.mark.parametrize("keep", [
    [0, 1, 2],          # already in place: nothing moves
    [0, 2, 5],          # a path through a tree
    [1, 2, 3, 4, 5],    # overlapping shift by one
    [0, 4, 8, 9, 11],   # across pages
    [],                 # nothing accepted
])
def test_commit_moves_values(keep):
    cache, seq = numbered_cache()
    cache.commit(seq, torch.tensor(keep, dtype=torch.int64))
    assert cache.seq_lens[seq] == len(keep)
    for layer in range(2):
        k, v = kv_of(cache, seq, layer)
        assert k[:, 0, 0].tolist() == [float(x) for x in keep]
        assert v[:, 0, 1].tolist() == [-float(x) for x in keep]


def test_second_commit_appends_after_the_prefix():
    cache, seq = numbered_cache()
    cache.commit(seq, torch.tensor([0, 1]))
    cache.reserve(seq, 12)
    cache.commit(seq, torch.tensor([3, 6]))
    k, _ = kv_of(cache, seq, 1)
    assert k[:, 0, 0].tolist() == [0.0, 1.0, 3.0, 6.0]


@settings(max_examples=40, **SETTINGS)
@given(page_size=st.integers(1, 4), prefix=st.integers(0, 6), ahead=st.integers(1, 12), data=st.data())
def test_commit_moves_every_layer_among_interleaved_pages(page_size, prefix, ahead, data):
    """A commit moves the kept entries of every layer, K and V, to the positions after the
    prefix, also when the sequence's pages interleave with another's (slots not consecutive)
    and the moves overlap; the prefix and the other sequence stay as they were."""
    layers = 3
    cache = PagedKVCache(layers, 2, 4, num_pages=64, page_size=page_size)
    a, b = cache.add_sequence(), cache.add_sequence()
    for n in range(page_size, prefix + ahead + page_size, page_size):  # a page each, in turn
        cache.reserve(a, min(n, prefix + ahead))
        cache.reserve(b, n)
    g = torch.Generator().manual_seed(prefix * 100 + ahead)
    cache._kv.copy_(torch.randn(cache._kv.shape, generator=g))  # other values in every layer, K and V
    cache.seq_lens[a], cache.seq_lens[b] = prefix, n
    keep = sorted(data.draw(st.sets(st.integers(prefix, prefix + ahead - 1))))

    def at(seq, positions):  # [layers, 2, n, Hkv, D]
        slots = cache.slots(seq, torch.tensor(positions, dtype=torch.int64))
        return torch.stack([torch.stack(cache.gather(layer, slots)) for layer in range(layers)])

    want_a, want_b = at(a, list(range(prefix)) + keep), at(b, list(range(n)))
    cache.commit(a, torch.tensor(keep, dtype=torch.int64))
    assert cache.seq_lens[a] == prefix + len(keep)
    assert torch.equal(at(a, list(range(prefix + len(keep)))), want_a)
    assert torch.equal(at(b, list(range(n))), want_b)


@pytest.mark.parametrize("compiled", [False, True])
def test_move_copies_before_it_writes(compiled):
    """``PagedKVCache.move`` (what a fixed-shape step compacts its paths with), eagerly and
    inside a compiled graph: three rows, paths that skip entries and overlap their targets
    (row 0: 0, 2, 3, 7; row 2: 0, 5), every layer, K and V, the rest of each row unchanged."""
    cache = PagedKVCache(3, 2, 4, num_pages=12, page_size=4)
    cache._kv.copy_(torch.randn(cache._kv.shape, generator=torch.Generator().manual_seed(0)))
    before = cache._kv.clone().view(2, 3, -1, 2, 4)
    src = torch.tensor([[0, 2, 3, 7, 4, 5, 6, 7], [16, 17, 18, 19, 20, 21, 22, 23], [32, 37, 34, 35, 36, 37, 38, 39]])
    dst = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [16, 17, 18, 19, 20, 21, 22, 23], [32, 33, 34, 35, 36, 37, 38, 39]])

    def move(src, dst):
        cache.move(src, dst)
        return dst

    (torch.compile(move, dynamic=False) if compiled else move)(src, dst)
    after = cache._kv.view(2, 3, -1, 2, 4)
    want = before.clone()
    want[:, :, dst.reshape(-1)] = before[:, :, src.reshape(-1)]
    assert torch.equal(after, want)
    assert not torch.equal(after[:, :, [1, 2, 33]], before[:, :, [1, 2, 33]])  # entries did move


# ---- page accounting ------------------------------------------------------------------------

def test_pages_return_after_commit():
    cache = PagedKVCache(1, 1, 2, num_pages=10, page_size=4)
    assert cache.free_tokens == 40
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 5)
    assert cache.free_tokens == 32 and len(cache.page_tables[a]) == 2
    cache.commit(a, torch.arange(5))
    assert cache.free_tokens == 32  # 5 committed tokens keep both pages
    cache.reserve(a, 5 + 14)  # a 14-token tree: 5 pages in all
    assert cache.free_tokens == 20
    cache.commit(a, torch.tensor([5, 6, 9]))
    assert cache.seq_lens[a] == 8
    assert len(cache.page_tables[a]) == 2 and cache.free_tokens == 32
    cache.reserve(b, 3)
    assert cache.free_tokens == 28
    assert not set(cache.page_tables[a]) & set(cache.page_tables[b])
    cache.free_sequence(a)
    assert cache.free_tokens == 36 and cache.seq_lens[a] == 0
    cache.truncate(b, 0)
    assert cache.free_tokens == 40


def test_reserve_is_idempotent_and_grows_only():
    cache = PagedKVCache(1, 1, 2, num_pages=4, page_size=4)
    s = cache.add_sequence()
    cache.reserve(s, 6)
    table = list(cache.page_tables[s])
    cache.reserve(s, 6)
    cache.reserve(s, 3)
    assert cache.page_tables[s] == table


def test_cache_full_error():
    cache = PagedKVCache(1, 1, 2, num_pages=3, page_size=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 12)  # every page
    with pytest.raises(CacheFullError, match="full"):
        cache.reserve(b, 1)
    with pytest.raises(CacheFullError):
        cache.reserve(a, 13)
    assert cache.free_tokens == 0 and cache.page_tables[b] == []  # a failed reserve takes nothing
    cache.commit(a, torch.arange(4))  # back to one page
    assert cache.capacity(b) == 8
    cache.reserve(b, 8)
    assert cache.free_tokens == 0


def test_cache_full_inside_a_forward():
    runner = runner_of("llama")
    cache = runner.new_cache([6], 4)  # sized for 6 tokens (2 pages + 1 spare)
    seq = cache.add_sequence()
    with runner.attached(), pytest.raises(CacheFullError):
        runner.forward(cache, [seq], [torch.arange(13)], [torch.arange(13)], [causal_mask(13)])


def test_slots_refuse_unreserved_positions():
    cache = PagedKVCache(1, 1, 2, num_pages=4, page_size=4)
    s = cache.add_sequence()
    with pytest.raises(IndexError):
        cache.slots(s, torch.tensor([0]))
    cache.reserve(s, 5)  # two pages: positions 0..7 addressable
    slots = cache.slots(s, torch.arange(8))
    assert slots.unique().numel() == 8
    t = cache.page_tables[s]
    assert slots.tolist() == [t[p // 4] * 4 + p % 4 for p in range(8)]
    with pytest.raises(IndexError, match="not reserved"):
        cache.slots(s, torch.tensor([3, 8]))
    with pytest.raises(IndexError):
        cache.span(s, 0, 9)


def test_commit_refuses_to_overwrite_the_prefix():
    cache, seq = numbered_cache()
    cache.commit(seq, torch.arange(4))
    cache.reserve(seq, 12)
    with pytest.raises(ValueError, match="prefix"):
        cache.commit(seq, torch.tensor([3, 4]))
    k, _ = kv_of(cache, seq, 0)
    assert k[:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0] and cache.seq_lens[seq] == 4  # untouched


@pytest.mark.parametrize("keep", [[5, 5], [6, 5], [4, 7, 7]])
def test_commit_refuses_positions_out_of_order_or_twice(keep):
    cache, seq = numbered_cache()
    cache.commit(seq, torch.arange(4))
    cache.reserve(seq, 12)
    with pytest.raises(ValueError, match="ascending order, each once"):
        cache.commit(seq, keep)
    assert cache.seq_lens[seq] == 4  # untouched


def test_bad_dimensions():
    with pytest.raises(ValueError):
        PagedKVCache(1, 1, 2, num_pages=0)
    with pytest.raises(ValueError):
        PagedKVCache(1, 1, 2, num_pages=2, page_size=0)


# ---- a block of rows (add_sequences) --------------------------------------------------------

def test_block_rows_are_consecutive_pinned_and_released():
    cache = PagedKVCache(1, 1, 2, num_pages=12, page_size=4)
    other = cache.add_sequence()
    cache.reserve(other, 4)  # page 0 taken first: the block starts after it
    seqs = cache.add_sequences(3, 7)  # 2 pages per row
    first, stride, rows = cache.block_rows(seqs, 8)
    assert (stride, rows) == (8, [0, 1, 2])
    for i, s in enumerate(seqs):
        table = cache.page_tables[s]
        assert table == list(range(table[0], table[0] + 2))
        assert cache.slots(s, torch.arange(8)).tolist() == list(range(first + i * stride, first + (i + 1) * stride))
    assert cache.block_rows(seqs, 9) is None  # longer than a row
    assert cache.block_rows(seqs + [other], 4) is None  # a sequence outside the block
    # Commits and truncation keep a row's pages; growing past it takes pool pages.
    s = seqs[1]
    table = list(cache.page_tables[s])
    cache.reserve(s, 3)
    cache.commit(s, torch.arange(3))
    cache.truncate(s, 0)
    assert cache.page_tables[s] == table and cache.free_tokens == 4 * (12 - 1 - 6)
    cache.reserve(s, 11)
    assert cache.page_tables[s][:2] == table and len(cache.page_tables[s]) == 3
    cache.truncate(s, 0)
    assert cache.page_tables[s] == table
    cache.free_sequence(s)
    assert cache.page_tables[s] == [] and cache.block_rows([s], 1) is None
    assert cache.block_rows([seqs[0], seqs[2]], 8)[2] == [0, 2]
    assert cache.free_tokens == 4 * (12 - 1 - 4)
    with pytest.raises(ValueError, match="one add_sequences per cache"):
        cache.add_sequences(1, 4)


def test_block_needs_consecutive_free_pages():
    cache = PagedKVCache(1, 1, 2, num_pages=6, page_size=4)
    cache._free = [5, 3, 1, 4, 2, 0]  # every page free, in a scrambled order
    a = cache.add_sequence()
    cache.reserve(a, 4)  # takes page 0
    b = cache.add_sequence()
    cache.reserve(b, 4)  # takes page 2: the longest run left is 3, 4, 5
    with pytest.raises(CacheFullError, match="consecutive"):
        cache.add_sequences(2, 8)
    assert cache.free_tokens == 16  # nothing taken
    seqs = cache.add_sequences(3, 4)
    assert [cache.page_tables[s] for s in seqs] == [[3], [4], [5]]


def test_with_rows_builds_a_block_with_a_spare_page_each():
    cache, seqs = PagedKVCache.with_rows(2, 1, 2, count=3, tokens=9, page_size=4)
    assert cache.num_pages == 3 * (3 + 1) and cache.free_tokens == 3 * 4
    assert cache.block_rows(seqs, 12) == (0, 12, [0, 1, 2]) and cache.block_rows(seqs, 13) is None


def test_a_reused_storage_starts_zeroed_where_used_and_a_smaller_one_is_not_taken():
    need = 2 * 2 * 3 * 4 * 1 * 8  # K and V, 2 layers, 3 pages of 4 positions, 1 head of 8
    dirty = torch.full((need,), float("nan"))
    cache, _ = PagedKVCache.with_rows(2, 1, 8, 1, 8, page_size=4, storage=dirty)
    assert cache.storage is dirty and not dirty.isnan().any() and not dirty.any()
    assert cache.kv.shape == (2, 2, 3, 4, 1, 8) and cache.kv.data_ptr() == dirty.data_ptr()
    # a larger storage serves a smaller cache: the part it uses is zeroed, the rest left alone
    larger = torch.full((need + 10,), 1.0)
    small, _ = PagedKVCache.with_rows(2, 1, 8, 1, 8, page_size=4, storage=larger)
    assert small.storage is larger and not small.kv.any() and (larger[need:] == 1.0).all()
    other, _ = PagedKVCache.with_rows(2, 1, 8, 1, 12, page_size=4, storage=torch.full((need,), 1.0))
    assert other.kv.shape == (2, 2, 4, 4, 1, 8) and other.storage.numel() == 2 * 2 * 4 * 4 * 8 and not other.kv.any()
    wrong_dtype, _ = PagedKVCache.with_rows(2, 1, 8, 1, 8, page_size=4, storage=torch.ones(need, dtype=torch.float64))
    assert wrong_dtype.storage.dtype == torch.float32 and not wrong_dtype.kv.any()


def test_generate_hands_its_cache_storage_to_the_next_call():
    """The loop's cache goes back to the model's runner at the end of a call, and the next call
    that fits in it takes it (no fresh allocation to fault in); the tokens are the same. A larger
    call's storage replaces it, and serves the smaller calls after it."""
    import treespec
    from treespec import runner as runner_mod

    model = tiny_model("llama", 3)
    prompt = [5, 3, 1, 4, 1, 5, 9]
    first = treespec.generate(model, "ngram", "chain-3", prompt, max_new_tokens=12)
    spare = runner_mod._SPARE_KV[model]
    second = treespec.generate(model, "ngram", "chain-3", prompt, max_new_tokens=12)
    assert runner_mod._SPARE_KV[model] is spare  # taken by the second call, and given back at its end
    assert first.sequences == second.sequences
    treespec.generate(model, "ngram", "chain-3", prompt + [2] * 40, max_new_tokens=12)  # a larger one
    larger = runner_mod._SPARE_KV[model]
    assert larger is not spare and larger.numel() > spare.numel()
    third = treespec.generate(model, "ngram", "chain-3", prompt, max_new_tokens=12)
    assert runner_mod._SPARE_KV[model] is larger and third.sequences == first.sequences


def test_a_storage_made_under_inference_mode_is_reused_only_there():
    with torch.inference_mode():
        made, _ = PagedKVCache.with_rows(2, 1, 8, 1, 8, page_size=4)
        again, _ = PagedKVCache.with_rows(2, 1, 8, 1, 8, page_size=4, storage=made.storage)
    assert again.storage is made.storage
    outside, _ = PagedKVCache.with_rows(2, 1, 8, 1, 8, page_size=4, storage=made.storage)
    assert outside.storage is not made.storage
    outside.storage.fill_(1.0)  # an ordinary tensor: writable here
