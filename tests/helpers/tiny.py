"""Tiny random transformers models for tests (built in milliseconds, no download)."""

from __future__ import annotations

import functools

import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
    Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_model(family: str = "llama", seed: int = 0, vocab: int = 64, hidden: int = 32,
               layers: int = 2, heads: int = 4, kv_heads: int = 2, peak: float = 60.0, **extra):
    """A random model whose next-token distributions are peaked (scaled output head), so
    greedy argmax ties are practically impossible and drafts are sometimes right."""
    cfg_cls, model_cls = FAMILIES[family]
    kw = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=None, pad_token_id=None,
    )
    if family in ("qwen3",):
        kw["head_dim"] = hidden // heads
    if family == "mistral":
        kw["sliding_window"] = None
    kw.update(extra)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw))
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def model_cache():
    """A cache of :func:`tiny_model` of its own: the same arguments give the same model, built
    once. Two caches give two models of equal weights, each with its own config object (a draft
    model that is the target's exact copy, so that acceptance is about 100%)."""
    return functools.lru_cache(maxsize=None)(tiny_model)


@functools.lru_cache(maxsize=None)
def soft_model(seed: int = 0, vocab: int = 64, peak: float = 3.0, copy: int = 0):
    """A llama whose next-token distributions are flat enough that samples differ between seeds,
    built once per arguments; ``copy=1`` gives the same weights under a separate config object
    (a draft model that is the target's exact copy)."""
    return tiny_model("llama", seed, vocab=vocab, peak=peak)


def dynamic_configs(max_top_k: int, max_nodes: int):
    """Hypothesis strategy: small valid ``TreeConfig.dynamic`` values."""
    from hypothesis import strategies as st

    from treespec import TreeConfig

    @st.composite
    def build(draw):
        depth = draw(st.integers(1, 4))
        k = draw(st.integers(1, max_top_k))
        pool = k + (depth - 1) * k * k
        return TreeConfig.dynamic(depth, k, draw(st.integers(1, min(pool, max_nodes))))

    return build()


# A few sentences to train the tiny tokenizer's merges on: enough for words to be tokens.
_CORPUS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "One day, a big dog ran to the park to play. Tom and Lily and Tom saw the dog.",
    "She saw a big red ball. The sun was hot. Lily went inside. He liked it a lot.",
]


#: a ChatML template (SmolLM2's shape) for a tiny tokenizer that should have one
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def assert_sessions_draft_alike(sessions, tokens, feats, pos: int, commits, depth: int) -> None:
    """Two draft sessions of one request, started at ``pos``, driven in lockstep: each
    proposal's trees equal bit for bit (tokens, parents, scores), then both commit the next
    ``commit`` tokens of ``tokens`` (with their features ``feats``) and their roots' log-probs
    equal."""
    a, b = sessions
    for commit in commits:
        (ta,), (tb,) = (s.propose([0], [tokens[pos]], [depth]) for s in sessions)
        assert torch.equal(ta.tokens, tb.tokens)
        assert torch.equal(ta.parents, tb.parents)
        assert torch.equal(ta.scores, tb.scores)
        for s in sessions:
            s.commit([0], [tokens[pos + 1: pos + 1 + commit]], [feats[pos: pos + commit]])
        pos += commit
        assert torch.equal(a.root_logp[0], b.root_logp[0])


def save_tiny_lm(path, seed: int = 0, layers: int = 5, chat_template: str | None = None, **extra):
    """A tiny random llama with a small byte-level BPE tokenizer (no chat template unless
    given), saved as a model folder that ``treespec.models.load`` and the CLI's ``--model``
    read (5 layers by default, enough for an EAGLE-3 head's three feature layers): end-to-end
    tests that need text in and text out without a download or the shared/ folder. ``extra``:
    more config fields (e.g. ``max_position_embeddings``)."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # every byte: any text encodes
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    if chat_template is not None:
        tok.chat_template = chat_template
    model = tiny_model("llama", seed=seed, vocab=len(tok), layers=layers, bos_token_id=tok.bos_token_id, **extra)
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# ---- stories260K ------------------------------------------------------------------------------

STORIES260K_MISSING = (
    "stories260K.gguf is not shipped with treespec (its licence does not allow it): tests that need it read "
    "the project's shared/ folder (shared/models/stories260K.gguf beside the repository, or set TREESPEC_SHARED "
    "to a folder holding models/stories260K.gguf)")


def stories260k_gguf():
    """The path of karpathy's stories260K GGUF (a tiny *real* model: peaked, deterministic text)
    in the project's shared/ folder, or None where this checkout has none. Not a registry name:
    it exists only in this repository's checkout, so tests load it by path."""
    from treespec.models import shared_dir

    shared = shared_dir()
    path = shared / "models" / "stories260K.gguf" if shared is not None else None
    return path if path is not None and path.is_file() else None
