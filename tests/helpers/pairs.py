"""A tiny target and a drafter of each kind, made once per session: what a test that must hold
for every drafter runs (prefix caching, fixed shapes).

Kinds: ``"ngram"`` (prompt lookup), ``"model"`` (a one-layer draft model), ``"eagle3"`` (a
hand-written EAGLE-3 head), ``"eagle1"`` (an EAGLE-1 head that drafts well for its
near-bigram target: runs of accepted drafts, multi-token commits) and ``"hybrid"`` (the
EAGLE-3 head with prompt lookup grafted on). Targets have V = 64 tokens.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import treespec
from helpers.eagle_heads import eagle3_checkpoint, eagle_target, informed_eagle1_checkpoint, write_head
from helpers.tiny import tiny_model
from treespec.drafters import EagleDrafter, HybridDrafter, ModelDrafter, NgramDrafter

KINDS = ("ngram", "model", "eagle3", "eagle1", "hybrid")

_made: dict = {}


def pair(kind: str, peak: float = 60.0):
    """(target, drafter) of a kind, made once per session."""
    key = (kind, peak)
    if key not in _made:
        with tempfile.TemporaryDirectory() as tmp:  # a head's files are read once, at load
            if kind == "ngram":
                _made[key] = (tiny_model("llama", 0, peak=peak), NgramDrafter())
            elif kind == "model":
                _made[key] = (tiny_model("llama", 0, peak=peak),
                              ModelDrafter(tiny_model("llama", 1, layers=1, peak=peak)))
            elif kind in ("eagle3", "hybrid"):
                model = eagle_target("eagle3", 0, "llama", peak)
                head = treespec.load_draft(write_head(Path(tmp), *eagle3_checkpoint(0)), model)
                _made[key] = (model, head if kind == "eagle3" else HybridDrafter(
                    head, NgramDrafter(max_ngram=2, min_ngram=1, max_matches=2, depth=4, num_nodes=4)))
            else:  # an EAGLE-1 head that drafts well for its near-bigram target: runs of accepted drafts
                model = eagle_target("informed", 0, "llama", peak)
                _made[key] = (model, EagleDrafter.from_pretrained(write_head(Path(tmp), *informed_eagle1_checkpoint()),
                                                                  model))
    return _made[key]


def graphed(drafter, whole_draft: bool = True):
    """``drafter`` (an EAGLE head, or a hybrid over one) with its head's passes on the fixed shapes
    a GPU captures (``cuda_graphs=True``: the commit passes and the whole draft, or with
    ``whole_draft=False`` the passes a level at a time), run uncaptured: the same head, a row of
    its own."""
    from treespec.drafters.graphs import GraphedRow

    if isinstance(drafter, HybridDrafter):
        return HybridDrafter(graphed(drafter.primary, whole_draft), drafter.lookup)
    assert isinstance(drafter, EagleDrafter)
    twin = type(drafter)(drafter.head, drafter.attention_backend, drafter.page_size, cuda_graphs=True,
                         whole_draft=whole_draft)
    twin.auto_calibration = drafter.auto_calibration
    twin.graphed_row = GraphedRow(capture=False)
    return twin
