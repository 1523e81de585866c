"""The whole draft in one graph (treespec/drafters/draft_graph.py, issue 47's item 2): eagerly it
drafts the level-by-level static passes' trees bit for bit, compiled the eager trees, through the
engine HF generate's tokens; it falls back where it cannot run (rules, a tree past the row,
static shapes, batches). The CUDA half is tests/gpu/test_cuda_graphs.py.

Sizes: target vocabulary V = 64, hidden H = 32; EAGLE-3 draft vocabulary Vd = 40.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from helpers.eagle_heads import drawn_request, eagle_target, start_session
from helpers.references import hf_greedy
from helpers.tiny import assert_sessions_draft_alike
from treespec import TreeConfig
from treespec.drafters.base import DraftStart
from treespec.drafters.draft_graph import DraftGraph, commit_pass_for, draft_graph_for
from treespec.drafters.graphs import GraphedRow

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


def count_launches(monkeypatch) -> list[int]:
    """How many whole drafts ran, from now on."""
    launches = [0]
    real = DraftGraph.launch

    def launch(self):
        launches[0] += 1
        return real(self)

    monkeypatch.setattr(DraftGraph, "launch", launch)
    return launches


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), data=st.data())
def test_whole_draft_is_the_level_by_level_draft(eagle_ckpts, kind, dtype, seed, data, monkeypatch):
    """Two sessions of one request on the same static passes (run eagerly): one drafts every
    level in one call of :func:`draft_tree` (masks, slots and positions made on the device from
    L), the other a pass a level with masks built on the host. Their trees are equal bit for bit
    (tokens, parents, fp32 scores) through proposals, multi-token commits and a random tree
    configuration, in fp32 and bf16: a wrong mask, slot, position or parent fails it."""
    launches = count_launches(monkeypatch)
    model, drafter, cfg, full, n, feats = drawn_request(eagle_ckpts, kind, dtype, seed, data)
    sessions = [drafter.start(model, DraftStart([full[:n]], [full[n]], [feats[:n]], 24, cfg)) for _ in range(2)]
    for s, whole in zip(sessions, (True, False)):
        s.use_static_passes(capture=False)
        s.whole_draft = whole
    commits = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    assert_sessions_draft_alike(sessions, full, feats, n, commits, cfg.depth)
    assert launches[0] == len(commits)  # the first session drafted whole, every step


def test_a_tree_past_the_row_rules_and_static_shapes_draft_level_by_level(eagle_ckpts, monkeypatch):
    """Where the whole draft cannot run, the session drafts as before: a tree whose frontiers
    would pass the row's end, a request with generation rules, a static tree shape; a commit past
    the row's end goes through the session's other passes; ids of another dtype are refused."""
    launches = count_launches(monkeypatch)
    model = eagle_target("eagle3")
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model, whole_draft=True)
    cfg = TreeConfig.dynamic(depth=4, top_k=3, num_nodes=8)
    s = start_session(drafter, model, [[1, 2, 3]], [4], cfg)
    s.use_static_passes(capture=False)
    assert s.propose([0], [4], [cfg.depth])[0].num_nodes == 9 and launches[0] == 1
    graph = draft_graph_for(s.static, cfg)
    assert graph.fits(3) and not graph.fits(s.static.capacity - graph.reach + 1) and not graph.fits(0)
    s.cache.seq_lens[s.seq[0]] = s.static.capacity - graph.reach + 1  # as if the row were nearly full
    assert s._propose_whole([0], [4]) is None
    s.cache.seq_lens[s.seq[0]] = s.static.capacity - 1  # a commit of two would pass the row's end
    assert s._commit_whole([0], [[5, 6]], [torch.zeros(2, 3 * 32)]) is False
    with pytest.raises(TypeError, match="int64"):
        commit_pass_for(s.static, 2).run(torch.tensor([5, 6], dtype=torch.int32), torch.zeros(2, 3 * 32), 3)
    s.cache.seq_lens[s.seq[0]] = 3
    s.ctx.rules = [object()]  # any rule: masked per path on the host
    assert s._propose_whole([0], [4]) is None
    chain = start_session(drafter, model, [[1, 2, 3]], [4], TreeConfig.chain(3))
    chain.use_static_passes(capture=False)
    assert not chain.whole_draft and chain.propose([0], [4], [3])[0].num_nodes == 4
    assert launches[0] == 1
    with pytest.raises(ValueError, match="dynamic trees"):
        draft_graph_for(s.static, TreeConfig.chain(3))
    with pytest.raises(ValueError, match="does not fit"):
        graph.fill(torch.zeros(40), torch.zeros(1, 32), s.static.capacity)


@pytest.mark.parametrize("tree", ["cpu", "eagle2"])
def test_graphed_row_drafts_whole_through_the_engine_equal_hf_generate(eagle_ckpts, tree, monkeypatch):
    """``cuda_graphs=True`` drafts whole by default (here uncaptured: capturing needs CUDA); the
    engine's greedy tokens are HF generate's, with the head alone and with lookup grafted on, and
    every step drafted in one launch."""
    from treespec.drafters import HybridDrafter

    launches = count_launches(monkeypatch)
    model = eagle_target("eagle3")
    drafter = treespec.load_draft(eagle_ckpts("eagle3")[0], model, cuda_graphs=True)
    assert drafter.whole_draft  # the default
    drafter.graphed_row = GraphedRow(capture=False)
    for draft in (drafter, HybridDrafter(drafter)):
        p = [1, 5, 9, 3, 7, 5, 9, 3, 7]
        before = launches[0]
        out = treespec.generate(model, draft, tree, [p], max_new_tokens=20)
        assert out.sequences == [hf_greedy(model, p, 20)]
        assert launches[0] - before == out.metrics.num_steps > 0
    off = treespec.load_draft(eagle_ckpts("eagle3")[0], model, cuda_graphs=True, whole_draft=False)
    assert not off.whole_draft


def test_compiled_whole_draft_compiles_once_and_drafts_the_eager_trees(eagle_ckpts, monkeypatch):
    """``compile_passes=True, whole_draft=True``: the whole draft compiles before the first step
    (one graph for every committed length: the keys it reads a symbolic size), and in fp32
    proposes exactly the eager level-by-level trees through the engine; its greedy tokens are
    HF generate's."""
    import torch._dynamo.utils as dynamo_utils

    from treespec.drafters import RecordingDrafter

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    launches = count_launches(monkeypatch)
    model = eagle_target("eagle3")
    eager = treespec.load_draft(eagle_ckpts("eagle3")[0], model)
    compiled = treespec.load_draft(eagle_ckpts("eagle3")[0], model, compile_passes=True, whole_draft=True)
    p = [1, 5, 9, 3, 7, 5, 9, 3, 7]
    trees = []
    for draft in (eager, compiled):
        rec = RecordingDrafter(draft)
        out = treespec.generate(model, rec, "cpu", [p], max_new_tokens=24)
        assert out.sequences == [hf_greedy(model, p, 24)]
        trees.append(rec.trees)
        if draft is compiled:
            graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert launches[0] >= len(trees[1]) > 0
    for (a,), (b,) in ((ta, tb) for (ta, _), (tb, _) in zip(*trees, strict=True)):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    out = treespec.generate(model, compiled, "cpu", [list(range(20, 45))], max_new_tokens=20)
    assert out.sequences == [hf_greedy(model, list(range(20, 45)), 20)]
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled after the first start


