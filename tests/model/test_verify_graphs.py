"""The verify forward captured in CUDA graphs (``fixed_shapes="graphs"``, issue 47 item 1), held
on a CPU to a CUDA graph's contract: a capture records the body once, and every replay runs
that same body again, on the objects and buffers of the capture, whichever call replays it.

A fake graph stands in for ``torch.cuda.CUDAGraph`` (:func:`fake_graphs`): ``replay`` calls
the captured body, bound to the verifier that captured it (its cache object, its runner), and
fails on anything a capture could not hold (a read back to the host, an output whose size
depends on the data). A replay for a later call is right only if what the body reads is what
that call wrote: the buckets' buffers, each row's first slot and the cache's storage, which is
what a real graph's addresses pin. (What the fake cannot see: a freed tensor read by a real
replay; the key holds the addresses instead, and the GPU tests the real thing.) So the tests
hold that:

- captured forwards give the eager fixed-shape forward's logits, features and verdicts, step
  after step (hypothesis over trees, buckets and prefixes), one capture a bucket;
- ``generate(..., fixed_shapes="graphs")`` gives today's tokens (greedy, HF's own, seeded
  sampling, a batch), captures every bucket before the prefill, and a second call of the same
  layout replays the first call's graphs, a step a replay, without capturing; a call on
  another layout, another storage or moved weights captures its own; ``release_graphs`` lets
  them go;
- off CUDA, ``fixed_shapes="graphs"`` is refused with a message that says what to use.

The real capture is tested on a GPU (``tests/gpu/test_cuda_graphs.py``). Tiny targets (V = 64),
fp32, one thread.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import treespec
import treespec.compiled as compiled_mod
import treespec.fixed_shape as fs
import treespec.runner as runner_mod
from helpers.pairs import pair
from helpers.references import hf_greedy
from helpers.tiny import tiny_model
from helpers.trees import trees
from treespec.fixed_shape import BUCKETS, FixedShapeVerify, fixed_row_tokens
from treespec.mask import causal_mask
from treespec.runner import FINAL_NORM, ModelRunner

V = 64
ATOL = 1e-4
pytestmark = [pytest.mark.filterwarnings("ignore:the model accepted none"), pytest.mark.usefixtures("one_thread")]


UNCAPTURABLE = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "is_nonzero", "equal")


class NoReadsBack(TorchDispatchMode):
    """Fails on an operation a CUDA graph cannot capture: one that answers on the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        assert name not in UNCAPTURABLE, f"a captured body ran {name}: the host waits for the device"
        return func(*args, **(kwargs or {}))


class FakeGraph:
    """What a CUDA graph promises: ``replay`` runs the captured work again, as captured, and
    nothing in it reads back to the host."""

    def __init__(self, body):
        self.body = body

    def replay(self):
        with NoReadsBack():
            self.body()


@pytest.fixture
def fake_graphs(monkeypatch) -> list:
    """CUDA graphs on a CPU (the list: every body captured); the registry of captured rows is
    this test's own, and the runner takes ``fixed_shapes="graphs"`` off CUDA."""
    captured = []

    def capture(body, pool):
        body()  # the warm-up capture_graph runs first
        captured.append(body)
        graph = FakeGraph(body)
        graph.replay()  # the capture itself, where a read back fails
        return graph

    monkeypatch.setattr(compiled_mod, "capture_graph", capture)
    monkeypatch.setattr(fs, "_CAPTURED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(runner_mod, "check_graphs_device", lambda device: None)
    monkeypatch.setattr(runner_mod, "_SPARE_KV", weakref.WeakKeyDictionary())
    return captured


def prefilled(runner, prompts, rows):
    cache, seqs = runner.new_rows_cache(len(prompts), rows, 4)
    runner.forward(cache, seqs, [torch.tensor(p) for p in prompts], [torch.arange(len(p)) for p in prompts],
                   [causal_mask(len(p)) for p in prompts], logits_rows=[[len(p) - 1] for p in prompts])
    for s, p in zip(seqs, prompts):
        cache.commit(s, torch.arange(len(p)))
    return cache, seqs


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=20), min_size=1, max_size=2),
       steps=st.lists(st.sampled_from(BUCKETS[:4]), min_size=1, max_size=4),
       data=st.data())
