"""On a CUDA GPU: greedy equality with HF generate through both attention backends, in fp32
and (judged in fp32, near-ties allowed) in bf16. Skipped without a GPU; run by
``benchmarks/figures/gpu_check.sh``. The FlashInfer-vs-torch tree logits test is in test_backends.py."""

from __future__ import annotations

import pytest
import torch

import treespec
from tiny import tiny_model
from treespec.divergence import NEAR_TIE_TOLERANCE, classify_divergence, fp32_reference
from treespec.drafters import ModelDrafter, NgramDrafter

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

PROMPTS = [[1, 5, 9, 3, 7, 5, 9], [2, 4, 6, 8, 10, 12, 4, 6], list(range(20, 45))]


def _backends():
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return ["torch"]
    return ["torch", "flashinfer"]


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("tree", ["chain-3", "cpu", "eagle2"])
def test_greedy_equals_hf_generate_on_gpu_fp32(backend, tree):
    model = tiny_model("llama", 1).to("cuda")
    draft = ModelDrafter(tiny_model("llama", 1).to("cuda"), attention_backend=backend)
    out = treespec.generate(model, draft, tree, PROMPTS, max_new_tokens=24, attention_backend=backend)
    assert out.sequences == [hf_greedy(model, p, 24) for p in PROMPTS]


@pytest.mark.parametrize("backend", _backends())
def test_bf16_greedy_on_gpu_has_no_unexplained_difference(backend):
    model = tiny_model("qwen3", 2).to("cuda", torch.bfloat16)
    ref32 = fp32_reference(model)
    out = treespec.generate(model, NgramDrafter(), "cpu", PROMPTS, max_new_tokens=24, attention_backend=backend)
    for p, seq in zip(PROMPTS, out.sequences):
        d = classify_divergence(ref32, p, hf_greedy(model, p, 24), seq, NEAR_TIE_TOLERANCE[torch.bfloat16])
        assert d is None or d.near_tie, d
