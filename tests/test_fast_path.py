"""The CPU fast path and its honest baselines.

- oneDNN-packed linear weights compute what ``nn.Linear`` computes (bf16: the same kernel,
  identical values; fp32: a different summation order) and swap out cleanly, also after
  an exception; treespec on packed weights stays greedy-equal to plain HF generate.
- treespec without a draft (root-only trees) is plain autoregressive decoding.
- bf16 greedy: every difference from HF generate is judged in fp32 at its first token; with
  the correct tree mask none is unexplained, with a wrong mask some are (so the judgement
  has teeth).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import treespec
from tiny import tiny_model
from treespec import Tree, TreeConfig
from treespec.bench import BenchConfig, run_bench, to_json
from treespec.divergence import NEAR_TIE_TOLERANCE, classify_divergence, first_difference, fp32_reference
from treespec.drafters import ModelDrafter, NgramDrafter, NoDrafter
from treespec.packing import PackedLinear, PackedLinears, onednn_packs, packing_supported

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
# bf16 packing is a CPU feature (AVX512 BW/VL/DQ or AVX-NE-CONVERT): AMD Zen 3 lacks it
PACKED_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU (no AVX512 BW/VL/DQ, no AVX-NE-CONVERT)"))]


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


PROMPTS = [[1, 5, 9, 3, 7, 5, 9], [2, 4, 6, 8, 10, 12, 4, 6], [3, 3, 3, 11, 17, 19, 23, 3, 11]]


# ---- packed weights ----------------------------------------------------------------------


@needs_onednn
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_packed_linear_matches_linear(dtype, rows):
    torch.manual_seed(rows)
    lin = nn.Linear(48, 80, bias=True).to(dtype)
    x = torch.randn(2, rows, 48).to(dtype)
    with torch.inference_mode():
        want = lin(x).float()
        got = PackedLinear(lin)(x).float()
    assert got.shape == want.shape
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-2)


@needs_onednn
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packed_model_logits_and_clean_swap(dtype):
    model = tiny_model("llama", seed=3).to(dtype)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    keys = set(model.state_dict())
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = model(ids).logits.float()
        packed = PackedLinears(model)
        assert len(packed) == len(linears) > 0
        with packed:
            assert all(type(m) is not nn.Linear for m in model.modules())
            assert set(model.state_dict()) == keys  # parameters are shared, not renamed
            with packed:  # re-entrant
                got = model(ids).logits.float()
            assert any(isinstance(m, PackedLinear) for m in model.modules())
    torch.testing.assert_close(got, want, atol=1e-4 if dtype == torch.float32 else 0.1, rtol=1e-2)
    assert {n: m for n, m in model.named_modules() if type(m) is nn.Linear} == linears  # the same objects back


@needs_onednn
def test_packed_weights_restored_after_an_exception():
    model = tiny_model("llama", seed=4)
    packed = PackedLinears(model)
    with pytest.raises(RuntimeError, match="boom"):
        with packed:
            raise RuntimeError("boom")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_packing_refuses_unsupported_dtypes():
    model = tiny_model("llama", seed=4).to(torch.float16)
    assert not packing_supported(model)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PackedLinears(model)


@needs_onednn
def test_packing_bf16_where_onednn_cannot_says_what_to_do(monkeypatch):
    import treespec.packing as packing

    monkeypatch.setattr(packing, "onednn_packs", lambda dtype: dtype == torch.float32)  # a Zen 3, say
    model = tiny_model("llama", seed=4).to(torch.bfloat16)
    assert not packing_supported(model)
    with pytest.raises(ValueError, match="cannot pack bfloat16 weights on this CPU.*float32"):
        PackedLinears(model)


@needs_onednn
def test_onednn_packs_what_onednn_says_it_supports(monkeypatch):
    assert not onednn_packs(torch.float16)
    assert onednn_packs(torch.float32)
    # the probe agrees with oneDNN's own capability check, so a probe that wrongly said no on a
    # bf16-capable CPU (and skipped the bf16 packing tests) would fail here
    assert onednn_packs(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()

    def refuse(*a, **kw):
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    assert not onednn_packs.__wrapped__(torch.float32)  # uncached: a refusal is a no, not a crash


@needs_onednn
@pytest.mark.parametrize("tree", ["chain-3", "cpu-tiny", "cpu"])
def test_greedy_on_packed_weights_equals_plain_hf_generate(tree):
    model = tiny_model("qwen2", seed=5)
    draft = ModelDrafter(tiny_model("qwen2", seed=5))  # the target's twin: deep acceptance
    with PackedLinears(model):
        out = treespec.generate(model, draft, tree, PROMPTS, max_new_tokens=20)
    for p, seq in zip(PROMPTS, out.sequences):
        assert seq == hf_greedy(model, p, 20)
    assert out.metrics.mean_accepted_length > 1.5


@needs_onednn
def test_packed_eagle3_head_drafts_the_same_trees():
    from treespec.drafters import Eagle3Drafter, EagleHead

    model = tiny_model("llama", seed=10, layers=4)
    head = EagleHead.for_target(model, eagle3=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    drafter = Eagle3Drafter(head)
    plain = treespec.generate(model, drafter, "cpu", PROMPTS, max_new_tokens=16)
    packed = PackedLinears(model, *drafter.modules())
    assert len(packed) > len(PackedLinears(model))  # the head's layers too
    with packed:
        out = treespec.generate(model, drafter, "cpu", PROMPTS, max_new_tokens=16)
    assert out.sequences == plain.sequences == [hf_greedy(model, p, 16) for p in PROMPTS]
    assert [r.accepted for r in out.metrics.requests] == [r.accepted for r in plain.metrics.requests]


# ---- no draft ----------------------------------------------------------------------------


def test_no_drafter_is_autoregressive_decoding():
    model = tiny_model("llama", seed=6)
    out = treespec.generate(model, NoDrafter(), TreeConfig.chain(1), PROMPTS, max_new_tokens=12)
    assert out.sequences == [hf_greedy(model, p, 12) for p in PROMPTS]
    assert out.metrics.mean_accepted_length == 1.0
    assert out.metrics.tree_tokens == out.metrics.num_request_steps  # the root alone each step
    assert treespec.generate(model, "none", "chain-2", PROMPTS[0], max_new_tokens=5).sequences[0] == \
        hf_greedy(model, PROMPTS[0], 5)


def test_prompts_as_numpy_arrays():
    import numpy as np

    model = tiny_model("llama", seed=6)
    arrays = [np.array(p, dtype=np.int64) for p in PROMPTS[:2]]
    out = treespec.generate(model, "none", "chain-1", arrays, max_new_tokens=4)
    assert out.sequences == [hf_greedy(model, p, 4) for p in PROMPTS[:2]]
    assert treespec.generate(model, "none", "chain-1", arrays[0], max_new_tokens=4).sequences[0] == \
        hf_greedy(model, PROMPTS[0], 4)


# ---- greedy differences judged in fp32 ---------------------------------------------------


@pytest.mark.parametrize("ref, other, want", [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 9, 3], 1),  # mismatch at position 1
    ([1, 2, 3], [1, 2], 2),  # one stopped early
    ([], [4], 0),
])
def test_first_difference(ref, other, want):
    assert first_difference(ref, other) == want


def test_classify_divergence_reads_the_fp32_logits():
    model = tiny_model("llama", seed=7)
    prompt = PROMPTS[1]
    ref = hf_greedy(model, prompt, 6)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:3]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    gap = float(logits.max() - logits[runner_up])
    d = classify_divergence(model, prompt, ref, ref[:3] + [runner_up, 0, 0], tolerance=gap + 1e-3)
    assert (d.position, d.reference_token, d.token) == (3, ref[3], runner_up)
    assert d.fp32_shortfall == pytest.approx(gap, abs=1e-4) and d.near_tie
    assert not classify_divergence(model, prompt, ref, ref[:3] + [runner_up], tolerance=gap / 2).near_tie
    assert classify_divergence(model, prompt, ref, list(ref), tolerance=0.0) is None
    early = classify_divergence(model, prompt, ref, ref[:2], tolerance=1e9)
    assert early.position == 2 and not early.near_tie  # stopping early is never a near-tie


def _bf16_unexplained(model, trees, drafter_for, n=24):
    """Greedy treespec vs HF generate in bf16: (differences, unexplained ones)."""
    ref32 = fp32_reference(model)
    diffs = unexplained = 0
    for tree in trees:
        out = treespec.generate(model, drafter_for(), tree, PROMPTS, max_new_tokens=n)
        for p, seq in zip(PROMPTS, out.sequences):
            d = classify_divergence(ref32, p, hf_greedy(model, p, n), seq, NEAR_TIE_TOLERANCE[torch.bfloat16])
            diffs += d is not None
            unexplained += d is not None and not d.near_tie
    return diffs, unexplained


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_greedy_has_no_unexplained_difference(family):
    model = tiny_model(family, seed=8).to(torch.bfloat16)
    twin = tiny_model(family, seed=8).to(torch.bfloat16)
    _, unexplained = _bf16_unexplained(model, ["chain-4", "cpu"], lambda: ModelDrafter(twin))
    assert unexplained == 0
    _, unexplained = _bf16_unexplained(model, ["cpu-tiny"], NgramDrafter)
    assert unexplained == 0


def test_bf16_judgement_catches_a_wrong_tree_mask(monkeypatch):
    model = tiny_model("llama", seed=8).to(torch.bfloat16)
    twin = tiny_model("llama", seed=8).to(torch.bfloat16)
    # Every node sees the whole tree (siblings and descendants too): wrong logits.
    monkeypatch.setattr(Tree, "attention_mask", lambda self: torch.ones(self.num_nodes, self.num_nodes, dtype=torch.bool))
    diffs, unexplained = _bf16_unexplained(model, ["cpu"], lambda: ModelDrafter(twin))
    assert unexplained > 0 and diffs >= unexplained


# ---- the bench's baselines ---------------------------------------------------------------


@needs_onednn
def test_bench_runs_the_same_advantage_baselines(monkeypatch):
    model = tiny_model("llama", seed=9)
    packed = PackedLinears(model)
    configs = [BenchConfig.hf_generate(fast=True), BenchConfig.treespec_ar(),
               BenchConfig.treespec(NgramDrafter(), TreeConfig.chain(3), "ngram", "chain-3")]
    # Which configurations ran on the packed weights: count packed forwards per run.
    import treespec.bench as bench

    calls, runs = [0], []
    real_forward, real_run = PackedLinear.forward, bench._run_one_inner

    def counting_forward(self, x):
        calls[0] += 1
        return real_forward(self, x)

    def counting_run(model, cfg, *a, **kw):
        before = calls[0]
        rec = real_run(model, cfg, *a, **kw)
        runs.append((cfg.name, calls[0] > before))
        return rec

    monkeypatch.setattr(PackedLinear, "forward", counting_forward)
    monkeypatch.setattr(bench, "_run_one_inner", counting_run)
    res = run_bench(model, PROMPTS, configs, max_new_tokens=10, warmup=False, fast_path=packed)
    on_packed = {name: used for name, used in runs}
    assert on_packed == {"hf-generate": False, "hf-generate+fast": True, "treespec-ar": True, "ngram/chain-3": True}
    data = to_json(res)
    names = [c["name"] for c in data["configs"]]
    assert names == ["hf-generate", "hf-generate+fast", "treespec-ar", "ngram/chain-3"]
    assert data["best_baseline"] in ("hf-generate", "hf-generate+fast", "treespec-ar")
    assert data["settings"]["fast_path"] == "oneDNN-packed linear weights"
    assert data["unexplained_mismatches"] == 0
    for c in data["configs"]:
        assert c["speedup_vs_best_baseline"] > 0
    best = next(c for c in data["configs"] if c["name"] == data["best_baseline"])
    assert best["speedup_vs_best_baseline"] == pytest.approx(1.0)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