def test_captured_forwards_equal_the_eager_ones_step_after_step(fake_graphs, prompts, steps, data):
    """Each step a tree per row (its bucket drawn), grown by the tokens the step commits: the
    captured verifier's outputs equal the eager one's on a copy of the same cache."""
    fake_graphs.clear()
    fs._CAPTURED.clear()
    model = tiny_model("llama", 0)
    runner = ModelRunner(model, "torch", feature_layers=[0, FINAL_NORM])
    rows = fixed_row_tokens(max(map(len, prompts)) + 3 * 16, 16, "graphs")
    with runner.attached():
        (c_eager, s_eager), (c_graph, s_graph) = (prefilled(runner, prompts, rows) for _ in range(2))
        eager = FixedShapeVerify(runner, c_eager, s_eager)
        graph = FixedShapeVerify(runner, c_graph, s_graph, graphs=True)
        lengths, used = [len(p) for p in prompts], set()
        for bucket in steps:
            tree_list = [data.draw(trees(max_nodes=bucket, vocab=V)) for _ in prompts]
            used.add(fs.bucket_for(max(t.num_nodes for t in tree_list)))
            want = eager.forward(s_eager, tree_list, lengths, capture=True)
            got = graph.forward(s_graph, tree_list, lengths, capture=True)
            for a, b in zip(want.logits + want.features, got.logits + got.features):
                assert a.shape == b.shape and (a - b).abs().max() < ATOL
            for cache, seqs in ((c_eager, s_eager), (c_graph, s_graph)):  # commit each tree's first node
                for s, L in zip(seqs, lengths):
                    cache.commit(s, [L])
            lengths = [L + 1 for L in lengths]
    assert graph.fixed_forwards == len(steps) and graph.fallbacks == 0
    assert len(fake_graphs) == len(graph._rows.graphs) == len(used)  # one capture a bucket


def test_acceptance_inside_a_replay_gives_the_eager_verdicts(fake_graphs):
    """``accept=True`` captured: the verdicts and features of the eager forward, and the same
    committed K/V, two steps running (the second replays the first's graph)."""
    model = tiny_model("llama", 2)
    runner = ModelRunner(model, "torch", feature_layers=[0, FINAL_NORM])
    prompts = [[5, 9, 2, 7, 1], [3, 3]]
    got = {}
    for graphs in (False, True):
        with runner.attached():
            cache, seqs = prefilled(runner, prompts, fixed_row_tokens(16, 8, "graphs"))
        verify = FixedShapeVerify(runner, cache, seqs, accept=True, graphs=graphs)
        lengths, out = [len(p) for p in prompts], []
        texts = [list(p) for p in prompts]
        for _ in range(2):  # root: the token after the committed ones; node 2 the greedy one after it, past node 1
            g = [hf_greedy(model, t, 3) for t in texts]
            tree_list = [treespec.Tree([-1, 0, 0, 2], [a, (b + 1) % V, b, c]) for a, b, c in g]
            with runner.attached():
                res = verify.forward(seqs, tree_list, lengths, capture=True)
            out.append((res.verdicts, [f[: len(v.path)].clone() for f, v in zip(res.features, res.verdicts)]))
            for s, L, v in zip(seqs, lengths, res.verdicts):
                cache.commit(s, [L + j for j in range(len(v.path))])
            lengths = [L + len(v.path) for L, v in zip(lengths, res.verdicts)]
            texts = [t + [int(x) for x in tree.tokens[v.path]] for t, tree, v in zip(texts, tree_list, res.verdicts)]
        got[graphs] = (out, [cache.read(s, 0, cache.seq_lens[s]) for s in seqs])
    (want_steps, want_kv), (got_steps, got_kv) = got[False], got[True]
    assert [v for v, _ in got_steps] == [v for v, _ in want_steps]
    assert all(len(v.path) > 1 for verdicts, _ in got_steps for v in verdicts)  # node 2's K/V moved
    for (_, a), (_, b) in zip(want_steps, got_steps):
        assert all((x - y).abs().max() < ATOL for x, y in zip(a, b))
    assert all(a.shape == b.shape and (a - b).abs().max() < ATOL for a, b in zip(want_kv, got_kv))
    assert len(fake_graphs) == 1


PROMPTS = [[5, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 7, 7], [1]]


@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_generate_on_graphs_gives_todays_tokens_and_a_second_call_captures_nothing(fake_graphs, kind, monkeypatch):
    model, drafter = pair(kind)
    kw = dict(max_new_tokens=24, attention_backend="torch")
    want = treespec.generate(model, drafter, "cpu", PROMPTS, **kw)
    at_prefill = []  # the captures made when the prefill's forward runs
    real = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, *a, **k: (at_prefill.append(len(fake_graphs)),
                                                                        real(self, *a, **k))[1])
    first = treespec.generate(model, drafter, "cpu", PROMPTS, fixed_shapes="graphs", **kw)
    captures = len(fake_graphs)
    second = treespec.generate(model, drafter, "cpu", PROMPTS, fixed_shapes="graphs", **kw)
    assert first.sequences == second.sequences == want.sequences
    assert first.sequences[0] == hf_greedy(model, PROMPTS[0], 24)
    assert captures >= 2 and at_prefill[0] == captures  # every bucket captured before the prefill
    assert len(fake_graphs) == captures  # and none again
    graphs = fs._CAPTURED[model].graphs.values()
    replays = sum(g.replays for g in graphs)
    one = treespec.generate(model, drafter, "cpu", PROMPTS[:1], fixed_shapes="graphs", **kw)  # another layout
    rows = fs._CAPTURED[model]  # a replay a step, and one a bucket where precompile captured it
    assert sum(g.replays for g in rows.graphs.values()) == one.metrics.num_request_steps + len(rows.graphs)
    assert sum(g.replays for g in graphs) == replays  # the old layout's graphs, let go, replayed no more


