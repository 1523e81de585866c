"""treespec: tree-attention speculative decoding for Hugging Face causal language models.

    out = treespec.generate(model, draft, "cpu", input_ids, max_new_tokens=128)

draws a tree of candidate continuations with ``draft`` each step, verifies the whole tree
in one forward of ``model`` under a tree attention mask, and commits the longest
acceptable path: the output is exactly what ``model`` alone would produce.
"""

import importlib as _importlib
import logging as _logging
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# Public name -> the module defining it, imported on first use (PEP 562): ``import
# treespec.cli`` then costs no torch or transformers import, so ``treespec --help`` and
# usage errors answer at once.
_EXPORTS = {
    "Tree": ".tree",
    "TreeConfig": ".config", "PRESETS": ".config", "Preset": ".config",
    "pack_mask": ".mask", "unpack_mask": ".mask",
    "generate": ".engine", "stream": ".engine", "GenerateOutput": ".engine", "SpecMetrics": ".engine",
    "RequestMetrics": ".engine", "StepOutput": ".engine",
    "SamplingParams": ".sampling_args",
    "load_draft": ".drafters.eagle",
    "AutoProfile": ".auto",
    "PrefixCache": ".prefix_cache",
    "TreespecWarning": ".warn",
    "custom_generate": ".dropin",
}

__all__ = [
    "Tree", "TreeConfig", "PRESETS", "Preset", "pack_mask", "unpack_mask", "generate", "stream",
    "GenerateOutput", "SpecMetrics", "RequestMetrics", "StepOutput", "SamplingParams", "load_draft",
    "AutoProfile", "PrefixCache", "custom_generate", "TreespecWarning",
]

if TYPE_CHECKING:
    from .auto import AutoProfile
    from .config import PRESETS, Preset, TreeConfig
    from .drafters.eagle import load_draft
    from .dropin import custom_generate
    from .engine import GenerateOutput, RequestMetrics, SpecMetrics, StepOutput, generate, stream
    from .mask import pack_mask, unpack_mask
    from .prefix_cache import PrefixCache
    from .sampling_args import SamplingParams
    from .tree import Tree
    from .warn import TreespecWarning


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treespec' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
