"""The verify forward on fixed shapes (issues 47 and 48) gives what today's forward gives.

- Logits and features of one forward equal today's path's (fp32, tight tolerance): hypothesis
  over random trees, prefix lengths, buckets, batches with finished rows and four families,
  sliding windows included; the forward ran on fixed shapes (no fallback) and wrote nothing
  but its own tree's slots and scratch; a tree past the largest bucket falls back.
- ``generate(..., fixed_shapes=True)`` gives exactly the tokens of today's path and of HF
  generate (greedy, each drafter kind, batches), the same tokens when sampled with a seed, and
  after a prefix-cache hit.
- Compiled (``torch.compile``, inductor, ``dynamic=False``): one graph per bucket, none more as
  the prefix grows, logits equal to the eager ones.
- Acceptance inside the forward (``accept=True``, greedy): the host rule's verdicts, features
  and committed K/V, eager and compiled; from the tree forward to the commit, one read back a
  step and a score of operations outside the body (issue 47's proxy), the draft's counts printed.

Targets are tiny (V = 64); fp32, one thread.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import treespec
from helpers.pairs import graphed, pair
from helpers.references import hf_greedy
from helpers.tiny import tiny_model
from helpers.trees import trees
from treespec import PrefixCache, Tree
from treespec.accept import accept
from treespec.fixed_shape import (BUCKETS, FixedShapeVerify, ancestor_masks, bucket_for, fixed_row_tokens,
                                  tree_rows_mask)
from treespec.mask import causal_mask
from treespec.runner import FINAL_NORM, ModelRunner

V = 64
ATOL = 1e-4
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
pytestmark = [pytest.mark.filterwarnings("ignore:the model accepted none"), pytest.mark.usefixtures("one_thread")]


@functools.lru_cache(maxsize=None)
def model_of(family: str, seed: int = 0, **extra):
    return tiny_model(family, seed, **extra)


def both_forwards(model, prompts, tree_list, active=None, buckets=BUCKETS, features=(0, FINAL_NORM)):
    """Today's forward and the fixed-shape one of ``tree_list`` (one per active row, after each
    row's prompt) on two copies of one prefilled cache. Returns both outputs, the verifier and
    the two caches' K/V."""
    active = list(range(len(prompts))) if active is None else active
    runner = ModelRunner(model, "torch", feature_layers=list(features))
    rows = fixed_row_tokens(max(map(len, prompts)), max(t.num_nodes for t in tree_list), True)
    outs, kvs = [], []
    for fixed in (False, True):
        cache, seqs = runner.new_rows_cache(len(prompts), rows, 4)
        with runner.attached():
            runner.forward(cache, seqs, [torch.tensor(p) for p in prompts], [torch.arange(len(p)) for p in prompts],
                           [causal_mask(len(p)) for p in prompts], logits_rows=[[len(p) - 1] for p in prompts])
            for s, p in zip(seqs, prompts):
                cache.commit(s, torch.arange(len(p)))
            act, cached = [seqs[i] for i in active], [len(prompts[i]) for i in active]
            if fixed:
                verify = FixedShapeVerify(runner, cache, seqs, buckets=buckets)
                outs.append(verify.forward(act, tree_list, cached, capture=bool(features)))
            else:
                outs.append(runner.forward(cache, act, [t.tokens for t in tree_list],
                                           [t.position_ids(L) for t, L in zip(tree_list, cached)],
                                           [t.attention_mask() for t in tree_list], capture=bool(features)))
        kvs.append(cache._kv.clone())
    return outs[0], outs[1], verify, kvs


def assert_same_outputs(want, got):
    for a, b in zip(want.logits, got.logits):
        assert a.shape == b.shape and (a - b).abs().max() < ATOL, (a - b).abs().max()
    if want.features is not None:
        for a, b in zip(want.features, got.features):
            assert a.shape == b.shape and (a - b).abs().max() < ATOL


# ---- one forward ------------------------------------------------------------------------------


@st.composite
def batches(draw):
    bucket = draw(st.sampled_from(BUCKETS))
    rows = draw(st.integers(1, 3))
    prompts = [draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=30)) for _ in range(rows)]
    active = draw(st.lists(st.sampled_from(range(rows)), min_size=1, max_size=rows, unique=True).map(sorted))
    tree_list = [draw(trees(max_nodes=bucket, vocab=V)) for _ in active]
    return dict(family=draw(st.sampled_from(["llama", "qwen2", "qwen3", "mistral"])), prompts=prompts,
                active=active, trees=tree_list, bucket=bucket)


@settings(max_examples=30, **SETTINGS)
@given(b=batches())
def test_logits_and_features_equal_todays_forward(b):
    model = model_of(b["family"])
    want, got, verify, (kv_want, kv_got) = both_forwards(model, b["prompts"], b["trees"], b["active"])
    assert (verify.fixed_forwards, verify.fallbacks) == (1, 0)
    assert_same_outputs(want, got)
    # Every committed prefix is untouched, and each tree's K/V where today's path wrote them.
    R, C = verify.attention.rows, verify.capacity
    flat_want, flat_got = (kv.view(2, kv.shape[1], -1, *kv.shape[-2:]) for kv in (kv_want, kv_got))
    first = verify.attention.first
    for i, (r, t) in enumerate(zip(b["active"], b["trees"])):
        seen = slice(first + r * C, first + r * C + len(b["prompts"][r]) + t.num_nodes)
        assert (flat_want[:, :, seen] - flat_got[:, :, seen]).abs().max() < ATOL


