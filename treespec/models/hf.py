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


def from_transformers(name_or_path: str | Path, dtype: torch.dtype, gguf_file: str | None = None) -> Loaded:
    """A saved model folder, a hub id, or (with ``gguf_file``) a GGUF file in that folder."""
    options = {}
    if gguf_file is not None:
        try:  # plain dense weights: newer transformers may keep them packed for its own kernels
            from transformers import GgufConfig

            options["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # transformers 5.0 has no GgufConfig, and always de-quantizes
            pass
    with no_transformers_bars():
        model = AutoModelForCausalLM.from_pretrained(name_or_path, gguf_file=gguf_file, dtype=dtype, **options)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, gguf_file=gguf_file)
    return model.eval(), tokenizer


def open_with_transformers(path: Path, dtype: torch.dtype) -> Loaded:
    """A GGUF file that transformers reads itself (de-quantizing to ``dtype``)."""
    return from_transformers(path.parent, dtype, gguf_file=path.name)