RULES = {"repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "suppress_tokens"}  # DraftRules
OPTIONS = [dict(), dict(temperature=0.9, top_p=0.95, seed=7), dict(repetition_penalty=1.3),
           dict(no_repeat_ngram_size=2), dict(min_new_tokens=20, eos_token_id=3), dict(suppress_tokens=[5, 9])]


@pytest.mark.parametrize("kind", ["eagle1", "hybrid"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "greedy")
def test_whole_draft_gives_todays_tokens(kind, options, monkeypatch):
    """Through the engine on fixed shapes, greedy, seeded sampling and generation options (the
    ones that forbid tokens make the builder's rules: those steps draft level by level), a batch
    of three (drafted level by level) and a prefix cache hit: the tokens of today's eager path.
    The EAGLE-1 pair drafts well (multi-token commits); the hybrid grafts lookup on."""
    from helpers.pairs import graphed, pair

    from treespec import PrefixCache

    launches = count_launches(monkeypatch)
    prompts = [[5, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 7, 7], [1]]
    model, drafter = pair(kind, peak=3.0)
    whole = graphed(drafter)
    kw = dict(max_new_tokens=24, attention_backend="torch", **options)
    for batch in ([prompts[0]], prompts):
        want = treespec.generate(model, drafter, "cpu", batch, **kw)
        assert treespec.generate(model, whole, "cpu", batch, fixed_shapes=True, **kw).sequences == want.sequences
    assert (launches[0] > 0) == (not RULES & set(options))  # with rules every step drafts level by level
    cache = PrefixCache(1 << 20)
    first = treespec.generate(model, whole, "cpu", [prompts[0]], prefix_cache=cache, fixed_shapes=True, **kw)
    again = [prompts[0] + first.sequences[0] + [3, 4]]
    got = treespec.generate(model, whole, "cpu", again, prefix_cache=cache, fixed_shapes=True, **kw)
    assert got.metrics.requests[0].hit_tokens > 0
    assert got.sequences == treespec.generate(model, drafter, "cpu", again, **kw).sequences
