"""Loading ``(model, tokenizer)`` by registry name, local folder, local ``.gguf`` file or hub id.

A registry model (:mod:`.registry`) is fetched on first use and converted once into a ready
float32 safetensors copy in :func:`~.common.converted_dir`, which later loads read (under a
second, against about 25 s to de-quantize SmolLM2's GGUF again). A ``.gguf`` path is read by
``transformers``, or by treespec's reader (:mod:`.gguf_reader`) when it would trip
``transformers``; anything else is a saved folder or a Hugging Face hub id.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch

from . import registry
from .common import LoadProgress, Loaded, ModelUnavailableError, ProgressFn, converted_dir
from .gguf_blocks import gguf_linears
from .gguf_reader import open_gguf_llama, trips_transformers
from .hf import from_transformers, no_transformers_bars, open_with_transformers
from .quant import WEIGHTS, check_kernels, keep_dense, quantize_linears
from .registry import ModelSpec

__all__ = ["load"]

logger = logging.getLogger(__name__)


def _convert(spec: ModelSpec, folder: Path, progress: ProgressFn | None) -> None:
    """De-quantize ``spec``'s GGUF once and save it as a ready model: float32 safetensors (the
    de-quantized values exactly, whatever dtype is asked for later) and the tokenizer."""
    gguf = spec.locate(progress)
    message = f"converting {gguf.name} once into a ready model in {folder}"
    logger.info(message)
    report = progress or (lambda p: None)
    report(LoadProgress("convert", message, 0, 1))
    model, tokenizer = spec.open(gguf, torch.float32)
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.part")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with no_transformers_bars():
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
        os.replace(partial, folder)  # atomic: a concurrent reader never sees half a folder
    except OSError:
        if not (folder / "config.json").is_file():  # else another process got there first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    report(LoadProgress("convert", message, 1, 1))


def _load_named(spec: ModelSpec, dtype: torch.dtype, progress: ProgressFn | None) -> Loaded:
    if not spec.convert:
        return spec.open(spec.locate(progress), dtype)
    folder = converted_dir(spec.name)
    if not (folder / "config.json").is_file():
        _convert(spec, folder, progress)
    try:
        return from_transformers(folder, dtype)
    except (OSError, ValueError, ModelUnavailableError) as err:  # a half-written copy lacks its tokenizer too
        raise ModelUnavailableError(
            f"The converted copy of {spec.name} in {folder} cannot be read ({err}); delete that folder "
            "and it is converted again on the next load"
        ) from err


def load(name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
         progress: ProgressFn | None = None, weights: str = "dense") -> Loaded:
    """Load ``(model, tokenizer)`` by registry name, local folder, local ``.gguf`` file or hub id.

    The model comes back in eval mode with weights in ``dtype``. A registry model is fetched on
    first use and converted once into :func:`converted_dir` (later loads read that copy);
    ``progress``, if given, receives :class:`LoadProgress` reports of those slow first steps.
    Raises :class:`ModelUnavailableError` when the files cannot be found or fetched.

    ``weights`` (:data:`~.quant.WEIGHTS`; ``X+dense``: X for forwards of a few rows, the dense
    weights kept beside it for wider ones, :class:`~.quant.WidthSplitLinear`): ``"dense"``, every
    weight in ``dtype``; ``"gguf"``, the
    linear layers on the GGUF file's own Q4_0 / Q4_1 / Q4_K / Q8_0 blocks (a ``.gguf`` path or a named
    model, which is one; :func:`~.gguf_blocks.gguf_linears`); ``"int4"`` or ``"int8"``, quantized
    on load (:func:`~.quant.quantize_linears`). Quantized weights run on torch's CPU kernels, the
    output head stays dense (``"gguf"``: on the file's blocks too, as llama.cpp runs it), and
    ``dtype`` is the activations' (bfloat16 is the fast one).
    Raises ValueError for a format this model cannot take.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights != "dense":
        check_kernels()
    kind, split = weights.removesuffix("+dense"), weights.endswith("+dense")
    source = _gguf_source(name_or_path, progress) if kind == "gguf" else None  # before seconds of loading
    model, tokenizer = _load(name_or_path, dtype, progress)
    if source is not None:
        gguf_linears(model, source, head=True)
    elif kind != "dense":
        quantize_linears(model, kind)
    if split:
        keep_dense(model)
    return model, tokenizer


def _gguf_source(name_or_path: str | os.PathLike, progress: ProgressFn | None) -> Path:
    """The GGUF file a model was read from, for ``weights="gguf"``."""
    spec = registry.MODELS.get(str(name_or_path))
    if spec is not None:
        return spec.locate(progress)  # fetched once, as loading the model needs it anyway
    path = Path(name_or_path).expanduser()
    if path.suffix != ".gguf":
        raise ValueError(f"weights='gguf' runs a GGUF file's own blocks, and {name_or_path} is no .gguf file or "
                         "named GGUF model: use weights='int4' or 'int8' to quantize it on load")
    return path


def _load(name_or_path: str | os.PathLike, dtype: torch.dtype, progress: ProgressFn | None) -> Loaded:
    key = str(name_or_path)
    names = registry.MODELS  # looked up at each call, so that a test may stand in its own
    if key in names:
        return _load_named(names[key], dtype, progress)

    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelUnavailableError(f"No GGUF file at {path}")
        opener = open_gguf_llama if trips_transformers(path) else open_with_transformers
        return opener(path, dtype)

    if path.is_dir():  # a saved model: transformers' own errors say what is wrong with it
        return from_transformers(path, dtype)
    if path.is_absolute() or key.startswith((".", "~")) or path.exists():
        raise ModelUnavailableError(
            f"No model folder or .gguf file at {path}. Known names: {', '.join(names)}"
        )

    not_here = f"{key!r} is not a known name ({', '.join(names)}), a local folder or .gguf file"
    if not _HUB_ID.fullmatch(key):
        raise ModelUnavailableError(f"{not_here}, or a Hugging Face hub id")
    # Ask the hub only when it answers: offline, transformers retries each file for tens of
    # seconds, with a warning each time, before its own error (issue 31).
    online = hub_reachable()
    if not online and not _in_hub_cache(key):
        raise ModelUnavailableError(f"{not_here}, or a model in the local Hugging Face cache, and the hub "
                                    f"({_hub_host()}) cannot be reached from here to look for it")
    try:
        return from_transformers(key, dtype, local_files_only=not online)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelUnavailableError(f"{not_here}, and the hub cannot give it: {first}") from err


# owner/name or a bare name, as the hub spells repository ids
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _hub_host() -> str:
    from urllib.parse import urlparse

    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within ``timeout`` seconds
    (False at once under ``HF_HUB_OFFLINE``)."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        with socket.create_connection((_hub_host(), 443), timeout=timeout):
            return True
    except OSError:
        return False


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds ``repo_id``'s config."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id the hub library refuses, an unreadable cache: not there
        return False
