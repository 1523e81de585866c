"""No draft: every tree is the root alone, so each verify forward commits one token.

This is plain autoregressive decoding through treespec's own runner, cache and attention:
the baseline that isolates what speculation adds when treespec runs the target through a
faster path (packed weights, bf16) than plain ``model.generate``.
"""

from __future__ import annotations

from typing import Sequence

from ..tree import Tree
from .base import DraftSession, DraftStart, Drafter

__all__ = ["NoDrafter"]


class NoDrafter(Drafter):
    def start(self, model, ctx: DraftStart) -> "_NoDraftSession":
        return _NoDraftSession()

    def __repr__(self):
        return "NoDrafter()"


class _NoDraftSession(DraftSession):
    def propose(self, requests: Sequence[int], roots: Sequence[int], max_depth: Sequence[int]) -> list[Tree]:
        return [Tree.chain(0, tokens=[root]) for root in roots]

    def commit(self, requests, tokens, features) -> None:
        pass
