"""On a CUDA GPU: greedy equality with HF generate through every attention backend that runs
there (torch, flex, and FlashInfer when installed), in fp32 and (judged in fp32, near-ties
allowed) in bf16. Skipped without a GPU; run by ``benchmarks/figures/gpu_check.sh``. The
flex-vs-torch and FlashInfer-vs-torch tree logits tests are in test_backends.py, the EAGLE
head's CUDA graphs in test_cuda_graphs.py.

The models have head dim 64 (hidden 256, 4 heads): FlashInfer's kernels take 64, 128 or 256,
flex_attention's CUDA kernel 16 or more."""

from __future__ import annotations

import pytest
import torch

import treespec
from helpers.references import hf_greedy
from helpers.tiny import tiny_model
from treespec.attention import flex_problem
from treespec.divergence import NEAR_TIE_TOLERANCE, classify_divergence, fp32_reference
from treespec.drafters import ModelDrafter, NgramDrafter

pytestmark = [
    pytest.mark.cuda,
    # flex's fused kernel compiled afresh per test, and its unfused fallback an error (conftest.py)
    pytest.mark.usefixtures("fresh_flex"),
    pytest.mark.filterwarnings("error:flex_attention called without torch.compile"),
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


@pytest.mark.parametrize("backend", [b for b in _backends() if b != "flashinfer"])  # its kernels: fp16/bf16
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