@settings(max_examples=10, **SETTINGS)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=12), tree=trees(max_nodes=16, vocab=V),
       family=st.sampled_from(["mistral", "qwen2"]))
def test_sliding_windows_equal_todays_forward(prompt, tree, family):
    """Mistral with a 4-token window, Qwen2 with a full layer then a windowed one."""
    extra = dict(sliding_window=4) if family == "mistral" else dict(use_sliding_window=True, sliding_window=4,
                                                                     max_window_layers=1)
    want, got, verify, _ = both_forwards(model_of(family, 0, **extra), [prompt], [tree])
    assert verify.fixed_forwards == 1
    assert_same_outputs(want, got)


def test_the_smallest_bucket_that_holds_the_tree_runs():
    assert [bucket_for(n) for n in (1, 2, 4, 5, 16, 17, 64, 65)] == [1, 4, 4, 8, 16, 32, 64, None]
    prompt, tree = [3, 1, 4], Tree.chain(5, [1, 2, 3, 4, 5, 6])  # 6 tokens: bucket 8
    _, got, verify, _ = both_forwards(model_of("llama"), [prompt], [tree])
    assert list(verify._rows.buffers) == [8]


def test_a_tree_past_the_largest_bucket_runs_todays_forward():
    tree = Tree.chain(9, list(range(1, 11)))  # 10 tokens, buckets of at most 8
    want, got, verify, _ = both_forwards(model_of("llama"), [[1, 2]], [tree], buckets=(4, 8))
    assert (verify.fixed_forwards, verify.fallbacks) == (0, 1)
    assert_same_outputs(want, got)


def test_mask_by_hand():
    """Row 0: 2 committed tokens and a tree (root, two children) padded to 4; row 1: no tree
    (a finished request): all padding, each padded token sees the committed prefix and itself."""
    tree = Tree([-1, 0, 0], [5, 6, 7])
    N = 4
    local = torch.eye(N, dtype=torch.bool).repeat(2, 1, 1)
    local[0, :3, :3] = tree.attention_mask()
    mask = tree_rows_mask(torch.tensor([2, 1]), local, capacity=7)[:, 0].int()
    assert mask[0].tolist() == [[1, 1, 1, 0, 0, 0, 0],
                                [1, 1, 1, 1, 0, 0, 0],
                                [1, 1, 1, 0, 1, 0, 0],
                                [1, 1, 0, 0, 0, 1, 0]]  # padding: the prefix and itself
    assert mask[1].tolist() == [[1, 1, 0, 0, 0, 0, 0],  # its committed token, then itself
                                [1, 0, 1, 0, 0, 0, 0],
                                [1, 0, 0, 1, 0, 0, 0],
                                [1, 0, 0, 0, 1, 0, 0]]


@settings(max_examples=40, **SETTINGS)
@given(tree_list=st.lists(trees(max_nodes=64, vocab=V), min_size=1, max_size=3), bucket=st.sampled_from([64, 128]))
def test_ancestor_masks_are_the_trees_masks(tree_list, bucket):
    """Computed from parents on fixed shapes, each tree's mask is its Tree.attention_mask; a
    padded token (parent -1) sees the committed prefix and itself."""
    parents = torch.full((len(tree_list), bucket), -1)
    for r, t in enumerate(tree_list):
        parents[r, :t.num_nodes] = t.parents
    got = ancestor_masks(parents)
    for r, t in enumerate(tree_list):
        n = t.num_nodes
        want = torch.eye(bucket, dtype=torch.bool)
        want[:n, :n] = t.attention_mask()
        assert torch.equal(got[r], want)
        assert torch.equal(got[r].sum(-1)[:n] - 1, t.depth)


def greedy_trees(model, prompts):
    """Per prompt, a tree whose root is the target's greedy token after the prompt and whose
    greedy path runs 2 or 3 nodes deep, each correct node after a wrong sibling (so the path's
    K/V must move to be kept); the last prompt's third node is wrong."""
    out = []
    for i, p in enumerate(prompts):
        g = hf_greedy(model, p, 4)
        last = g[3] if i < len(prompts) - 1 else (g[3] + 1) % V
        out.append(Tree([-1, 0, 0, 2, 2, 4], [g[0], (g[1] + 1) % V, g[1], (g[2] + 1) % V, g[2], last]))
    return out


