"""On a CUDA GPU: the EAGLE head's passes replayed from CUDA graphs
(:mod:`treespec.drafters.graphs`, ``cuda_graphs=True``) draft the trees the same passes draft
uncaptured, bit for bit, give HF generate's greedy output, serve one request after another,
and are recaptured when the head's weights move; the target's verify forward captured
(``fixed_shapes="graphs"``) gives the eager fixed-shape logits and HF generate's tokens, its
graphs replayed by a later call (the CPU half, on a fake graph:
tests/model/test_verify_graphs.py). Skipped without a GPU; run first of the CUDA
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
    row = graphed.graphed_row.passes
    # chain-3 drafts a pass a level; dynamic trees draft whole and commit through the commit passes
    bodies = list((row.passes if tree == "chain-3" else row.commits).values())
    assert bodies and all(b.graph is not None for b in bodies)
    assert sum(b.replays for b in bodies) > 2 * len(bodies)
    drafts = row.drafts  # dynamic trees: drafted whole, one graph a configuration
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
    now = drafter.graphed_row.passes
    assert any(q.replays for q in (*now.passes.values(), *now.commits.values(), *now.drafts.values()))


# ---- the verify forward captured (fixed_shapes="graphs") ---------------------------------------


@pytest.mark.parametrize("tree", ["chain-3", "eagle2"])
def test_captured_verify_greedy_equals_hf_generate_and_a_second_call_replays(tree):
    """``fixed_shapes="graphs"``: every bucket captured before the first prefill, HF generate's
    greedy tokens on a batch and one request after another, the second call on the first's
    graphs (nothing captured again), the head's passes captured too; fp32, so that the tokens
    are exact."""
    import treespec.fixed_shape as fs

    model, graphed = gpu_eagle(5, cuda_graphs=True)
    kw = dict(max_new_tokens=24, attention_backend="torch")
    want = [hf_greedy(model, p, 24) for p in PROMPTS]
    first = treespec.generate(model, graphed, tree, PROMPTS[:1], fixed_shapes="graphs", **kw)
    rows = fs._CAPTURED[model]
    captured = {k: g.graph for k, g in rows.graphs.items()}
    replays = sum(g.replays for g in rows.graphs.values())
    second = treespec.generate(model, graphed, tree, PROMPTS[:1], fixed_shapes="graphs", **kw)
    assert first.sequences == second.sequences == want[:1]
    assert fs._CAPTURED[model] is rows and {k: g.graph for k, g in rows.graphs.items()} == captured
    # every step of the second call replayed the first call's graphs (none fell back)
    assert sum(g.replays for g in rows.graphs.values()) - replays == second.metrics.num_request_steps
    batch = treespec.generate(model, "ngram", tree if tree != "eagle2" else "cpu", PROMPTS, fixed_shapes="graphs",
                              **kw)
    assert batch.sequences == want


def test_captured_verify_samples_on_the_device_as_the_host_rule_does():
    """Seeded sampling with temperature and top-p (one request greedy) on ``fixed_shapes="graphs"``:
    the rule inside the captured forward (treespec/device_sampling.py; temperature as CUDA divides
    by a scalar: a product with its fp32 reciprocal) gives the host's rule's tokens, fp32."""
    import treespec.fixed_shape as fs

    model, graphed = gpu_eagle(6, cuda_graphs=True)
    kw = dict(max_new_tokens=24, attention_backend="torch", temperature=[0.8, 0, 1.2], top_p=0.9, top_k=40, seed=11)
    want = treespec.generate(model, graphed, "eagle2", PROMPTS, **kw)
    got = treespec.generate(model, graphed, "eagle2", PROMPTS, fixed_shapes="graphs", **kw)
    assert {accept for _, _, accept, _ in fs._CAPTURED[model].graphs} == {"sample:temperature:top_k:top_p"}
    assert got.sequences == want.sequences


def test_captured_verify_logits_equal_the_eager_fixed_shape_ones():
    """One forward of a 20-node tree after a prompt, captured and eager, in fp32: the same
    logits and features within a GPU's fp32 reassociation."""
    from treespec.fixed_shape import FixedShapeVerify, fixed_row_tokens
    from treespec.mask import causal_mask
    from treespec.runner import FINAL_NORM, ModelRunner
    from treespec.tree import Tree

    model = tiny_model("llama", 7, hidden=256, heads=4, kv_heads=2, layers=4).to("cuda")
    runner = ModelRunner(model, "torch", feature_layers=[1, FINAL_NORM])
    prompt = PROMPTS[2]
    parents = [-1] + [(i - 1) // 2 for i in range(1, 20)]
    tree = Tree(parents, [(7 * i + 3) % 64 for i in range(20)])
    out = {}
    for graphs in (False, True):
        cache, seqs = runner.new_rows_cache(1, fixed_row_tokens(len(prompt), 20, "graphs"), 16)
        with runner.attached():
            verify = FixedShapeVerify(runner, cache, seqs, graphs=graphs)
            verify.precompile(32, capture=True)  # before the prefill, as the loop: its padding writes the row's start
            runner.forward(cache, seqs, [torch.tensor(prompt)], [torch.arange(len(prompt))],
                           [causal_mask(len(prompt))], logits_rows=[[len(prompt) - 1]])
            cache.commit(seqs[0], torch.arange(len(prompt)))
            res = verify.forward(seqs, [tree], [len(prompt)], capture=True)
            out[graphs] = (res.logits[0].clone(), res.features[0].clone())
    for a, b in zip(out[False], out[True]):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-3, (a - b).abs().max()
