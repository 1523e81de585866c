"""The drafter interface.

A :class:`Drafter` is configuration (weights, options); :meth:`Drafter.start` opens a
:class:`DraftSession` holding the per-request draft state (its KV cache, recent tokens)
for one ``generate`` call. Per step the engine calls ``propose`` then ``commit``:

    trees = session.propose(requests, roots, max_depth)   # tree_cfg came in DraftStart
    ... the target verifies ...
    session.commit(requests, new_tokens, features)

Feature convention (EAGLE): ``features[b][i]`` is the target's state at the position whose
*next* token is ``tokens[b][i]``: at start, the prompt's positions paired with
``prompt[1:] + [first_token]``; at commit, the root and accepted nodes paired with the
accepted tokens and the bonus.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..config import TreeConfig
from ..constraints import DraftRules, draft_constrain
from ..tree import Tree

if TYPE_CHECKING:
    from ..auto import AutoProfile

__all__ = ["Drafter", "DraftSession", "DraftStart", "check_vocab"]


@dataclass
class DraftStart:
    """What a session starts from.

    Attributes:
        prompts:      token ids per request.
        first_tokens: the token the target produced after each prompt (the first root).
        features:     per request ``[L_b, F]`` target features (see module docstring), or
                      None when the drafter reads none.
        max_new_tokens: the generation budget, for sizing the draft's own cache.
        tree_cfg:     the tree configuration of this generation.
        stop:         for dynamic trees, the builder's early-stop rule
                      (:data:`treespec.builder.StopRule`), or None: draft every level.
        candidates:   with ``auto`` trees, where a drafter that adds nodes beside the
                      builder's (one tree per request, ``Tree.source`` set) announces them
                      before drafting, so that the early stop weighs them; or None.
        rules:        per request, what its generation options forbid after a path
                      (:class:`treespec.constraints.DraftRules`, None: nothing), for the
                      builder to mask before each top-k; or None. The engine prunes what a
                      drafter proposes against the same rules, so using them is optional.
    """

    prompts: list[list[int]]
    first_tokens: list[int]
    features: list[torch.Tensor] | None
    max_new_tokens: int
    tree_cfg: TreeConfig
    stop: Callable[[int, torch.Tensor, torch.Tensor], bool] | None = None
    candidates: Callable[[Sequence[Tree]], None] | None = None
    rules: Sequence[DraftRules | None] | None = None

    def constrain_for(self, requests: Sequence[int], to_target: Callable | None = None,
                      to_draft: torch.Tensor | None = None):
        """The builder's ``constrain`` for a batch of ``requests`` (None: nothing to mask)."""
        return draft_constrain(None if self.rules is None else [self.rules[r] for r in requests], to_target,
                               to_draft)


class DraftSession(ABC):
    @abstractmethod
    def propose(self, requests: Sequence[int], roots: Sequence[int], max_depth: Sequence[int]) -> list[Tree]:
        """One tree per request; its root token is ``roots[i]`` and no node is deeper than
        ``max_depth[i]`` (drafting deeper is allowed; the engine prunes)."""

    @abstractmethod
    def commit(self, requests: Sequence[int], tokens: Sequence[list[int]],
               features: Sequence[torch.Tensor] | None) -> None:
        """The target committed ``tokens[i]`` (accepted drafts, then the bonus)."""

    def finish(self, request: int) -> None:
        """Request ``request`` is done; its state may be dropped."""


class Drafter(ABC):
    #: target features this drafter reads (runner feature ids), or None.
    feature_layers: tuple[int, ...] | None = None
    #: whether trees from this drafter carry sampled (not top-k) drafts with distributions.
    samples: bool = False
    #: drafted nodes this drafter may add on top of the tree config's ``num_nodes`` (the
    #: engine's budget and cache room per step): prompt lookup grafted onto a model's
    #: tree (:class:`~treespec.drafters.hybrid.HybridDrafter`).
    extra_nodes: int = 0
    #: the calibrations (greedy and sampling, and those of grafted sources such as prompt
    #: lookup) an ``auto`` tree starts from when no profile is given, e.g. read from a head
    #: directory's ``auto-profile.json``; its cost curve and timings are not used. None: the prior.
    auto_calibration: AutoProfile | None = None

    def check_compatible(self, model) -> None:
        """Raise ValueError when this drafter cannot draft for ``model``."""

    def features_for(self, model) -> tuple[int, ...] | None:
        return self.feature_layers

    def modules(self) -> tuple[torch.nn.Module, ...]:
        """The torch modules this drafter runs (for whole-model transforms such as
        :class:`~treespec.packing.PackedLinears`); none for a drafter without weights."""
        return ()

    @abstractmethod
    def start(self, model, ctx: DraftStart) -> DraftSession: ...


def check_vocab(draft_vocab: int, target_vocab: int, what: str) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(
            f"vocabulary mismatch: {what} has {draft_vocab} tokens, the target model "
            f"{target_vocab}; a draft must share the target's tokenizer and vocabulary size"
        )