@pytest.mark.parametrize("compile", [False, True])
def test_accepting_on_the_device_gives_the_hosts_verdicts_and_kv(compile):
    """Built with ``accept``, the fixed-shape forward returns the host rule's verdicts on today's
    forward's logits; after committing its kept positions in place, the cache's committed K/V
    are those a host commit (moving the path's entries) leaves, and the features handed back
    are those at the path's nodes. Eager and compiled; the paths do move entries."""
    torch._dynamo.reset()
    model = model_of("llama", 2)
    runner = ModelRunner(model, "torch", feature_layers=[0, FINAL_NORM])
    prompts = [[5, 9, 2, 7, 1], [3, 3], [8], [4, 4, 6]]  # the last: a finished request's row, all padding
    tree_list = greedy_trees(model, prompts[:3])
    got = {}
    for device in (False, True):
        cache, seqs = runner.new_rows_cache(4, fixed_row_tokens(8, 6, "compile" if compile else True), 4)
        with runner.attached():
            runner.forward(cache, seqs, [torch.tensor(p) for p in prompts], [torch.arange(len(p)) for p in prompts],
                           [causal_mask(len(p)) for p in prompts], logits_rows=[[len(p) - 1] for p in prompts])
            for s_, p in zip(seqs, prompts):
                cache.commit(s_, torch.arange(len(p)))
            cached = [len(p) for p in prompts[:3]]
            if device:
                verify = FixedShapeVerify(runner, cache, seqs, compile=compile, accept=True)
                out = verify.forward(seqs[:3], tree_list, cached, capture=True)
                verdicts, features = out.verdicts, [f[: len(v.path)] for f, v in zip(out.features, out.verdicts)]
                keep = [range(len(v.path)) for v in verdicts]
            else:
                out = runner.forward(cache, seqs[:3], [t.tokens for t in tree_list],
                                     [t.position_ids(L) for t, L in zip(tree_list, cached)],
                                     [t.attention_mask() for t in tree_list], capture=True)
                verdicts = accept(tree_list, torch.stack([x.argmax(-1) for x in out.logits]))
                features = [f[v.path] for f, v in zip(out.features, verdicts)]
                keep = [v.path for v in verdicts]
            keep[0] = keep[0][:2]  # an end (an EOS, the budget) after the first accepted token
            for s_, L, k in zip(seqs, cached, keep):
                cache.commit(s_, [L + j for j in k])
            # the rows verified (the padding row's K/V are scratch: its request ended, filed already)
            got[device] = (verdicts, features, [cache.read(s_, 0, cache.seq_lens[s_]) for s_ in seqs[:3]])
    assert got[True][0] == got[False][0]
    assert [len(v.path) for v in got[True][0]] == [4, 4, 3]
    assert [len(kv) for kv in got[True][2]] == [7, 6, 4]
    for a, b in zip(got[True][1] + got[True][2], got[False][1] + got[False][2]):
        assert a.shape == b.shape and (a - b).abs().max() < ATOL


def test_a_wrong_committed_length_fails_the_comparison(monkeypatch):
    """The comparison has teeth: a mask that hides the last committed token changes the logits."""
    import treespec.fixed_shape as fs

    real = fs.tree_rows_mask
    monkeypatch.setattr(fs, "tree_rows_mask", lambda c, m, cap: real(c - 1, m, cap) & real(c, m, cap))
    want, got, _, _ = both_forwards(model_of("llama"), [[5, 9, 2, 7]], [Tree.chain(2, [1, 2, 3])])
    assert (want.logits[0] - got.logits[0]).abs().max() > 100 * ATOL


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="fixed_shapes must be False"):
        treespec.generate(model_of("llama"), "ngram", "cpu", [1, 2, 3], max_new_tokens=4, fixed_shapes="yes")


# ---- generate ---------------------------------------------------------------------------------


def count_fixed(monkeypatch) -> list[int]:
    """[fixed-shape forwards, fallbacks] over every FixedShapeVerify made from now on."""
    counts = [0, 0]
    real = FixedShapeVerify.forward

    def forward(self, *args, **kw):
        before = (self.fixed_forwards, self.fallbacks)
        out = real(self, *args, **kw)
        counts[0] += self.fixed_forwards - before[0]
        counts[1] += self.fallbacks - before[1]
        return out

    monkeypatch.setattr(FixedShapeVerify, "forward", forward)
    return counts


PROMPTS = [[5, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 7, 7], [1]]


@pytest.mark.parametrize("kind", ["ngram", "model", "eagle3", "eagle1", "hybrid"])
@pytest.mark.parametrize("tree_cfg", ["cpu", "chain-3", "medusa-63"])
def test_greedy_tokens_equal_todays_and_hf(kind, tree_cfg, monkeypatch):
    model, drafter = pair(kind)
    counts = count_fixed(monkeypatch)
    want = treespec.generate(model, drafter, tree_cfg, PROMPTS, max_new_tokens=24, attention_backend="torch")
    got = treespec.generate(model, drafter, tree_cfg, PROMPTS, max_new_tokens=24, attention_backend="torch",
                            fixed_shapes=True)
    assert got.sequences == want.sequences
    assert [got.sequences[0]] == [hf_greedy(model, PROMPTS[0], 24)]
    assert counts[0] > 0 and (counts[1] == 0 or kind == "hybrid")  # medusa-63 + lookup: past 64 tokens


