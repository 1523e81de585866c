"""How an EAGLE session runs its head: the pass strategy it picks at start (StaticRowPasses over
RowPasses over PackedPasses), the lean single-request pass drafting the general pass's trees,
static passes (the shapes CUDA graphs capture) computing the lean pass, and a graphed row lent
to one session at a time, coming back zeroed. The CUDA half is tests/gpu/test_cuda_graphs.py.

Sizes: target vocabulary V = 64, hidden H = 32; EAGLE-3 draft vocabulary Vd = 40.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from helpers.eagle_heads import H, V, VD, drawn_request, eagle_target, hf_features, start_session
from helpers.references import hf_greedy
from helpers.tiny import assert_sessions_draft_alike, dynamic_configs
from treespec import TreeConfig
from treespec.drafters.base import DraftStart
from treespec.drafters.eagle_passes import PackedPasses, RowPasses, StaticRowPasses

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


# ---- the lean single-request pass ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), data=st.data())
def test_lean_single_request_pass_drafts_the_general_trees(eagle_ckpts, kind, dtype, seed, data):
    """One request on a CPU runs the head through :class:`RowPasses` (RoPE from a table, fp32
    SDPA over the request's row, no batch plan). It must draft exactly the trees the packed
    pass through the torch backend drafts, tokens and scores bit for bit, through proposals, multi-token commits
    and a tree config drawn at random, in fp32 and bf16."""
    model, drafter, cfg, full, n, feats = drawn_request(eagle_ckpts, kind, dtype, seed, data)
    sessions = []
    for lean in (True, False):
        s = drafter.start(model, DraftStart([full[:n]], [full[n]], [feats[:n]], 24, cfg))
        assert type(s.passes) is RowPasses  # one request, torch backend, CPU
        if not lean:
            s.passes = s.passes.fallback
            assert type(s.passes) is PackedPasses
        sessions.append(s)
    commits = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    assert_sessions_draft_alike(sessions, full, feats, n, commits, cfg.depth)


def test_the_session_picks_its_passes_at_start(eagle_ckpts):
    """The strategy that runs the head is decided when a session starts: on a CPU with the torch
    backend (or flex, which reads K/V as it does) the lean row pass over the packed pass (which
    takes batches), whether it starts with one request or several; with the drafter's graphed
    row its static passes over the lean pass, until the session closes. (The packed pass alone
    runs on a GPU without graphs.) Every session of a head attends through one backend object,
    built once for the head."""
    from treespec.attention import FlexBackend, TorchBackend, backend_for
    from treespec.drafters.graphs import GraphedRow

    model = eagle_target("eagle3")
    path = eagle_ckpts("eagle3")[0]
    drafter = treespec.load_draft(path, model)
    one = start_session(drafter, model, [[1, 2, 3]], [4])
    two = start_session(drafter, model, [[1, 2, 3], [5, 6]], [4, 7])
    assert type(one.passes) is RowPasses and type(two.passes) is RowPasses and one.static is None
    backend = one.passes.fallback.backend
    assert type(backend) is TorchBackend and two.passes.fallback.backend is backend
    assert backend_for(drafter.head, "torch", "cpu") is backend
    flex = start_session(treespec.load_draft(path, model, attention_backend="flex"), model, [[1, 2, 3]], [4])
    assert type(flex.passes) is RowPasses and type(flex.passes.fallback.backend) is FlexBackend
    graphed = treespec.load_draft(path, model, cuda_graphs=True)
    graphed.graphed_row = GraphedRow(capture=False)
    s = start_session(graphed, model, [[1, 2, 3]], [4])
    assert type(s.passes) is StaticRowPasses and type(s.passes.fallback) is RowPasses
    assert s.static is graphed.graphed_row.passes
    s.close()
    assert type(s.passes) is RowPasses and s.static is None


# ---- static head passes (the shapes CUDA graphs capture) -----------------------------------------


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), data=st.data())
def test_static_passes_draft_the_lean_trees(eagle_ckpts, kind, seed, data):
    """The static passes (:mod:`treespec.drafters.graphs`, run eagerly here: capturing needs
    CUDA) attend over the request's whole row with the keys past the pass masked out, and read
    their inputs from fixed buffers. Masked keys add exact zeros, so in fp32 they draft the
    lean pass's trees: the same tokens and parents, scores and root log-probabilities within
    rounding (the attention kernel sums a longer row in another order: about 1e-7 apart here),
    through proposals, multi-token commits and a random tree config. A wrong mask, slot or
    position moves the scores by far more (each fails this test)."""
    model = eagle_target(kind, peak=4.0)
    drafter = treespec.load_draft(eagle_ckpts(kind)[0], model)
    cfg = data.draw(dynamic_configs(max_top_k=4, max_nodes=16))
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, V, (40,), generator=g).tolist()
    n = data.draw(st.integers(1, 12))
    feats = hf_features(model, full, drafter.features_for(model))
    sessions = [drafter.start(model, DraftStart([full[:n]], [full[n]], [feats[:n]], 24, cfg)) for _ in range(2)]
    sessions[1].use_static_passes(capture=False)
    sessions[1].whole_draft = False  # a pass a level (whole: tests/drafters/test_draft_graph.py)
    calls = []
    run = sessions[1].static.run
    sessions[1].static.run = lambda *a: calls.append(a[3].shape) or run(*a)
    pos = n
    for commit in data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)):
        trees = [s.propose([0], [full[pos]], [cfg.depth]) for s in sessions]
        assert torch.equal(trees[0][0].tokens, trees[1][0].tokens)
        assert torch.equal(trees[0][0].parents, trees[1][0].parents)
        torch.testing.assert_close(trees[0][0].scores, trees[1][0].scores, atol=1e-5, rtol=0)
        for s in sessions:
            s.commit([0], [full[pos + 1: pos + 1 + commit]], [feats[pos: pos + commit]])
        pos += commit
        torch.testing.assert_close(sessions[0].root_logp[0], sessions[1].root_logp[0], atol=1e-5, rtol=0)
    assert calls  # the commits (and levels past the first) went through the static passes


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), data=st.data())
def test_a_static_pass_computes_the_lean_pass(eagle_ckpts, kind, dtype, seed, data):
    """One pass of a random tree level (k entries seeing a random ancestor-closed part of m
    tree entries) after a random prefix, static and lean on the same cache: the same states
    and log-probabilities up to the attention's summation order, which in bf16 may round an
    element of the attention's output to the neighbouring bf16 value (hence bf16's
    tolerances; trees are compared in fp32 above)."""
    model = copy.deepcopy(eagle_target(kind, peak=4.0)).to(dtype)
    drafter = treespec.load_draft(eagle_ckpts(kind)[0], model)
    drafter.head.to(dtype)
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, V, (40,), generator=g).tolist()
    n = data.draw(st.integers(1, 20))
    feats = hf_features(model, full, drafter.features_for(model)).to(dtype)
    s = drafter.start(model, DraftStart([full[:n]], [full[n]], [feats[:n]], 24, TreeConfig.chain(4)))
    s.use_static_passes(capture=False)
    k, earlier = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 8))
    m = earlier + k
    mask = torch.zeros(k, m, dtype=torch.bool)
    mask[:, earlier:] = torch.eye(k, dtype=torch.bool)
    mask[:, :earlier] = torch.rand(k, earlier, generator=g) < 0.5
    tokens = torch.randint(0, V, (k,), generator=g)
    hidden = torch.randn(k, H, generator=g).to(dtype)
    positions = n - 1 + torch.randint(1, 6, (k,), generator=g)
    static_states, static_logp = s.static.run(tokens, hidden, positions, mask, s.cache.seq_lens[s.seq[0]])
    assert type(s.passes) is StaticRowPasses and type(s.passes.fallback) is RowPasses
    lean_states = s.passes.fallback.run_one(s.seq[0], tokens, hidden, positions, mask)  # the same K/V, slots
    with torch.inference_mode():
        lean_logp = drafter.head.logits(lean_states).float().log_softmax(-1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(static_states.float(), lean_states.float(), **tol)
    torch.testing.assert_close(static_logp, lean_logp, **({"atol": 1e-5, "rtol": 0} if dtype == torch.float32
                                                          else {"atol": 5e-2, "rtol": 0}))


def test_static_passes_refuse_ids_of_another_dtype(eagle_ckpts):
    """The buffers a graph replays are int64: int32 ids (or float positions) are refused with a
    TypeError, not reinterpreted."""
    model = eagle_target("eagle3")
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model)
    s = drafter.start(model, DraftStart([[1, 2, 3]], [4], [hf_features(model, [1, 2, 3, 4],
                                                                        drafter.features_for(model))[:3]], 8,
                                        TreeConfig.chain(3)))
    s.use_static_passes(capture=False)
    hidden = torch.zeros(2, H)
    mask = torch.ones(2, 2, dtype=torch.bool).tril()
    with pytest.raises(TypeError, match="tokens must be int64"):
        s.static.run(torch.tensor([1, 2], dtype=torch.int32), hidden, torch.tensor([3, 4]), mask, 3)
    with pytest.raises(TypeError, match="positions must be int64"):
        s.static.run(torch.tensor([1, 2]), hidden, torch.tensor([3.0, 4.0]), mask, 3)
    states, logp = s.static.run(torch.tensor([1, 2]), hidden, torch.tensor([3, 4]), mask, 3)
    assert states.shape == (2, H) and logp.shape == (2, VD)


def test_cuda_graphs_need_a_cuda_head(eagle_ckpts):
    model = eagle_target("eagle3")
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model, cuda_graphs=True)
    start = DraftStart([[1, 2, 3]], [4], [hf_features(model, [1, 2, 3, 4], drafter.features_for(model))[:3]], 8,
                       TreeConfig.chain(3))
    with pytest.raises(ValueError, match="needs the draft head on a CUDA device"):
        drafter.start(model, start)


@pytest.mark.parametrize("tree", ["chain-3", "cpu", "eagle2"])
def test_graphed_row_through_the_engine_equals_hf_generate(eagle_ckpts, tree):
    """``cuda_graphs=True`` with the drafter's row uncaptured (a CPU cannot capture): static,
    dynamic and chain trees, the head alone and with prompt lookup grafted on, give HF
    generate's greedy output; the passes ran and each request found the row (and its passes)
    the previous one left, emptied, until a longer request needed a longer row."""
    from treespec.drafters import HybridDrafter
    from treespec.drafters.graphs import GraphedRow

    model = eagle_target("eagle3")
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model, cuda_graphs=True)
    drafter.graphed_row = GraphedRow(capture=False)
    rows = []
    for draft in (drafter, HybridDrafter(drafter)):
        for p in ([1, 5, 9, 3, 7, 5, 9, 3, 7], list(range(20, 45))):
            out = treespec.generate(model, draft, tree, [p], max_new_tokens=20)
            assert out.sequences == [hf_greedy(model, p, 20)]
            rows.append(drafter.graphed_row.passes)
    # levels and commits ran on static passes (dynamic trees: the whole draft and its commit passes)
    assert rows[0].passes if tree == "chain-3" else rows[0].drafts and rows[0].commits
    assert len({id(r) for r in rows}) <= 2  # the same row for all, or a second once a longer one was needed
    long = treespec.generate(model, drafter, tree, [list(range(1, 60)) * 2], max_new_tokens=20)
    assert long.sequences == [hf_greedy(model, list(range(1, 60)) * 2, 20)]
    assert drafter.graphed_row.passes is not rows[-1]  # 118 prompt tokens need a longer row


def test_graphed_row_is_lent_to_one_session_at_a_time(eagle_ckpts, caplog):
    """A second live session drafts eagerly, with a warning; the row returns on finish, or when
    its session is dropped unfinished."""
    from treespec.drafters.graphs import GraphedRow

    model = eagle_target("eagle3")
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model, cuda_graphs=True)
    drafter.graphed_row = GraphedRow(capture=False)
    def session():
        return start_session(drafter, model, [[1, 2, 3]], [4], TreeConfig.chain(3))

    first = session()
    assert first.static is drafter.graphed_row.passes
    with caplog.at_level("WARNING", logger="treespec.drafters.eagle"):
        second = session()
    assert second.static is None and "another session holds this drafter's row" in caplog.text
    first.finish(0)
    third = session()
    assert third.static is drafter.graphed_row.passes
    del third  # dropped without finish: the row is free again
    assert session().static is drafter.graphed_row.passes


def test_graphed_row_returns_when_a_stream_is_closed_early_and_comes_back_zeroed(eagle_ckpts):
    """The engine closes its draft session however generation ends: a stream closed after two
    steps gives the row back, and the next request finds it zeroed (each pass reads the whole
    row, so a non-finite entry left behind would turn its softmax to NaN)."""
    from treespec.drafters.graphs import GraphedRow

    model = eagle_target("eagle3")
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model, cuda_graphs=True)
    drafter.graphed_row = GraphedRow(capture=False)
    p = [1, 5, 9, 3, 7, 5, 9, 3, 7]
    steps = treespec.stream(model, drafter, "eagle2", [p], max_new_tokens=30)
    next(steps), next(steps), next(steps)
    row = drafter.graphed_row.passes
    row.keys[-1] = float("nan")  # what a diverged head could leave in a tree slot
    steps.close()
    out = treespec.generate(model, drafter, "eagle2", [p], max_new_tokens=20)
    assert drafter.graphed_row.passes is row  # returned on close, lent again
    assert out.sequences == [hf_greedy(model, p, 20)]
    assert torch.isfinite(row.keys).all()
    assert all(torch.isfinite(q.logp).all() for q in row.passes.values())


def test_compiled_passes_through_the_engine_equal_hf_generate(eagle_ckpts):
    """``compile_passes=True``: the static passes through ``torch.compile`` on a CPU give HF
    generate's greedy output with the head alone and with lookup grafted on, drafting every
    level and commit on them; a handful of graphs serves every pass size (sizes one and two
    specialised, the rest one dynamic graph), and the drafter says what it runs."""
    import torch._dynamo.utils as dynamo_utils

    from treespec.drafters import HybridDrafter

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    model = eagle_target("eagle3")
    # a pass a level (the whole draft in one graph: tests/drafters/test_draft_graph.py)
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model, compile_passes=True, whole_draft=False)
    assert "compiled passes" in repr(drafter)
    graphs = []
    for draft in (drafter, HybridDrafter(drafter)):
        for p in ([1, 5, 9, 3, 7, 5, 9, 3, 7], list(range(20, 45))):
            out = treespec.generate(model, draft, "cpu", [p], max_new_tokens=20)
            assert out.sequences == [hf_greedy(model, p, 20)]
            graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert len(set(graphs)) == 1, graphs  # all compiled before the first call's steps (precompile)
    sizes = drafter.graphed_row.passes.passes
    assert len(sizes) >= 4, sorted(sizes)  # levels and commits of several sizes ran on compiled passes
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= 4
    with pytest.raises(ValueError, match="not both"):
        treespec.load_draft(eagle_ckpts("eagle3")[0], model, compile_passes=True, cuda_graphs=True)


@pytest.mark.parametrize("fixed_shapes, lookup, tree", [(False, True, "cpu"), ("compile", False, "cpu-tiny")])
def test_compiled_passes_draft_the_eager_trees(eagle_ckpts, fixed_shapes, lookup, tree):
    """fp32: the head's compiled passes propose exactly the trees the eager lean pass proposes,
    step by step, lookup grafted on or not, with the verify eager or compiled on fixed shapes
    (whose features feed the head; a small tree: few buckets to compile)."""
    from treespec.drafters import HybridDrafter, RecordingDrafter

    model = eagle_target("eagle3")
    eager = treespec.load_draft(eagle_ckpts("eagle3")[0], model)
    prompt = [1, 5, 9, 3, 7, 5, 9, 3, 7, 2, 4]
    recs = []
    compiled = eager.with_compiled_passes()
    for drafter, shapes in ((eager, False), (compiled, fixed_shapes)):
        rec = RecordingDrafter(HybridDrafter(drafter) if lookup else drafter)
        treespec.generate(model, rec, tree, [prompt], max_new_tokens=24, fixed_shapes=shapes)
        recs.append([[(t.tokens.tolist(), t.parents.tolist()) for t in trees] for trees, _ in rec.trees])
    assert len(recs[0]) > 3 and recs[0] == recs[1]
    assert compiled.graphed_row.passes.passes and eager.graphed_row.passes is None  # the compiled ones ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cpu_passes_multiply_on_the_dense_weights_inductor_freezes(eagle_ckpts, dtype):
    """Compiled on a CPU, a head pass's products are inductor's own on the head's weights frozen
    into the graph (``treespec.compiled.cpu_options``), also where the head runs on oneDNN-packed
    weights (``PackedLinears``: no opaque ``packed_linear`` call in the graph); its states and
    log-probabilities are the eager pass's up to rounding."""
    from torch._inductor.utils import run_and_get_code

    from treespec.drafters.graphs import StaticPasses
    from treespec.packing import PackedLinears, onednn_packs

    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} weights on this CPU")
    torch._dynamo.reset()
    model = copy.deepcopy(eagle_target("eagle3")).to(dtype)  # the shared target stays as it is
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model)
    s = start_session(drafter, model, [[1, 2, 3]], [4], TreeConfig.chain(3))
    tokens, positions = torch.tensor([1, 2, 5]), torch.tensor([3, 4, 4])
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(0)).to(dtype)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    eager = StaticPasses.over_row(drafter.head, s.cache, s.seq[0], False, 8).run(tokens, hidden, positions, mask, 3)
    with PackedLinears(model, drafter.head):
        passes = StaticPasses.over_row(drafter.head, s.cache, s.seq[0], False, 8, compile=True)
        compiled, code = run_and_get_code(passes.run, tokens, hidden, positions, mask, 3)
        with torch.no_grad():
            drafter.head.lm_head.weight.mul_(-1.0)  # frozen: the graph keeps the weights it was built with
        again = passes.run(tokens, hidden, positions, mask, 3)
    src = "\n".join(code)
    assert code and "packed_linear" not in src
    assert torch.equal(again[1], compiled[1])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for got, want in zip(compiled, eager):
        assert (got.float() - want.float()).abs().max() <= tol * max(1.0, want.float().abs().max())


