"""treespec: tree-attention speculative decoding for Hugging Face causal language models.

    out = treespec.generate(model, draft, "cpu", input_ids, max_new_tokens=128)

draws a tree of candidate continuations with ``draft`` each step, verifies the whole tree
in one forward of ``model`` under a tree attention mask, and commits the longest
acceptable path: the output is exactly what ``model`` alone would produce.
"""

import logging as _logging

from .config import PRESETS, Preset, TreeConfig
from .engine import GenerateOutput, RequestMetrics, SpecMetrics, StepOutput, generate, stream
from .mask import pack_mask, unpack_mask
from .sampling import SamplingParams
from .tree import Tree
from .drafters.eagle import load_draft

__version__ = "0.1.0"

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "Tree", "TreeConfig", "PRESETS", "Preset", "pack_mask", "unpack_mask", "generate", "stream",
    "GenerateOutput", "SpecMetrics", "RequestMetrics", "StepOutput", "SamplingParams", "load_draft",
]