@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_seeded_sampling_gives_todays_tokens(kind):
    model, drafter = pair(kind, peak=3.0)  # flat enough for samples to differ from the argmax
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7, attention_backend="torch")
    want = treespec.generate(model, drafter, "cpu", PROMPTS, **kw)
    got = treespec.generate(model, drafter, "cpu", PROMPTS, fixed_shapes=True, **kw)
    assert got.sequences == want.sequences
    greedy = treespec.generate(model, drafter, "cpu", PROMPTS, max_new_tokens=24, fixed_shapes=True)
    assert greedy.sequences != got.sequences  # the sampling shows


@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_a_prefix_cache_hit_gives_the_same_tokens(kind):
    model, drafter = pair(kind)
    cache = PrefixCache(1 << 20)
    first = treespec.generate(model, drafter, "cpu", [PROMPTS[0]], max_new_tokens=16, prefix_cache=cache,
                              fixed_shapes=True)
    again = [PROMPTS[0] + first.sequences[0] + [3, 4]]
    got = treespec.generate(model, drafter, "cpu", again, max_new_tokens=16, prefix_cache=cache, fixed_shapes=True)
    assert got.metrics.requests[0].hit_tokens > 0
    assert got.sequences == treespec.generate(model, drafter, "cpu", again, max_new_tokens=16).sequences


# ---- compiled -----------------------------------------------------------------------------------


def test_compiled_forward_compiles_once_per_bucket_and_equals_eager():
    """Three buckets, each met at several prefix lengths and trees: three graphs (one per
    bucket), logits within fp32 rounding of the eager forward's."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    model = model_of("llama", 3)
    runner = ModelRunner(model, "torch", feature_layers=[0, FINAL_NORM])
    cache, seqs = runner.new_rows_cache(2, fixed_row_tokens(40, 8, "compile"), 4)
    eager_cache, _ = runner.new_rows_cache(2, fixed_row_tokens(40, 8, "compile"), 4)
    compiled = FixedShapeVerify(runner, cache, seqs, compile=True)
    eager = FixedShapeVerify(runner, eager_cache, seqs)
    dynamo_utils.counters.clear()
    graphs = []
    with runner.attached():
        for step in range(8):
            n = [2, 6, 3, 8, 1, 5, 4, 7][step]  # buckets 4, 8 and 1, prefixes growing from 0
            tree_list = [Tree.chain(n - 1, [(step + i + j) % V for i in range(n)]) for j in range(2)]
            cached = [3 * step, 2 * step + 1]
            a = compiled.forward(seqs, tree_list, cached, capture=True)
            b = eager.forward(seqs, tree_list, cached, capture=True)
            for x, y in zip(a.logits + a.features, b.logits + b.features):
                assert (x - y).abs().max() < ATOL
            for s, L in zip(seqs, cached):  # the next step's prefix grows past this one's
                for c in (cache, eager_cache):
                    c.seq_lens[s] = L
            graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert compiled.fixed_forwards == 8
    assert graphs == [1, 2, 2, 2, 3, 3, 3, 3], graphs  # bucket 4 at step 0, 8 at step 1, 1 at step 4, then none
    assert not dynamo_utils.counters["graph_break"]


def test_narrowed_keys_compile_once_and_equal_the_whole_row():
    """On a CPU a forward attends over the longest row's keys in use, rounded up to KEY_STEP: as
    the prefix crosses several multiples of it the compiled forward adds no graph (the key count
    is symbolic), and its logits are those of an eager forward over each row's whole capacity."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    model = model_of("llama", 5)
    runner = ModelRunner(model, "torch", feature_layers=[0, FINAL_NORM])
    rows = fixed_row_tokens(330, 8, "compile")
    cache, seqs = runner.new_rows_cache(2, rows, 4)
    whole_cache, _ = runner.new_rows_cache(2, rows, 4)
    compiled = FixedShapeVerify(runner, cache, seqs, compile=True)
    whole = FixedShapeVerify(runner, whole_cache, seqs)
    whole.narrow = False
    prompt = torch.randint(0, V, (330,), generator=torch.Generator().manual_seed(5))
    dynamo_utils.counters.clear()
    keys = set()
    with runner.attached():
        for s in seqs:  # a long committed prefix in every row, the same in both caches
            for c in (cache, whole_cache):
                runner.forward(c, [s], [prompt], [torch.arange(330)], [causal_mask(330)], logits_rows=[[329]])
                c.commit(s, torch.arange(330))
        for step, (n, L) in enumerate([(5, 10), (7, 70), (6, 150), (8, 190), (5, 300), (6, 322)]):  # bucket 8 throughout
            tree_list = [Tree.chain(n - 1, [(step + i + j) % V for i in range(n)]) for j in range(2)]
            cached = [L, max(L - 9, 0)]
            for s, c in ((s, c) for s in seqs for c in (cache, whole_cache)):
                c.seq_lens[s] = 0  # the trees overwrite the prompt's K/V past each committed length
            a = compiled.forward(seqs, tree_list, cached, capture=True)
            b = whole.forward(seqs, tree_list, cached, capture=True)
            keys.add(compiled._keys(8))
            for x, y in zip(a.logits + a.features, b.logits + b.features):
                assert (x - y).abs().max() < ATOL
    assert keys == {64, 128, 192, 256, 320, 384} and compiled.capacity == rows > 384
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dynamo_utils.counters["stats"]
    assert not dynamo_utils.counters["graph_break"]


