"""A drafter that keeps the trees it proposes: to look at what a draft offered the target.

    rec = RecordingDrafter(drafter)
    treespec.generate(model, rec, "cpu", ids, max_new_tokens=8)
    (trees, max_depth) = rec.trees[0]     # the first step's trees, one per request

The wrapper changes nothing the engine sees: it carries the wrapped drafter's features,
sampling, ``extra_nodes`` and ``auto_calibration``, so an ``auto`` tree decides from the
same calibration it would without the wrapper (a copy that dropped it decided from the prior).
"""

from __future__ import annotations

from typing import Sequence

from ..tree import Tree
from .base import DraftSession, DraftStart, Drafter

__all__ = ["RecordingDrafter"]


class RecordingDrafter(Drafter):
    """``inner``, with every ``propose`` kept in :attr:`trees` as ``(trees, max_depth)``:
    the trees as drafted (before the engine prunes them to ``max_depth`` and its node budget)
    and the depth the engine asked for, per request."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.feature_layers = inner.feature_layers
        self.extra_nodes, self.auto_calibration = inner.extra_nodes, inner.auto_calibration
        self.trees: list[tuple[list[Tree], list[int]]] = []

    def check_compatible(self, model) -> None:
        self.inner.check_compatible(model)

    def features_for(self, model):
        return self.inner.features_for(model)

    def modules(self):
        return self.inner.modules()

    def prefix_key(self, model):
        return self.inner.prefix_key(model)

    def start(self, model, ctx: DraftStart) -> DraftSession:
        return _RecordingSession(self.inner.start(model, ctx), self.trees)

    def __repr__(self):
        return f"RecordingDrafter({self.inner!r})"


class _RecordingSession(DraftSession):
    def __init__(self, session: DraftSession, trees: list):
        self.session, self.trees = session, trees
        self.compile_seconds = session.compile_seconds

    def propose(self, requests: Sequence[int], roots: Sequence[int], max_depth: Sequence[int]) -> list[Tree]:
        trees = self.session.propose(requests, roots, max_depth)
        self.trees.append((trees, list(max_depth)))
        return trees

    def commit(self, requests, tokens, features) -> None:
        self.session.commit(requests, tokens, features)

    def prefix_state(self, request: int, start: int):
        return self.session.prefix_state(request, start)

    def finish(self, request: int) -> None:
        self.session.finish(request)

    def close(self) -> None:
        self.session.close()
