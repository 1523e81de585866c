"""A model drafter and prompt lookup in one tree.

A draft head is good at what the target writes from its own knowledge and poor at what it
copies: a function's name and arguments from the prompt, a docstring's phrases, a number
from the question. Prompt lookup is the opposite: when the newest tokens occurred before,
it proposes what followed them, often many tokens that all hold, and proposes nothing
otherwise. On HumanEval with the shipped SmolLM2 pair, lookup's chains were accepted in
about one step in five but then for three tokens on average, where the head's first draft
held a little under half the time on a chain (``benchmarks/micro/lookup_tau.py``, docs/benchmarks.md).

:class:`HybridDrafter` asks both for every step and verifies the union of their trees: the
primary's tree as it drafted it, with the lookup's continuations grafted on (a node both
proposed is kept once). Each node records who proposed it (``Tree.source``:
:data:`PRIMARY`, :data:`LOOKUP` or :data:`AGREED`, the last scored with the primary's
score). With ``auto`` trees each source has its own calibration, so a lookup chain is
verified as deep as its own record of acceptance pays, step by step; with a fixed tree the
lookup's nodes come on top of the tree's budget (``Drafter.extra_nodes``).

The verification is the engine's, unchanged: the union is just a tree, so the output is
the target's, greedy or sampled.
"""

from __future__ import annotations

from typing import Sequence

from ..tree import Tree
from .base import DraftSession, DraftStart, Drafter
from .ngram import NgramDrafter

__all__ = ["HybridDrafter", "merge_trees", "PRIMARY", "LOOKUP", "AGREED", "SOURCE_NAMES"]

PRIMARY, LOOKUP, AGREED = 0, 1, 2
#: ``Tree.source`` codes by name, as auto profiles store their calibrations.
SOURCE_NAMES = {PRIMARY: "draft", LOOKUP: "lookup", AGREED: "agreed"}


def merge_trees(primary: Tree, extra: Tree) -> Tree:
    """The union of two trees with one root token: ``primary``'s nodes first, in its
    order and with its scores, then ``extra``'s nodes that ``primary`` lacks (the same
    token under the same parent is one node), with ``extra``'s scores.

    Sources: ``primary``'s nodes :data:`PRIMARY`, or :data:`AGREED` where ``extra`` has
    them too; the rest :data:`LOOKUP`. Needs tokens and scores on both."""
    if primary.tokens is None or extra.tokens is None or primary.scores is None or extra.scores is None:
        raise ValueError("merge_trees needs trees with tokens and scores")
    if int(primary.tokens[0]) != int(extra.tokens[0]):
        raise ValueError(f"the trees' roots differ: {int(primary.tokens[0])} and {int(extra.tokens[0])}")
    parents = primary.parents.tolist()
    tokens = primary.tokens.tolist()
    scores = primary.scores.tolist()
    source = [PRIMARY] * len(parents)
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
    where = [0]  # extra's node j is merged node where[j]
    for p, t, s in zip(extra.parents.tolist()[1:], extra.tokens.tolist()[1:], extra.scores.tolist()[1:]):
        key = (where[p], t)
        i = child.get(key)
        if i is None:
            i = len(parents)
            child[key] = i
            parents.append(where[p])
            tokens.append(t)
            scores.append(s)
            source.append(LOOKUP)
        elif source[i] == PRIMARY:
            source[i] = AGREED
        where.append(i)
    return Tree(parents, tokens, scores, source)


class HybridDrafter(Drafter):
    """A drafter (an EAGLE head, a draft model) with prompt lookup grafted onto its trees.

    Args:
        primary: the model drafter; its features, checks and calibrations are the hybrid's.
        lookup:  the prompt lookup; default ``NgramDrafter(max_ngram=3, min_ngram=2,
                 max_matches=2, depth=8, num_nodes=10)``: matches of two tokens or more
                 (single-token matches mostly mislead), chains up to 8 deep.
    """

    def __init__(self, primary: Drafter, lookup: NgramDrafter | None = None):
        if isinstance(primary, (HybridDrafter, NgramDrafter)):
            raise ValueError(f"the hybrid's primary drafter must be a model drafter, got {type(primary).__name__}")
        self.primary = primary
        self.lookup = lookup if lookup is not None else NgramDrafter(
            max_ngram=3, min_ngram=2, max_matches=2, depth=8, num_nodes=10)
        if self.lookup.num_nodes is None or self.lookup.depth is None:
            raise ValueError("the hybrid's lookup needs its own depth and num_nodes (NgramDrafter(depth=..., "
                             "num_nodes=...)): they come on top of the tree config's")
        self.feature_layers = primary.feature_layers
        self.auto_calibration = primary.auto_calibration
        self.extra_nodes = self.lookup.num_nodes

    def with_compiled_passes(self) -> "HybridDrafter":
        """This hybrid with its primary's head passes compiled, where the primary has them
        (:meth:`~treespec.drafters.eagle.EagleDrafter.with_compiled_passes`); the same lookup."""
        compiled = getattr(self.primary, "with_compiled_passes", None)
        if compiled is None:
            return self
        twin = HybridDrafter(compiled(), self.lookup)
        twin.auto_calibration = self.auto_calibration
        return twin

    def check_compatible(self, model) -> None:
        self.primary.check_compatible(model)

    def modules(self):
        return self.primary.modules()

    def features_for(self, model):
        return self.primary.features_for(model)

    def prefix_key(self, model):
        return self.primary.prefix_key(model)  # prompt lookup reads the tokens: nothing to keep

    def start(self, model, ctx: DraftStart) -> "HybridSession":
        return HybridSession(self.primary.start(model, ctx), self.lookup.start(model, ctx), ctx.candidates)

    def __repr__(self):
        return f"HybridDrafter({self.primary!r}, {self.lookup!r})"


class HybridSession(DraftSession):
    def __init__(self, primary: DraftSession, lookup: DraftSession, candidates=None):
        self.primary, self.lookup, self.candidates = primary, lookup, candidates
        self.compile_seconds = primary.compile_seconds + lookup.compile_seconds

    def propose(self, requests: Sequence[int], roots: Sequence[int], max_depth: Sequence[int]) -> list[Tree]:
        extra = self.lookup.propose(requests, roots, max_depth)
        if self.candidates is not None:  # auto: the early stop weighs the lookup's nodes too
            self.candidates([Tree(e.parents, e.tokens, e.scores, [PRIMARY] + [LOOKUP] * e.num_drafted)
                             for e in extra])
        trees = self.primary.propose(requests, roots, max_depth)
        # A tree without lookup nodes needs no sources: ``auto`` reads None as all primary.
        return [merge_trees(t, e) if e.num_drafted else t for t, e in zip(trees, extra)]

    def commit(self, requests, tokens, features) -> None:
        self.primary.commit(requests, tokens, features)
        self.lookup.commit(requests, tokens, None)

    def prefix_state(self, request: int, start: int):
        return self.primary.prefix_state(request, start)

    def finish(self, request: int) -> None:
        self.primary.finish(request)
        self.lookup.finish(request)

    def close(self) -> None:
        self.primary.close()
        self.lookup.close()