def test_generate_compiled_gives_todays_tokens():
    """And a later call, other prompts and budget of the same row capacity, compiles nothing."""
    import torch._dynamo.utils as dynamo_utils

    model, drafter = pair("eagle3")
    for prompts, budget in ((PROMPTS[:2], 12), (PROMPTS[1:], 14)):
        want = treespec.generate(model, drafter, "chain-3", prompts, max_new_tokens=budget)
        got = treespec.generate(model, drafter, "chain-3", prompts, max_new_tokens=budget, fixed_shapes="compile")
        assert got.sequences == want.sequences
        if budget == 12:
            graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("accept", [False, True])
def test_precompile_compiles_each_bucket_once_and_steps_compile_nothing(accept):
    """``precompile`` compiles every bucket up to the tree's (1, 4 and 8 here) before the first
    step; the steps then add no graph, and a second verify over a cache of the same shape
    (the next generate call) compiles nothing, precompile included; with acceptance inside the
    body as without, and no graph break."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    model = model_of("llama", 4)
    runner = ModelRunner(model, "torch", feature_layers=[0, FINAL_NORM])
    with runner.attached():
        for call in range(2):
            cache, seqs = runner.new_rows_cache(1, fixed_row_tokens(30, 8, "compile"), 4)
            verify = FixedShapeVerify(runner, cache, seqs, compile=True, accept=accept)
            seconds = verify.precompile(8, capture=True)
            graphs = dynamo_utils.counters["stats"]["unique_graphs"]
            if call == 0:
                assert seconds > 0 and graphs == 3, graphs  # buckets 1, 4 and 8
            else:
                assert seconds == 0.0 and graphs == 3
            for step, n in enumerate((1, 3, 8, 5)):
                verify.forward(seqs, [Tree.chain(n - 1, [(step + i) % V for i in range(n)])], [2 * step + 1],
                               capture=True)
            assert dynamo_utils.counters["stats"]["unique_graphs"] == 3
    assert verify.fixed_forwards == 4 and not dynamo_utils.counters["graph_break"]


def test_compiling_is_no_steps_time():
    """What the verify's and the head's compiles take is counted in ``compile_seconds`` and left
    out of the call's time and its stages'."""
    import time

    from treespec import fixed_shape

    torch._dynamo.reset()
    model, drafter = pair("eagle3")
    fixed_shape._COMPILED.pop(model, None)  # compiled by an earlier test, before the reset
    drafter = drafter.with_compiled_passes()
    t0 = time.perf_counter()
    m = treespec.generate(model, drafter, "chain-3", PROMPTS[:1], max_new_tokens=10, fixed_shapes="compile").metrics
    wall = time.perf_counter() - t0
    assert m.compile_seconds > 0.3 * wall  # the verify's buckets, then the head's passes
    assert m.total_seconds <= wall - m.compile_seconds + 0.01
    assert m.draft_seconds + m.verify_seconds + m.prefill_seconds <= m.total_seconds


def test_eager_precompile_does_nothing():
    model = model_of("llama", 4)
    runner = ModelRunner(model, "torch")
    cache, seqs = runner.new_rows_cache(1, fixed_row_tokens(10, 4, True), 4)
    assert FixedShapeVerify(runner, cache, seqs).precompile(4, capture=False) == 0.0


@pytest.mark.parametrize("weights", ["packed", "int4", "int8"])
def test_compiled_forward_on_packed_and_int4_weights_equals_eager(weights):
    """Compiled: oneDNN-packed linears (treespec.packing: the compile calls their packed weights
    through treespec::packed_linear), 4-bit and 8-bit ones (treespec.models.quant) give the eager
    forward's logits within bf16 rounding, in one graph with no break."""
    from treespec.models.quant import quantize_linears
    from treespec.packing import PackedLinears, packing_supported

    torch._dynamo.reset()
    model = tiny_model("llama", 6, layers=2, hidden=64).to(torch.bfloat16)
    if weights == "packed" and not packing_supported(model):
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU (no AVX512 BW/VL/DQ or AVX-NE-CONVERT)")
    if weights in ("int4", "int8"):
        quantize_linears(model, weights)
    import torch._dynamo.utils as dynamo_utils

    dynamo_utils.counters.clear()
    swap = PackedLinears(model) if weights == "packed" else contextlib.nullcontext()
    runner = ModelRunner(model, "torch")
    tree_list = [Tree([-1, 0, 0, 1, 2], [3, 9, 4, 7, 1])]
    got = []
    with swap:
        for compile in (False, True):
            cache, seqs = runner.new_rows_cache(1, fixed_row_tokens(16, 8, "compile"), 4)
            with runner.attached():
                verify = FixedShapeVerify(runner, cache, seqs, compile=compile)
                for L in (5, 9):
                    out = verify.forward(seqs, tree_list, [L])
            got.append(out.logits[0].float())
    assert (got[0] - got[1]).abs().max() <= 2e-2 * got[0].abs().max()
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1 and not dynamo_utils.counters["graph_break"]


