"""treespec's own reader of llama.cpp GGUF files (Llama architecture, SentencePiece vocabulary).

For the GGUFs that ``transformers`` cannot read (:func:`trips_transformers`), such as karpathy's
llama2.c stories260K, whose separator and padding ids are 0xFFFFFFFF; :func:`~treespec.models.load`
sends a ``.gguf`` path here only then.

    model = load_gguf_llama(path)        # LlamaForCausalLM, eval mode, rotary rows un-permuted
    tokenizer = gguf_tokenizer(path)     # byte-fallback BPE from the file's tokens and scores
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

from .common import Loaded

__all__ = ["gguf_tokenizer", "load_gguf_llama", "open_gguf_llama", "permute_qk", "trips_transformers",
           "unpermute_qk"]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Rotary layout
#
# llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... of each head; transformers' Llama
# rotates the two halves (x_i, x_{i + D/2}). llama.cpp's converter therefore reorders the rows of
# each head of W_q and W_k from [first half | second half] to interleaved [h0, s0, h1, s1, ...];
# Meta / llama2.c checkpoints are interleaved natively. Either way, undoing it means reading each
# head's D rows as (D/2, 2) and transposing to (2, D/2).


def permute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotate-half (transformers) rows -> interleaved (llama.cpp) rows, as llama.cpp's converter does.

    Parameters
    ----------
    weight : Tensor [H * D, in_features]
        A q_proj or k_proj weight; ``n_heads`` is H (the kv head count for k_proj).
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved (llama.cpp) rows -> rotate-half (transformers) rows; inverse of :func:`permute_qk`.

    Parameters
    ----------
    weight : Tensor [H * D, in_features]
        A GGUF ``attn_q`` or ``attn_k`` weight; ``n_heads`` is H (the kv head count for ``attn_k``).
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


# ----------------------------------------------------------------------------------------------
# Reading

# GGUF tensor name -> transformers Llama parameter name; block tensors are "blk.{i}.<key>".
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _reader(path: str | os.PathLike):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No GGUF file at {path}")
    return gguf.GGUFReader(path)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _tensor(tensor) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor in PyTorch's [out, in] order."""
    import gguf

    if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data = np.asarray(tensor.data, dtype=np.float32)
    else:  # quantized (Q4_1, Q8_0, ...) or BF16: rows of packed blocks
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    # GGUF lists dims innermost first; the reader's array is already [out, in].
    return torch.from_numpy(data.reshape(tuple(reversed(tensor.shape.tolist()))).copy())


def _llama_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"load_gguf_llama reads Llama GGUFs only; this file's architecture is {arch!r}")

    def meta(key, default=None):
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return value

    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise ValueError("GGUF rope scaling is not supported by load_gguf_llama")
    hidden, n_heads = meta("embedding_length"), meta("attention.head_count")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens is not None else meta("vocab_size")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=meta("attention.head_count_kv", n_heads),
        head_dim=meta("rope.dimension_count", hidden // n_heads),
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        rope_theta=meta("rope.freq_base", 10000.0),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
    )


def load_gguf_llama(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build a ``LlamaForCausalLM`` from a llama.cpp GGUF file, in eval mode.

    Tensors may be F32, F16 or any type ``gguf.quants.dequantize`` knows (dequantized to
    ``dtype``). Q and K rows are restored from llama.cpp's interleaved rotary layout to
    transformers' rotate-half layout; a file without ``output.weight`` gets tied embeddings.
    """
    reader = _reader(path)
    config = _llama_config(reader)
    state = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GLOBAL_TENSORS:
            state[_GLOBAL_TENSORS[name]] = _tensor(tensor)
            continue
        prefix, block, rest = name.split(".", 2) if name.count(".") >= 2 else ("", "", name)
        if prefix != "blk" or rest not in _BLOCK_TENSORS:
            raise ValueError(f"Unexpected tensor {name!r} in {path}: not a plain Llama GGUF")
        weight = _tensor(tensor)
        if rest == "attn_q.weight":
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif rest == "attn_k.weight":
            weight = unpermute_qk(weight, config.num_key_value_heads)
        state[f"model.layers.{block}.{_BLOCK_TENSORS[rest]}"] = weight
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]

    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    logger.info("Loaded %s: %d layers, hidden %d, vocabulary %d", path, config.num_hidden_layers,
                config.hidden_size, config.vocab_size)
    return model.to(dtype).eval()


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best merged-token score first, which is the order SentencePiece's BPE applies them."""
    index = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                merges.append((-score, index[token], index[left], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]


def gguf_tokenizer(path: str | os.PathLike) -> LlamaTokenizer:
    """A ``transformers`` tokenizer for a GGUF file with a SentencePiece (``llama``) vocabulary.

    Built from the file's tokens and scores as a byte-fallback BPE with ``▁`` for spaces, the way
    transformers' own GGUF code does, but without reading the separator / padding ids (which may
    be 0xFFFFFFFF, "none").
    """
    reader = _reader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "llama":
        raise ValueError(f"gguf_tokenizer builds SentencePiece vocabularies only; {path} has {kind!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)

    def special(key: str, default: int) -> str:
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id", default)
        if not 0 <= token_id < len(tokens):
            raise ValueError(f"{path}: {key} token id {token_id} is outside the vocabulary of {len(tokens)}")
        return tokens[token_id]

    return LlamaTokenizer(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=_sentencepiece_merges(tokens, scores),
        unk_token=special("unknown", 0),
        bos_token=special("bos", 1),
        eos_token=special("eos", 2),
        add_bos_token=_field(reader, "tokenizer.ggml.add_bos_token", True),
        add_eos_token=_field(reader, "tokenizer.ggml.add_eos_token", False),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def trips_transformers(path: Path) -> bool:
    """Whether a GGUF stores a special token id outside its vocabulary (llama.cpp writes "none"
    as 0xFFFFFFFF), which transformers uses as an index; such Llama files are read here instead.
    Needed by every supported transformers: 5.0's GGUF tokenizer code indexes its tokens with the
    padding id, and 5.25 still fails on stories260K (an IndexError in the tokenizer, the model on
    the padding id)."""
    reader = _reader(path)
    vocab_size = len(_field(reader, "tokenizer.ggml.tokens", ()))
    ids = [field.contents() for key, field in reader.fields.items()
           if key.startswith("tokenizer.ggml.") and key.endswith("_token_id")]
    return any(i >= vocab_size for i in ids) and _field(reader, "general.architecture") == "llama"


def open_gguf_llama(path: Path, dtype: torch.dtype) -> Loaded:
    """A Llama GGUF read by :func:`load_gguf_llama` and :func:`gguf_tokenizer`."""
    return load_gguf_llama(path, dtype), gguf_tokenizer(path)