def test_another_layout_or_storage_captures_its_own_graphs(fake_graphs):
    """A batch of another size is another layout; a cache on new storage (the spare dropped)
    has other addresses: each captures again, and its tokens are still today's. Replaying the
    old graphs there would run the old cache's forward: other tokens."""
    model, drafter = pair("ngram")
    kw = dict(max_new_tokens=20, attention_backend="torch")
    treespec.generate(model, drafter, "cpu", PROMPTS, fixed_shapes="graphs", **kw)
    n = len(fake_graphs)
    two = treespec.generate(model, drafter, "cpu", PROMPTS[:2], fixed_shapes="graphs", **kw)
    assert len(fake_graphs) > n
    assert two.sequences == treespec.generate(model, drafter, "cpu", PROMPTS[:2], **kw).sequences
    n = len(fake_graphs)
    runner_mod._SPARE_KV.clear()
    again = treespec.generate(model, drafter, "cpu", PROMPTS[:2], fixed_shapes="graphs", **kw)
    assert len(fake_graphs) > n and again.sequences == two.sequences
    n = len(fake_graphs)  # weights moved (a reload, .to and back): a replay would read where they were
    weight = model.get_output_embeddings().weight
    before = weight.data
    try:
        weight.data = weight.data.clone()
        moved = treespec.generate(model, drafter, "cpu", PROMPTS[:2], fixed_shapes="graphs", **kw)
    finally:
        weight.data = before
    assert len(fake_graphs) > n and moved.sequences == two.sequences
    assert fs.release_graphs(model) and model not in fs._CAPTURED and model not in runner_mod._SPARE_KV
    assert not fs.release_graphs(model)


@pytest.mark.parametrize("options, on_device", [
    (dict(temperature=0.9, top_p=0.95), "sample:temperature:top_p"),
    (dict(temperature=[0.7, 0, 1.3], top_k=20, min_p=0.05), "sample:min_p:temperature:top_k"),  # one greedy
    (dict(temperature=1.0), "sample"),
    (dict(temperature=0.8, repetition_penalty=1.2), False),  # a processor of the history: the host's rule
])
def test_seeded_sampling_on_graphs_gives_todays_tokens(fake_graphs, options, on_device):
    """Sampled requests whose processors are warpers of the scores alone accept inside the
    captured forward (treespec/device_sampling.py), each with its own parameters, the noise of its
    positions copied in before each replay: today's tokens, from the host's rule. Any other
    processor keeps the host's rule, on the replay's logits."""
    model, drafter = pair("eagle3", peak=3.0)
    kw = dict(max_new_tokens=24, seed=7, attention_backend="torch", **options)
    want = treespec.generate(model, drafter, "cpu", PROMPTS, **kw)
    got = treespec.generate(model, drafter, "cpu", PROMPTS, fixed_shapes="graphs", **kw)
    assert got.sequences == want.sequences
    assert {accept for _, _, accept, _ in fs._CAPTURED[model].graphs} == {on_device}
    assert got.metrics.mean_accepted_length > 1  # drafts were taken: the verdicts are used


def test_graphs_off_cuda_are_refused():
    with pytest.raises(ValueError, match="needs the model on a CUDA device.*fixed_shapes='compile'"):
        treespec.generate(tiny_model("llama", 0), "ngram", "cpu", [1, 2, 3], max_new_tokens=4, fixed_shapes="graphs")
    with pytest.raises(ValueError, match="compiled .* or captured"):
        runner = ModelRunner(tiny_model("llama", 0), "torch")
        cache, seqs = runner.new_rows_cache(1, 64, 4)
        FixedShapeVerify(runner, cache, seqs, compile=True, graphs=True)


def test_a_buckets_pinned_host_copy_holds_its_buffers(monkeypatch):
    """On CUDA each bucket is filled on a pinned host copy (``_Bucket.pinned``): the same three
    buffers, new memory, no copy event yet. (A CPU build cannot pin: the copy stands in for it.)"""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    b = fs._Bucket.empty(2, 4, "cpu")
    b.ids[1, 2], b.committed[0] = 7, 5
    host = b.pinned()
    for name in ("ids", "parents", "committed"):
        assert torch.equal(getattr(host, name), getattr(b, name))
        assert getattr(host, name).data_ptr() != getattr(b, name).data_ptr()
    assert host.copied is None