def test_compiled_bf16_logits_are_eagers_within_bf16_rounding():
    model = tiny_model("llama", 5, layers=2).to(torch.bfloat16)
    runner = ModelRunner(model, "torch")
    tree_list = [Tree([-1, 0, 0, 1], [3, 9, 4, 7])]
    got = []
    for compile in (False, True):
        cache, seqs = runner.new_rows_cache(1, fixed_row_tokens(16, 4, "compile"), 4)
        with runner.attached():
            verify = FixedShapeVerify(runner, cache, seqs, compile=compile)
            for L in (5, 9):  # the second call replays the first's graph
                out = verify.forward(seqs, tree_list, [L])
        got.append(out.logits[0].float())
    assert (got[0] - got[1]).abs().max() <= 2e-2 * got[0].abs().max()


def test_two_models_of_one_shape_each_run_their_own_compiled_graphs():
    """Compiled, the verify forward's calls skip dynamo's guards on the model's modules
    (treespec.compiled.compile_for_model), so nothing in the guards tells two models of one
    shape apart: each model compiles a body of its own, and the second runs its own weights, not
    the first's frozen into the first's graphs."""
    torch._dynamo.reset()
    tree_list = [Tree([-1, 0, 0, 1], [3, 9, 4, 7])]
    models = [tiny_model("llama", seed, layers=2).to(torch.bfloat16) for seed in (5, 6)]
    logits = []
    for model in models:
        runner = ModelRunner(model, "torch")
        got = []
        for compile in (False, True):
            cache, seqs = runner.new_rows_cache(1, fixed_row_tokens(16, 4, "compile"), 4)
            with runner.attached():
                got.append(FixedShapeVerify(runner, cache, seqs, compile=compile).forward(seqs, tree_list, [5])
                           .logits[0].float())
        assert (got[0] - got[1]).abs().max() <= 2e-2 * got[0].abs().max()
        logits.append(got[0])
    assert (logits[0] - logits[1]).abs().max() > 0.1  # two models indeed


# ---- reads back to the host (issue 47, item 4's proxy) -------------------------------------------

# What waits for the device on a GPU: a scalar read (item, int(), bool()), a comparison that
# answers in Python, an output whose size depends on the data; ``tolist``, ``cpu`` and ``numpy``
# are counted apart (they do not go through the dispatcher).
READS = ("_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero")
HOST_DATA = ("lift_fresh", "lift", "lift_fresh_copy")  # torch.tensor(a list or an array): the host's


class _Counts(TorchDispatchMode):
    """ATen operations dispatched on the device's tensors, by region: ``"captured"``, the bodies a
    CUDA graph holds (the fixed-shape verify's: its forward, the acceptance rule and the K/V's
    compaction; the draft head's static passes and whole draft); ``"verify"``, the rest of the
    loop's tree forward, verdicts and commit; ``"draft"``, everything else of a step (the
    drafter's proposal and commit, the trees' pruning and sizing).

    On a CPU every tensor is in one memory; a GPU keeps a tree's bookkeeping on the host, where an
    operation launches nothing and a read waits for nothing. So a tensor counts as the device's
    when it holds the modules' weights, when a captured body reads or writes it (the cache, the
    buffers a graph reads), or when an operation makes it from a device tensor. An operation
    counts when one of its tensors is the device's, when it runs in a captured body, or when it is
    a factory (``zeros``, ``arange``: one meant for the host cannot be told apart from one meant
    for the device, so all count, which can only count too much); a read counts on a device
    tensor only. Tensors made from host data (lists, numpy) or by factories, and what is made from
    them alone, stay the host's."""

    def __init__(self, modules=()):
        super().__init__()
        from torch.utils.weak import WeakTensorKeyDictionary

        self.region, self.ops = "draft", collections.Counter()
        self.device = WeakTensorKeyDictionary()
        for m in modules:
            for t in (*m.parameters(), *m.buffers()):
                self.device[t] = True

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        captured, device = self.region == "captured", any(self.on_device(t) for t in inputs)
        if captured or device or (not inputs and name not in HOST_DATA):
            self.ops[self.region, name] += 1
        if captured or device:
            for t in (*inputs, *torch.utils._pytree.tree_leaves(out)):
                if isinstance(t, torch.Tensor):
                    self.device[t] = True
        return out

    def read(self, t, how: str) -> None:
        """A ``tolist``, ``cpu`` or ``numpy`` of ``t``: a read when ``t`` is the device's."""
        if self.on_device(t):
            self.ops[self.region, how] += 1

    def enter(self, region: str, fn):
        """``fn`` with its dispatches counted in ``region``."""
        @functools.wraps(fn)
        def counted(*args, **kw):
            before, self.region = self.region, region
            try:
                return fn(*args, **kw)
            finally:
                self.region = before
        return counted

    def per_step(self, steps: int) -> dict:
        regions = ("captured", "verify", "draft")
        reads = {r: sum(c for (w, op), c in self.ops.items() if w == r and (op in READS or op in HOST_READS))
                 for r in regions}
        ops = {r: sum(c for (w, _), c in self.ops.items() if w == r) for r in regions}
        return {f"{k} {r}": round(v / steps, 2) for k, d in (("reads", reads), ("ops", ops)) for r, v in d.items()}

    def breakdown(self, region: str, steps: int, top: int = 12) -> dict:
        """The ``top`` operations of ``region``, a step."""
        ops = collections.Counter({op: c for (w, op), c in self.ops.items() if w == region})
        return {op: round(c / steps, 2) for op, c in ops.most_common(top)}


