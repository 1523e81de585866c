"""On a CUDA GPU: the EAGLE head's passes replayed from CUDA graphs
(:mod:`treespec.drafters.graphs`, ``cuda_graphs=True``) draft the trees the same passes draft
uncaptured, bit for bit, give HF generate's greedy output, serve one request after another,
and are recaptured when the head's weights move. Skipped without a GPU; run first of the CUDA
tests by ``benchmarks/figures/gpu_check.sh`` (the code here has had the least GPU time). The
CPU half (the static passes uncaptured against the lean pass) is in
tests/drafters/test_eagle_passes.py."""

from __future__ import annotations

import pytest
import torch

import treespec
from helpers.references import hf_greedy
from helpers.tiny import assert_sessions_draft_alike, tiny_model
from treespec.drafters import Eagle3Drafter, HybridDrafter, RecordingDrafter
from treespec.drafters.base import DraftStart
from treespec.drafters.eagle_head import EagleHead
from treespec.drafters.graphs import GraphedRow

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

PROMPTS = [[1, 5, 9, 3, 7, 5, 9], [2, 4, 6, 8, 10, 12, 4, 6], list(range(20, 45))]


def gpu_eagle(seed: int, **kw) -> tuple:
    """A GPU target (head dim 64) and a freshly initialised EAGLE-3 head for it (random drafts:
    what the graphs must reproduce is the head's arithmetic, not good guesses)."""
    model = tiny_model("llama", seed, hidden=256, heads=4, kv_heads=2, layers=8).to("cuda")  # EAGLE-3 reads 2, 4, 5
    torch.manual_seed(seed)
    return model, Eagle3Drafter(EagleHead.for_target(model, eagle3=True).eval(), **kw)


def gpu_features(model, drafter, prompt: list[int]) -> torch.Tensor:
    """EAGLE-3 features of ``prompt``: the states entering the three target layers it reads."""
    with torch.no_grad():
        hs = model(torch.tensor([prompt], device="cuda"), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in drafter.features_for(model)], -1)


def drafted(rec: RecordingDrafter) -> list:
    """The recorded trees as plain lists: (tokens, parents) per proposal."""
    return [(t.tokens.tolist(), t.parents.tolist()) for trees, _ in rec.trees for t in trees]


@pytest.mark.parametrize("tree", ["chain-3", "cpu", "eagle2"])
def test_cuda_graph_drafter_greedy_equals_hf_generate(tree):
    """With ``cuda_graphs=True``: HF generate's greedy output, the head alone and with prompt
    lookup; graphs captured by the first request replayed by the next ones (the drafter keeps
    them); and the same trees, proposal for proposal, as the same passes run uncaptured (an
    empty or stale graph would still give the target's output, but not these trees)."""
    model, graphed = gpu_eagle(3, cuda_graphs=True)
    trees = {}
    for name, draft in (("head", graphed), ("hybrid", HybridDrafter(graphed))):
        for p in PROMPTS:  # graphs serve one request at a time
            rec = RecordingDrafter(draft)
            out = treespec.generate(model, rec, tree, [p], max_new_tokens=24)
            assert out.sequences == [hf_greedy(model, p, 24)]
            trees[name, len(p)] = drafted(rec)
            assert trees[name, len(p)]
    passes = graphed.graphed_row.passes.passes
    assert passes and all(p.graph is not None for p in passes.values())
    assert sum(p.replays for p in passes.values()) > 2 * len(passes)
    drafts = graphed.graphed_row.passes.drafts  # dynamic trees: drafted whole, one graph a configuration
    assert (len(drafts) == 1 and all(d.graph is not None and d.replays > 2 for d in drafts.values())
            if tree != "chain-3" else not drafts)

    uncaptured = Eagle3Drafter(graphed.head, cuda_graphs=True)  # the same weights, the same row length
    uncaptured.graphed_row = GraphedRow(capture=False)
    for name, draft in (("head", uncaptured), ("hybrid", HybridDrafter(uncaptured))):
        for p in PROMPTS:
            rec = RecordingDrafter(draft)
            treespec.generate(model, rec, tree, [p], max_new_tokens=24)
            assert drafted(rec) == trees[name, len(p)], (name, len(p))


def drafted_side_by_side(seed: int, whole: tuple[bool, bool]) -> list:
    """Two sessions of one request on a head's static passes, the first run eagerly, the second
    captured, each drafting a pass a level or whole (``whole``), driven in lockstep through
    proposals and commits of several sizes: their trees must be equal bit for bit."""
    model, drafter = gpu_eagle(seed)
    prompt = list(range(3, 40))
    feats = gpu_features(model, drafter, prompt)
    cfg = treespec.TreeConfig.preset("eagle2")
    n = 20
    sessions = [drafter.start(model, DraftStart([prompt[:n]], [prompt[n]], [feats[:n]], 24, cfg)) for _ in range(2)]
    for s, capture, w in zip(sessions, (False, True), whole):
        s.use_static_passes(capture=capture)
        s.whole_draft = w
    assert_sessions_draft_alike(sessions, prompt, feats, n, (1, 3, 2, 1, 4), cfg.depth)
    return sessions


def test_cuda_graphs_replay_the_eager_static_passes():
    """The same static passes, captured and replayed or run eagerly, a pass a level, draft the
    same trees bit for bit (the same kernels), one graph per pass shape, every shape captured on
    first use."""
    sessions = drafted_side_by_side(4, (False, False))
    graphs = sessions[1].static.passes
    assert graphs and all(p.graph is not None and p.replays for p in graphs.values())
    assert set(graphs) == set(sessions[0].static.passes)  # one per shape: levels (top_k) and commit sizes


def test_a_captured_whole_draft_drafts_the_eager_level_by_level_trees():
    """The whole draft and the commit passes captured in CUDA graphs (treespec/drafters/draft_graph.py)
    draft the trees of the same head's static passes run eagerly a level at a time, bit for bit,
    through proposals and commits of several sizes; the draft's graph captured once and replayed
    every step."""
    sessions = drafted_side_by_side(6, (False, True))
    (graph,) = sessions[1].static.drafts.values()
    assert graph.graph is not None and graph.replays == 5
    commits = sessions[1].static.commits  # commits of 1, 2, 3 and 4 entries, each captured
    assert sorted(commits) == [1, 2, 3, 4] and all(c.graph is not None for c in commits.values())
    assert not sessions[0].static.drafts and not sessions[0].static.commits


def test_cuda_graphs_are_recaptured_when_the_head_moves():
    """A graph replays the addresses it captured: a head whose weights were replaced (here cast
    to bf16 and back) gets a new row and new graphs, and still the target's output."""
    model, drafter = gpu_eagle(5, cuda_graphs=True)
    p = PROMPTS[2]
    treespec.generate(model, drafter, "eagle2", [p], max_new_tokens=12)
    first = drafter.graphed_row.passes
    treespec.generate(model, drafter, "eagle2", [p], max_new_tokens=12)
    assert drafter.graphed_row.passes is first  # the same weights: the graphs serve the next request
    kept = [t.data for t in drafter.head.parameters()]  # held, so the new weights land elsewhere
    drafter.head.to(torch.bfloat16).to(torch.float32)
    out = treespec.generate(model, drafter, "eagle2", [p], max_new_tokens=12)
    assert drafter.graphed_row.passes is not first and kept
    assert out.sequences == [hf_greedy(model, p, 12)]
    assert any(q.replays for q in drafter.graphed_row.passes.passes.values())
