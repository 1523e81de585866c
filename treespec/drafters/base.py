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

Prefix caching (:mod:`treespec.prefix_cache`): a drafter whose state across a prompt can be
filed and read back names it with :meth:`Drafter.prefix_key`; its session then gives its rows
(:meth:`DraftSession.prefix_state`) when a request ends, and starts a request that hit the
cache from ``DraftStart.prefix[b]`` instead of the whole prompt. Row t of a drafter's state may
depend only on tokens <= t: an EAGLE head files its entry i (token i+1 with the features at i)
as row i+1. A drafter without a key starts from ``DraftStart.prompts`` as always.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..config import TreeConfig
from ..constraints import DraftRules, draft_constrain
from ..prefix_cache import DraftPrefix
from ..tree import Tree

if TYPE_CHECKING:
    from ..auto import AutoProfile

__all__ = ["Drafter", "DraftSession", "DraftStart", "DraftPrefix", "check_vocab"]


@dataclass
class DraftStart:
    """What a session starts from.

    Attributes:
        prompts:      token ids per request.
        first_tokens: the token the target produced after each prompt (the first root).
        features:     per request ``[L_b - n_b, F]`` target features at positions
                      ``n_b .. L_b-1`` (see module docstring; ``n_b`` is ``prefix[b].length``,
                      0 without a hit), or None when the drafter reads none.
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
        prefix:       for a drafter with a :meth:`Drafter.prefix_key`, per request its start
                      from a prefix cache hit (:class:`~treespec.prefix_cache.DraftPrefix`:
                      the hit's length n, the drafter's rows for tokens ``0 .. n-1``, the target
                      features at n-1), or None (no hit); None for other drafters, and without
                      a prefix cache.
    """

    prompts: list[list[int]]
    first_tokens: list[int]
    features: list[torch.Tensor] | None
    max_new_tokens: int
    tree_cfg: TreeConfig
    stop: Callable[[int, torch.Tensor, torch.Tensor], bool] | None = None
    candidates: Callable[[Sequence[Tree]], None] | None = None
    rules: Sequence[DraftRules | None] | None = None
    prefix: Sequence[DraftPrefix | None] | None = None

    def constrain_for(self, requests: Sequence[int], to_target: Callable | None = None,
                      to_draft: torch.Tensor | None = None):
        """The builder's ``constrain`` for a batch of ``requests`` (None: nothing to mask)."""
        return draft_constrain(None if self.rules is None else [self.rules[r] for r in requests], to_target,
                               to_draft)


class DraftSession(ABC):
    #: seconds this session's start spent compiling (compiled head passes), which the engine
    #: counts in ``SpecMetrics.compile_seconds`` and not in any step's time
    compile_seconds: float = 0.0

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

    def close(self) -> None:
        """Generation ended, however it ended (every request finished, an error, a stream
        closed early): let go of anything lent to the session. Called once by the engine;
        nothing by default."""

    def prefix_state(self, request: int, start: int) -> dict[str, torch.Tensor] | None:
        """For a prefix cache, before :meth:`finish`: this drafter's rows for ``request``'s
        committed tokens from ``start`` on (name -> ``[R, ...]``, row ``t - start`` for token t,
        depending only on tokens <= t), as it reads them back from ``DraftStart.prefix``; fewer
        rows than tokens is allowed. None (the default): nothing to file."""
        return None


class Drafter(ABC):
    #: target features this drafter reads (runner feature ids), or None.
    feature_layers: tuple[int, ...] | None = None
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

    def prefix_key(self, model) -> tuple | None:
        """What a prefix cache files this drafter's state under: ``(owner, *details)``, the
        owner (the module whose state it is) compared by identity, the details (dtype, device,
        ...) by equality; a drafter with a key reads ``DraftStart.prefix`` and files its rows
        with :meth:`DraftSession.prefix_state`. None (the default): the drafter keeps no state
        to reuse and starts from ``DraftStart.prompts`` (a drafter that also reads target
        features then gets no hits: its features would be missing for the cached part)."""
        return None

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