HOST_READS = ("tolist", "cpu", "numpy")


def counts_per_step(kind: str, fixed: bool, monkeypatch, tree="cpu", on_graphs: bool | str = False, **kw):
    """Reads and operations per decoding step (prefill left out) of one generation (greedy
    unless ``kw`` say otherwise), and the counter. ``on_graphs``: the head's passes on the
    shapes a GPU captures, drafting whole (True) or ``"level"`` by level."""
    from treespec.drafters.draft_graph import CommitPass, DraftGraph
    from treespec.drafters.graphs import _Pass
    from treespec.engine import loop

    model, drafter = pair(kind)
    if on_graphs:
        drafter = graphed(drafter, whole_draft=on_graphs != "level")
    if fixed == "graphs":  # the verify's graphs, their bodies run where a GPU would replay them
        _graphs_on_a_cpu(monkeypatch)
    counts = _Counts([model, *drafter.modules()])
    for name in ("_tree_forward", "_verify", "_commit"):
        monkeypatch.setattr(loop, name, counts.enter("verify", getattr(loop, name)))
    monkeypatch.setattr(FixedShapeVerify, "_body", counts.enter("captured", FixedShapeVerify._body))
    monkeypatch.setattr(_Pass, "_body", counts.enter("captured", _Pass._body))
    for body in (DraftGraph, CommitPass):
        monkeypatch.setattr(body, "_body", counts.enter("captured", body._body))
    for how in HOST_READS:
        real = getattr(torch.Tensor, how)
        monkeypatch.setattr(torch.Tensor, how, functools.partialmethod(
            lambda self, *a, _how=how, _real=real, **k: counts.read(self, _how) or _real(self, *a, **k)))
    steps = 0
    with counts:
        for out in treespec.stream(model, drafter, tree, [PROMPTS[0]], max_new_tokens=32, fixed_shapes=fixed,
                                   attention_backend="torch", **kw):
            if out.step == 0:
                counts.ops.clear()  # prefill and the draft session's start
            steps = out.step
    monkeypatch.undo()
    return counts.per_step(steps), counts, steps


