"""Random trees for property tests (hypothesis strategies), and a tree's token paths."""

from __future__ import annotations

from hypothesis import strategies as st

from treespec.tree import Tree


@st.composite
def parent_arrays(draw, min_nodes: int = 1, max_nodes: int = 24) -> list[int]:
    """Valid parent arrays: ``parents[0] = -1`` and ``0 <= parents[i] < i``."""
    n = draw(st.integers(min_nodes, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@st.composite
def trees(draw, min_nodes: int = 1, max_nodes: int = 24, vocab: int | None = None) -> Tree:
    """Random trees of ``min_nodes`` to ``max_nodes`` nodes, the root included; with a
    vocabulary, nodes carry tokens from ``range(vocab)``, siblings distinct ones (``vocab`` must
    exceed the most children a node can have: ``vocab >= max_nodes`` is enough)."""
    parents = draw(parent_arrays(min_nodes, max_nodes))
    if vocab is None:
        return Tree(parents)
    used: dict[int, set[int]] = {}
    tokens = [draw(st.integers(0, vocab - 1))]
    for p in parents[1:]:
        free = sorted(set(range(vocab)) - used.setdefault(p, set()))
        t = draw(st.sampled_from(free))
        used[p].add(t)
        tokens.append(t)
    return Tree(parents, tokens)


def token_paths(tree: Tree) -> dict[tuple[int, ...], int]:
    """Each drafted node's token path from the root (the root's token excluded) -> its index."""
    tok = tree.tokens.tolist()
    return {tuple(tok[a] for a in tree.ancestors(i)[1:]): i for i in range(1, tree.num_nodes)}
