"""On a CUDA GPU: greedy equality with HF generate through every attention backend that runs
there (torch, flex, and FlashInfer when installed), in fp32 and (judged in fp32, near-ties
allowed) in bf16. Skipped without a GPU; run by ``benchmarks/figures/gpu_check.sh``. The
flex-vs-torch and FlashInfer-vs-torch tree logits tests are in test_backends.py.

The models have head dim 64 (hidden 256, 4 heads): FlashInfer's kernels take 64, 128 or 256,
flex_attention's CUDA kernel 16 or more."""

from __future__ import annotations

import pytest
import torch

import treespec
from tiny import tiny_model
from treespec.attention import flex_problem
from treespec.divergence import NEAR_TIE_TOLERANCE, classify_divergence, fp32_reference
from treespec.drafters import Eagle3Drafter, HybridDrafter, ModelDrafter, NgramDrafter
from treespec.drafters.base import DraftStart
from treespec.drafters.eagle import EagleHead
from treespec.drafters.graphs import GraphedRow

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

PROMPTS = [[1, 5, 9, 3, 7, 5, 9], [2, 4, 6, 8, 10, 12, 4, 6], list(range(20, 45))]


def _backends():
    names = ["torch"]
    if torch.cuda.is_available() and flex_problem("cuda") is None:
        names.append("flex")
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return names
    return names + ["flashinfer"]


def gpu_model(family: str, seed: int, **kw):
    return tiny_model(family, seed, hidden=256, heads=4, kv_heads=2, **kw)


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("tree", ["chain-3", "cpu", "eagle2"])
def test_greedy_equals_hf_generate_on_gpu_fp32(backend, tree):
    model = gpu_model("llama", 1).to("cuda")
    draft = ModelDrafter(gpu_model("llama", 1).to("cuda"), attention_backend=backend)
    out = treespec.generate(model, draft, tree, PROMPTS, max_new_tokens=24, attention_backend=backend)
    assert out.sequences == [hf_greedy(model, p, 24) for p in PROMPTS]


@pytest.mark.parametrize("backend", _backends())
def test_bf16_greedy_on_gpu_has_no_unexplained_difference(backend):
    model = gpu_model("qwen3", 2).to("cuda", torch.bfloat16)
    ref32 = fp32_reference(model)
    out = treespec.generate(model, NgramDrafter(), "cpu", PROMPTS, max_new_tokens=24, attention_backend=backend)
    for p, seq in zip(PROMPTS, out.sequences):
        d = classify_divergence(ref32, p, hf_greedy(model, p, 24), seq, NEAR_TIE_TOLERANCE[torch.bfloat16])
        assert d is None or d.near_tie, d



def test_processors_on_gpu_greedy_and_sampled():
    # Verification processes reached nodes one at a time (RequestDecoding.walk), and top-p may
    # fall back to transformers' code on some rows: the histories must reach the logits' device.
    model = gpu_model("llama", 1).to("cuda")
    draft = ModelDrafter(gpu_model("llama", 1).to("cuda"))
    out = treespec.generate(model, draft, "cpu", PROMPTS, max_new_tokens=16, repetition_penalty=1.3)
    for p, seq in zip(PROMPTS, out.sequences):
        ids = torch.tensor([p], device="cuda")
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                            repetition_penalty=1.3)
        assert seq == hf[0, len(p):].tolist()
    kw = dict(max_new_tokens=16, temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=[3, 4, 5])
    a = treespec.generate(model, draft, "cpu", PROMPTS, **kw).sequences
    assert a == treespec.generate(model, draft, "chain-3", PROMPTS, **kw).sequences  # a seed fixes the output


# ---- the EAGLE head's passes replayed from CUDA graphs (treespec.drafters.graphs) -------------


def gpu_eagle(seed: int, **kw) -> tuple:
    """A GPU target and a freshly initialised EAGLE-3 head for it (random drafts: what the
    graphs must reproduce is the head's arithmetic, not good guesses)."""
    model = gpu_model("llama", seed, layers=8).to("cuda")  # EAGLE-3 reads layers 2, 4 and 5
    torch.manual_seed(seed)
    return model, Eagle3Drafter(EagleHead.for_target(model, eagle3=True).eval(), **kw)


@pytest.mark.parametrize("tree", ["chain-3", "cpu", "eagle2"])
def test_cuda_graph_drafter_greedy_equals_hf_generate(tree):
    """With ``cuda_graphs=True``: HF generate's greedy output, the head alone and with prompt
    lookup; graphs captured by the first request replayed by the next ones (the drafter keeps
    them); and the same acceptance, step for step, as the same passes run uncaptured (an empty
    or stale graph would still give the target's output, but not these steps)."""
    model, graphed = gpu_eagle(3, cuda_graphs=True)
    steps = {}
    for draft in (graphed, HybridDrafter(graphed)):
        for p in PROMPTS:  # graphs serve one request at a time
            out = treespec.generate(model, draft, tree, [p], max_new_tokens=24)
            assert out.sequences == [hf_greedy(model, p, 24)]
            steps[type(draft).__name__, len(p)] = out.metrics.acceptance_counts
    passes = graphed.graphed_row.passes.passes
    assert passes and all(p.graph is not None for p in passes.values())
    assert sum(p.replays for p in passes.values()) > 2 * len(passes)

    uncaptured = Eagle3Drafter(graphed.head, cuda_graphs=True)  # the same weights, the same row length
    uncaptured.graphed_row = GraphedRow(capture=False)
    for draft in (uncaptured, HybridDrafter(uncaptured)):
        for p in PROMPTS:
            out = treespec.generate(model, draft, tree, [p], max_new_tokens=24)
            assert out.metrics.acceptance_counts == steps[type(draft).__name__, len(p)]


def test_cuda_graphs_replay_the_eager_static_passes():
    """The same static passes, captured and replayed or run eagerly, draft the same trees bit
    for bit (the same kernels), one graph per pass shape, every shape captured on first use."""
    model, drafter = gpu_eagle(4)
    prompt = list(range(3, 40))
    with torch.no_grad():  # EAGLE-3 features: the states entering three target layers
        hs = model(torch.tensor([prompt], device="cuda"), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i][0] for i in drafter.features_for(model)], -1)
    cfg = treespec.TreeConfig.preset("eagle2")
    n = 20
    sessions = [drafter.start(model, DraftStart([prompt[:n]], [prompt[n]], [feats[:n]], 24, cfg)) for _ in range(2)]
    for s, capture in zip(sessions, (False, True)):
        s.use_static_passes(capture=capture)
    pos = n
    for commit in (1, 3, 2, 1, 4):
        trees = [s.propose([0], [prompt[pos]], [cfg.depth]) for s in sessions]
        assert torch.equal(trees[0][0].tokens, trees[1][0].tokens)
        assert torch.equal(trees[0][0].parents, trees[1][0].parents)
        assert torch.equal(trees[0][0].scores, trees[1][0].scores)
        for s in sessions:
            s.commit([0], [prompt[pos + 1: pos + 1 + commit]], [feats[pos: pos + commit]])
        pos += commit
        assert torch.equal(sessions[0].root_logp[0], sessions[1].root_logp[0])
    graphs = sessions[1].static.passes
    assert graphs and all(p.graph is not None and p.replays for p in graphs.values())
    assert set(graphs) == set(sessions[0].static.passes)  # one per shape: levels (top_k) and commit sizes


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