def _graphs_on_a_cpu(monkeypatch) -> None:
    import weakref

    import treespec.compiled as compiled_mod
    import treespec.fixed_shape as fs
    import treespec.runner as runner_mod

    class Replayed:
        def __init__(self, body):
            self.replay = body

    monkeypatch.setattr(compiled_mod, "capture_graph", lambda body, pool: (body(), Replayed(body))[1])
    monkeypatch.setattr(fs, "_CAPTURED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(runner_mod, "check_graphs_device", lambda device: None)
    monkeypatch.setattr(runner_mod, "_SPARE_KV", weakref.WeakKeyDictionary())


@pytest.mark.parametrize("kind", ["ngram", "eagle3", "hybrid"])
def test_verify_to_commit_reads_the_host_once_a_step(kind, monkeypatch):
    """Per decoding step of a tiny model, greedy: on fixed shapes the verify forward, the
    acceptance rule and the K/V's compaction run in the one body a GPU captures, and the loop's
    stages from the tree forward to the commit read the device back once (the verdicts) and
    dispatch a score of operations outside it at most (the bucket's fill, the features handed on); today's
    path reads a dozen times and more. Sampled, the rule runs on the host, and reads as today."""
    today, *_ = counts_per_step(kind, False, monkeypatch)
    fixed, *_ = counts_per_step(kind, True, monkeypatch)
    print(f"\n{kind}: per step, today's path {today}\n{kind}: per step, fixed shapes {fixed}")
    assert fixed["reads captured"] == 0
    assert fixed["reads verify"] == 1 < today["reads verify"]
    assert fixed["ops verify"] <= 20 < today["ops verify"]
    sampled, *_ = counts_per_step(kind, True, monkeypatch, temperature=0.8, seed=3)
    assert sampled["reads verify"] > 1  # the rule on the host: the host's reads


def test_a_sampled_step_on_graphs_reads_the_host_once(monkeypatch):
    """Sampled with warpers, on the captured path (``fixed_shapes="graphs"``, bodies run
    uncaptured here), the rule runs inside the body (treespec/device_sampling.py): the stages from
    the tree forward to the commit read the device once, as greedy ones do, and dispatch a few
    more operations outside it (the noise written and copied in)."""
    kw = dict(temperature=0.8, top_p=0.9, seed=3)
    on_graphs, counts, steps = counts_per_step("eagle3", "graphs", monkeypatch, **kw)
    print(f"\neagle3, sampled: per step on graphs {on_graphs}\n  {counts.breakdown('verify', steps)}")
    assert on_graphs["reads captured"] == 0
    assert on_graphs["reads verify"] == 1
    assert on_graphs["ops verify"] <= 25


@pytest.mark.parametrize("kind", ["eagle3", "hybrid"])
def test_the_default_step_on_graphs_reads_the_device_twice(kind, monkeypatch):
    """Issue 47's budget. The default configuration (the head with lookup, ``auto`` trees; the
    head alone beside it) with everything on the shapes a GPU captures: the verify's body, and
    the head's commit pass and whole draft (``cuda_graphs=True``, run uncaptured here). A step
    reads the device twice, the tree and the verdicts, and launches at most 40 operations
    outside the captured bodies (fills of their buffers, the features handed on, factories of
    the trees' bookkeeping); drafted a level at a time, on the same graphed passes or eagerly,
    it reads a score of times and launches over a hundred."""
    from helpers.cost_curves import MID

    from treespec import AutoProfile

    kw = dict(tree="auto", auto_profile=AutoProfile(costs=MID))
    eager, *_ = counts_per_step(kind, True, monkeypatch, **kw)
    level, *_ = counts_per_step(kind, True, monkeypatch, on_graphs="level", **kw)
    whole, counts, steps = counts_per_step(kind, True, monkeypatch, on_graphs=True, **kw)
    print(f"\n{kind}, auto: per step, fixed shapes, the head eager {eager}\n{kind}, auto: per step, a pass a "
          f"level on graphs {level}\n{kind}, auto: per step, the whole draft on graphs {whole}"
          f"\n  outside the bodies: {counts.breakdown('draft', steps)} {counts.breakdown('verify', steps)}")
    assert whole["reads captured"] == 0
    for other in (eager, level):
        assert whole["reads verify"] + whole["reads draft"] == 2 < other["reads verify"] + other["reads draft"]
        assert whole["ops verify"] + whole["ops draft"] <= 40 < other["ops verify"] + other["ops draft"]


def _has_avx512() -> bool:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return "avx512" in str(pick_vec_isa() or "")


@pytest.mark.skipif(not _has_avx512(), reason="inductor's 4-bit GEMM templates need AVX-512 (or AMX); this CPU has neither")
@pytest.mark.parametrize("split", [False, True])
def test_compiled_cpu_forward_runs_inductors_gemm_templates_quietly(split, capfd):
    """Compiled on a CPU (treespec.compiled.cpu_options), the weights are frozen into the graph so
    that inductor's C++ GEMM templates take the linears, 4-bit ones de-quantized inside the
    product, also a width-split layer's above its width (``split``: its dense copy is for eager
    forwards); with no dense linear left the graph is one inductor caches on disk; choosing the
    kernels against ATen's (autotuning, in a fresh cache here) writes nothing to stdout or
    stderr; the logits are the eager forward's within bf16 rounding."""
    import torch._dynamo.utils as dynamo_utils
    from torch._inductor.utils import fresh_cache, run_and_get_code

    from treespec.models.quant import keep_dense, quantize_linears

    torch._dynamo.reset()
    model = tiny_model("llama", 7, layers=1, hidden=64).to(torch.bfloat16)
    quantize_linears(model, "int4", head=True)
    if split:
        keep_dense(model, max_rows=1)  # the 5-node tree's bucket of 8 is past it
    runner = ModelRunner(model, "torch")
    tree_list = [Tree([-1, 0, 0, 1, 2], [3, 9, 4, 7, 1])]
    got = []
    capfd.readouterr()
    dynamo_utils.counters.clear()
    with fresh_cache():
        for compile in (False, True):
            cache, seqs = runner.new_rows_cache(1, fixed_row_tokens(16, 8, "compile"), 4)
            with runner.attached():
                verify = FixedShapeVerify(runner, cache, seqs, compile=compile)
                out, code = run_and_get_code(verify.forward, seqs, tree_list, [5])
            got.append(out.logits[0].float())
    printed = capfd.readouterr()
    src = "\n".join(code)
    # the 4-bit products are inductor's template (a C++ kernel of its own), not ATen's kernel called from the graph
    assert "micro_gemm_is_block_start" in src and "int4mm_packed_weight_cpu" not in src
    assert "aten._weight_int4pack_mm_for_cpu" not in src and "mkldnn" not in src
    inductor = dynamo_utils.counters["inductor"]
    assert inductor["fxgraph_cache_miss"] == 1 and not inductor["fxgraph_cache_bypass"]
    assert not dynamo_utils.counters["graph_break"]
    assert "AUTOTUNE" not in printed.err + printed.out and "Autotune" not in printed.err + printed.out
    assert (got[0] - got[1]).abs().max() <= 2e-2 * got[0].abs().max()
