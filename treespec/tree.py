"""The draft tree: one validated, immutable value per request and step.

Glossary (used across treespec):
    root    node 0, the newest committed token. Its KV is not cached yet, so the verify
            forward computes it together with the drafted nodes.
    node    a drafted token, index 1..N. Nodes are in topological order: a parent has a
            smaller index than each of its children.
    depth   distance from the root (root 0). A node's RoPE position is prefix_len + depth.
    path    the node indices from the root to a leaf, root first.

Shapes: N+1 tree nodes including the root; all index tensors are int64 on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import networkx as nx
import torch

__all__ = ["Tree"]


def _as_index_tensor(values, name: str) -> torch.Tensor:
    t = torch.as_tensor(values)
    if t.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")
    return t.to(device="cpu", dtype=torch.int64).contiguous()


def _checked_depths(p: list[int]) -> list[int]:
    """Each node's depth for parents ``p``, raising on what is not a tree in topological
    order. Plain Python: trees are tens of nodes, where a tensor operation costs more than
    the loop (a tree is built several times a decoding step)."""
    if not p:
        raise ValueError("a tree needs at least the root: parents must have length >= 1")
    if p[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {p[0]}")
    if -1 in p[1:]:
        raise ValueError(f"node {p.index(-1, 1)} has parent -1: a tree has exactly one root (node 0)")
    depth = [0] * len(p)
    for i in range(1, len(p)):
        if not 0 <= p[i] < i:  # one pass suffices because parents precede children
            why = "a cycle or a parent after its child" if p[i] >= i else "a negative parent"
            raise ValueError(f"node {i} has parent {p[i]}: {why}; nodes must be in topological order "
                             f"(0 <= parents[i] < i)")
        depth[i] = depth[p[i]] + 1
    return depth


@dataclass(frozen=True, eq=False)
class Tree:
    """A rooted draft tree in topological order.

    Attributes:
        parents: int64 ``[N+1]``; ``parents[0] == -1`` and ``0 <= parents[i] < i``.
        tokens:  int64 ``[N+1]`` token ids (``tokens[0]`` is the root token), or None for
            a shape-only tree (a static preset before drafting).
        scores:  float32 ``[N+1]`` cumulative draft log-probabilities (root 0), or None.
        source:  int8 ``[N+1]``: which drafter proposed each node when several did (see
            :class:`~treespec.drafters.hybrid.HybridDrafter`; ``auto`` calibrates each
            source's scores on their own), or None: one drafter.
        depth:   int64 ``[N+1]``, derived.
    """

    parents: torch.Tensor
    tokens: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    source: torch.Tensor | None = None
    depth: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        parents = _as_index_tensor(self.parents, "parents")
        p = parents.tolist()
        n = len(p)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "depth", torch.tensor(_checked_depths(p), dtype=torch.int64))

        if self.tokens is not None:
            tokens = _as_index_tensor(self.tokens, "tokens")
            if tokens.numel() != n:
                raise ValueError(f"tokens has {tokens.numel()} entries for a tree of {n} nodes")
            # Siblings with one token would make the accepted set ambiguous.
            if len(set(zip(p[1:], tokens.tolist()[1:]))) != n - 1:
                raise ValueError("duplicate sibling tokens: children of one parent must carry distinct tokens")
            object.__setattr__(self, "tokens", tokens)
        if self.scores is not None:
            scores = torch.as_tensor(self.scores, dtype=torch.float32).cpu().reshape(-1)
            if scores.numel() != n:
                raise ValueError(f"scores has {scores.numel()} entries for a tree of {n} nodes")
            object.__setattr__(self, "scores", scores)
        if self.source is not None:
            source = torch.as_tensor(self.source, dtype=torch.int8).cpu().reshape(-1)
            if source.numel() != n:
                raise ValueError(f"source has {source.numel()} entries for a tree of {n} nodes")
            object.__setattr__(self, "source", source)

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_parents(cls, parents, tokens=None, scores=None) -> "Tree":
        return cls(parents, tokens, scores)

    @classmethod
    def chain(cls, k: int, tokens=None) -> "Tree":
        """A chain of ``k`` drafted nodes below the root."""
        if k < 0:
            raise ValueError(f"a chain needs k >= 0 drafted nodes, got {k}")
        return cls(torch.arange(-1, k), tokens)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "Tree":
        """Build from the Medusa / vLLM path-list format.

        Each path lists child ranks from the root: ``[[0], [1], [0, 0]]`` is the root with
        two children, the first of which has a child. Every prefix of a path must be listed.
        Nodes are numbered breadth-first, siblings by rank, so parents precede children.
        """
        keys = []
        for p in paths:
            p = tuple(int(r) for r in p)
            if not p:
                raise ValueError("empty path: the root is implicit, list only drafted nodes")
            if any(r < 0 for r in p):
                raise ValueError(f"path {list(p)} has a negative child rank")
            keys.append(p)
        if len(set(keys)) != len(keys):
            raise ValueError("a path is listed twice")
        present = set(keys)
        for p in keys:
            if len(p) > 1 and p[:-1] not in present:
                raise ValueError(f"path {list(p)} is listed but its prefix {list(p[:-1])} is missing")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in present:
                # A Tree keeps no ranks, so a gap would silently shift this node to a lower rank.
                raise ValueError(
                    f"path {list(p)} is listed but its elder sibling {list(p[:-1]) + [p[-1] - 1]} "
                    f"is missing: child ranks must be 0, 1, 2, ... without gaps"
                )
        ordered = sorted(keys, key=lambda p: (len(p), p))
        index = {(): 0}
        parents = [-1]
        for i, p in enumerate(ordered, start=1):
            index[p] = i
            parents.append(index[p[:-1]])
        return cls(parents)

    @classmethod
    def from_networkx(cls, g: "nx.DiGraph", root=None) -> "Tree":
        """Build from a rooted arborescence. Node attributes ``token`` and ``score`` are kept.

        Nodes are renumbered breadth-first (children in sorted order of their labels).
        """
        if g.number_of_nodes() == 0:
            raise ValueError("empty graph: a tree needs at least the root")
        if not nx.is_arborescence(g):
            raise ValueError(
                "graph is not a rooted arborescence (a tree with edges from parent to child, "
                "one root, no cycles)"
            )
        roots = [n for n, d in g.in_degree() if d == 0]
        if root is not None and roots != [root]:
            raise ValueError(f"root {root!r} is not the graph's root {roots[0]!r}")
        order = list(nx.bfs_tree(g, roots[0], sort_neighbors=sorted))
        index = {n: i for i, n in enumerate(order)}
        parents = [-1] + [index[next(iter(g.predecessors(n)))] for n in order[1:]]
        tokens = scores = None
        if all("token" in g.nodes[n] for n in order):
            tokens = [g.nodes[n]["token"] for n in order]
        if all("score" in g.nodes[n] for n in order):
            scores = [g.nodes[n]["score"] for n in order]
        return cls(parents, tokens, scores)

    # ---- views --------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Nodes including the root (N+1)."""
        return self.parents.numel()

    @property
    def num_drafted(self) -> int:
        """Drafted nodes, root excluded (N)."""
        return self.parents.numel() - 1

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def children_count(self) -> torch.Tensor:
        """int64 ``[N+1]``: how many children each node has."""
        counts = torch.zeros(self.num_nodes, dtype=torch.int64)
        counts.index_add_(0, self.parents[1:], torch.ones(self.num_nodes - 1, dtype=torch.int64))
        return counts

    def leaves(self) -> list[int]:
        return torch.nonzero(self.children_count() == 0).flatten().tolist()

    def attention_mask(self) -> torch.Tensor:
        """bool ``[N+1, N+1]``: ``mask[i, j]`` is True iff node j is node i or its ancestor.

        Computed once per tree (the engine needs it for the forward and for verification);
        treat the returned tensor as read-only.
        """
        return self._mask

    @functools.cached_property
    def _mask(self) -> torch.Tensor:
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool)
        # mask[i] |= mask[parent[i]], one depth level at a time (parents are final by then).
        for d in range(1, self.max_depth + 1):
            rows = torch.nonzero(self.depth == d).flatten()
            mask[rows] |= mask[self.parents[rows]]
        return mask

    def position_ids(self, prefix_len: int = 0) -> torch.Tensor:
        """int64 ``[N+1]``: RoPE positions, ``prefix_len + depth``."""
        return self.depth + int(prefix_len)

    def paths(self, padded: bool = False):
        """Root-to-leaf node index lists, one per leaf in leaf order.

        With ``padded=True``: an int64 ``[num_leaves, max_depth+1]`` tensor, -1 padded.
        """
        mask = self.attention_mask()
        leaves = self.leaves()
        out = [torch.nonzero(mask[leaf]).flatten().tolist() for leaf in leaves]
        if not padded:
            return out
        t = torch.full((len(out), self.max_depth + 1), -1, dtype=torch.int64)
        for r, p in enumerate(out):
            t[r, : len(p)] = torch.tensor(p)
        return t

    def ancestors(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        path = [int(node)]
        while path[-1] != 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]

    def to_networkx(self) -> "nx.DiGraph":
        g = nx.DiGraph()
        for i in range(self.num_nodes):
            attrs = {"depth": int(self.depth[i])}
            if self.tokens is not None:
                attrs["token"] = int(self.tokens[i])
            if self.scores is not None:
                attrs["score"] = float(self.scores[i])
            g.add_node(i, **attrs)
        g.add_edges_from((int(p), i) for i, p in enumerate(self.parents.tolist()) if p >= 0)
        return g

    def to_paths(self) -> list[list[int]]:
        """The Medusa / vLLM path-list format: per drafted node, its child ranks from the root.

        A child's rank is its order among its siblings by node index.
        """
        rank = [0] * self.num_nodes
        seen: dict[int, int] = {}
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            rank[i] = seen.get(p, 0)
            seen[p] = rank[i] + 1
        out: list[list[int]] = [[]]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            out.append(out[p] + [rank[i]])
        return out[1:]

    def with_tokens(self, tokens, scores=None) -> "Tree":
        return Tree(self.parents, tokens, scores, self.source)

    def prune(self, max_nodes: int | None = None, max_depth: int | None = None) -> "Tree":
        """Keep nodes with ``depth <= max_depth`` and then the first ``max_nodes`` drafted ones.

        Both cuts keep the tree ancestor-closed: a prefix of a topological order, and a
        depth cut, each contain every kept node's parent.
        """
        keep = torch.ones(self.num_nodes, dtype=torch.bool)
        if max_depth is not None:
            keep &= self.depth <= max(int(max_depth), 0)
        if max_nodes is not None:
            idx = torch.nonzero(keep).flatten()[: max(int(max_nodes), 0) + 1]
            keep = torch.zeros_like(keep)
            keep[idx] = True
        if bool(keep.all()):
            return self
        return self.subtree(torch.nonzero(keep).flatten()[1:].tolist())

    def subtree(self, nodes: Sequence[int]) -> "Tree":
        """The tree of the root and ``nodes`` (drafted node indices, an ancestor-closed set),
        renumbered in their index order, tokens, scores and sources kept."""
        keep = torch.zeros(self.num_nodes, dtype=torch.bool)
        keep[0] = True
        if len(nodes):
            keep[torch.as_tensor(list(nodes), dtype=torch.int64)] = True
        if not bool(keep[self.parents[keep].clamp(min=0)].all()):
            raise ValueError("subtree nodes must be ancestor-closed: a kept node's parent is missing")
        idx = torch.nonzero(keep).flatten()
        remap = torch.full((self.num_nodes,), -1, dtype=torch.int64)
        remap[idx] = torch.arange(idx.numel())
        parents = torch.where(self.parents[idx] >= 0, remap[self.parents[idx].clamp(min=0)], -1)
        tokens = None if self.tokens is None else self.tokens[idx]
        scores = None if self.scores is None else self.scores[idx]
        source = None if self.source is None else self.source[idx]
        return Tree(parents, tokens, scores, source)

    def __repr__(self) -> str:
        return f"Tree(num_drafted={self.num_drafted}, max_depth={self.max_depth})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, Tree):
            return NotImplemented

        def same(a, b):
            if a is None or b is None:
                return a is None and b is None
            return a.shape == b.shape and bool(torch.equal(a, b))

        return same(self.parents, other.parents) and same(self.tokens, other.tokens)

    __hash__ = None
