"""A draft model made of the target's own first layers (early exit), for when no smaller model
shares its vocabulary."""

from __future__ import annotations

import copy

import torch

__all__ = ["truncated_draft"]


def truncated_draft(model, num_layers: int):
    """A draft model made of ``model``'s first ``num_layers`` decoder layers, its final norm
    and output head (early exit, as in LayerSkip's self-speculation), for
    :class:`~treespec.drafters.ModelDrafter` when no smaller model shares the vocabulary.

    Weights are shared with ``model`` (no copy); the configuration is a separate object, so
    switching one model's attention implementation leaves the other alone.
    """
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be in 1..{total - 1} for a {total}-layer model, got {num_layers}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    with torch.device("meta"):
        draft = type(model)(cfg)
    decoder, src = draft.get_decoder(), model.get_decoder()
    decoder.embed_tokens = src.embed_tokens
    decoder.layers = torch.nn.ModuleList(src.layers[:num_layers])
    decoder.norm = src.norm
    decoder.rotary_emb = copy.deepcopy(src.rotary_emb)
    draft.lm_head = model.lm_head
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()
