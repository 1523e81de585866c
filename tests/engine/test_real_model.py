"""A real model end to end: SmolLM2-135M-Instruct greedy output equals HF generate.

Two chat-templated prompts (a GSM8K-style question and a copy task, where prompt lookup
shines), 32 new tokens, batched together in one treespec call. Drafters: prompt lookup,
and the same model as a separate object (``copy.deepcopy``: own weights, own config
object; loading the GGUF a second time would take another ~30 s and give the same
thing), whose drafts the target accepts almost always.
"""

from __future__ import annotations

import copy

import pytest
import torch

import treespec
from treespec import models
from treespec.drafters.model import ModelDrafter
from treespec.drafters.ngram import NgramDrafter

pytestmark = pytest.mark.slow

NEW = 32
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. The quick brown "
    "fox jumps over the lazy dog again.",
]


@pytest.fixture(scope="module")
def smollm():
    try:
        model, tokenizer = models.load("smollm2-135m-instruct")
    except models.ModelFetchError as err:  # a download that cannot happen here; anything else fails
        pytest.skip(f"SmolLM2-135M-Instruct cannot be fetched here: {err}")
    prompts = []
    for q in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer(text).input_ids)
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        refs.append(out[0, len(p):].tolist())
    return model, tokenizer, prompts, refs


def test_reference_is_sane(smollm):
    model, tokenizer, prompts, refs = smollm
    assert all(0 < len(r) <= NEW for r in refs)
    assert "fox" in tokenizer.decode(refs[1])  # the copy task copies


def test_greedy_ngram_equals_hf(smollm):
    model, tokenizer, prompts, refs = smollm
    before = model.config._attn_implementation
    out = treespec.generate(model, NgramDrafter(), "cpu", prompts, max_new_tokens=NEW)
    assert out.sequences == refs, [tokenizer.decode(s) for s in out.sequences]
    assert model.config._attn_implementation == before
    assert out.metrics.num_generated == sum(map(len, refs))
    assert out.metrics.requests[1].mean_accepted_length > 1.5  # copying is what lookup is for


def test_greedy_model_drafter_equals_hf(smollm):
    model, tokenizer, prompts, refs = smollm
    draft = copy.deepcopy(model)
    assert draft.config is not model.config
    out = treespec.generate(model, ModelDrafter(draft), "cpu-tiny", prompts, max_new_tokens=NEW)
    assert out.sequences == refs, [tokenizer.decode(s) for s in out.sequences]
    # The draft is the target itself (numerically): nearly every drafted token is accepted.
    assert out.metrics.mean_accepted_length > 3


def test_shipped_eagle_pair_equals_hf(smollm):
    """The pair that ships: SmolLM2 + its EAGLE-3 head, by name, greedy-equal to HF generate
    and accepting more than one token per step on a GSM8K question."""
    model, tokenizer, prompts, refs = smollm
    try:
        draft = treespec.load_draft("smollm2-135m-instruct-eagle", model)
    except FileNotFoundError as err:
        pytest.fail(f"the shipped head is missing from the package: {err}")
    assert type(draft).__name__ == "Eagle3Drafter"
    for tree in ("chain-2", "cpu-tiny", "cpu"):
        out = treespec.generate(model, draft, tree, prompts, max_new_tokens=NEW)
        assert out.sequences == refs, tree
        assert out.metrics.requests[0].mean_accepted_length > 1.2, tree


def test_shipped_pair_bf16_packed_has_no_unexplained_difference(smollm):
    """bf16 and packed weights, the CPU fast path: every difference from HF generate (bf16,
    plain weights) is a rounding near-tie judged in fp32, and the head still accepts. On a CPU
    where oneDNN cannot pack bf16 (AMD Zen 3), the same on plain bf16 weights."""
    import contextlib

    from treespec.divergence import NEAR_TIE_TOLERANCE, classify_divergence
    from treespec.packing import PackedLinears, packing_supported

    model32, _, prompts, refs32 = smollm
    model = copy.deepcopy(model32).to(torch.bfloat16)
    draft = treespec.load_draft("smollm2-135m-instruct-eagle", model)
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        refs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                   do_sample=False)[0, len(p):].tolist())
    packed = PackedLinears(model, *draft.modules()) if packing_supported(model) else contextlib.nullcontext()
    with packed:
        out = treespec.generate(model, draft, "cpu", prompts, max_new_tokens=NEW)
    for p, ref, seq in zip(prompts, refs, out.sequences):
        d = classify_divergence(model32, p, ref, seq, NEAR_TIE_TOLERANCE[torch.bfloat16])
        assert d is None or d.near_tie, d
    assert out.metrics.requests[0].mean_accepted_length > 1.2