def test_compiled_passes_follow_head_weights_changed_in_place(eagle_ckpts):
    """A compiled CPU pass holds the head's weights frozen into its graph: a change made in
    place (an optimizer's step, say) gives the next session passes compiled again, whose
    log-probabilities are the changed head's, not the old graph's."""
    from treespec.drafters.graphs import StaticPasses

    torch._dynamo.reset()
    model = eagle_target("eagle3")
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model, compile_passes=True)
    first = start_session(drafter, model, [[1, 2, 3]], [4], TreeConfig.chain(3))
    old = first.static
    first.finish(0)
    with torch.no_grad():
        drafter.head.lm_head.weight.mul_(-1.0)  # same tensor, same address: only its version moves
    second = start_session(drafter, model, [[1, 2, 3]], [4], TreeConfig.chain(3))
    assert second.static is not old
    args = (torch.tensor([1, 2]), torch.randn(2, H, generator=torch.Generator().manual_seed(1)),
            torch.tensor([4, 5]), torch.ones(2, 2, dtype=torch.bool).tril(), 4)
    with torch.inference_mode():  # as the engine runs them (the row's buffers are inference tensors)
        got = second.static.run(*args)
        want = StaticPasses.over_row(drafter.head, second.cache, second.seq[0], False, 8).run(*args)
    assert (got[1] - want[1]).abs().max() <= 1e-4
