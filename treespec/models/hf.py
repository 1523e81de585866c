"""Models that ``transformers`` reads itself: saved folders, hub ids, and GGUF files it can
de-quantize, with its progress bars kept off the terminal."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .common import Loaded

__all__ = ["from_transformers", "open_with_transformers", "no_transformers_bars"]


@contextlib.contextmanager
def no_transformers_bars():
    """Silence the progress bars transformers draws while it loads ("Loading weights",
    "Converting and de-quantizing GGUF tensors"): library code does not write to the terminal.
    Hub downloads keep huggingface_hub's own bars."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    # The GGUF reader calls tqdm directly (transformers 5.0 to 5.25 at least), past the switch above.
    gguf_tqdm = gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = hf_logging.tqdm  # transformers' own tqdm, now silent
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


# What a saved tokenizer leaves in its folder (any one of them): transformers' own files, a
# sentencepiece model, a BPE vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def from_transformers(name_or_path: str | Path, dtype: torch.dtype, gguf_file: str | None = None,
                      local_files_only: bool = False) -> Loaded:
    """A saved model folder, a hub id, or (with ``gguf_file``) a GGUF file in that folder;
    ``local_files_only``: a hub id from the local cache, the hub not asked."""
    folder = Path(name_or_path)
    if gguf_file is None and folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        # transformers would try to build one and say that sentencepiece or tiktoken is missing
        from .common import ModelUnavailableError

        raise ModelUnavailableError(
            f"{folder} has a model but no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the tokenizer of "
            "the model beside it (tokenizer.save_pretrained(folder)); a draft model needs its target's tokenizer")
    options = {}
    if gguf_file is not None:
        try:  # plain dense weights: newer transformers may keep them packed for its own kernels
            from transformers import GgufConfig

            options["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # transformers 5.0 has no GgufConfig, and always de-quantizes
            pass
    with no_transformers_bars():
        if local_files_only:
            options["local_files_only"] = True
        model = AutoModelForCausalLM.from_pretrained(name_or_path, gguf_file=gguf_file, dtype=dtype, **options)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, gguf_file=gguf_file,
                                                  **({"local_files_only": True} if local_files_only else {}))
    return model.eval(), tokenizer


def open_with_transformers(path: Path, dtype: torch.dtype) -> Loaded:
    """A GGUF file that transformers reads itself (de-quantizing to ``dtype``)."""
    return from_transformers(path.parent, dtype, gguf_file=path.name)
