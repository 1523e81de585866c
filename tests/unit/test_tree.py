"""The Tree value: masks, positions, paths and conversions, against networkx and by hand."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.trees import parent_arrays, token_paths, trees
from treespec.mask import causal_mask
from treespec.tree import Tree

VOCAB = 50  # more tokens than any node has children, so distinct siblings always exist


# ---- properties over random trees -----------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(parent_arrays())
def test_strategy_gives_valid_trees(parents):
    tree = Tree(parents)
    assert tree.parents.tolist() == parents
    assert tree.parents.dtype == torch.int64
    assert tree.num_nodes == len(parents) and tree.num_drafted == len(parents) - 1


@settings(max_examples=50, deadline=None)
@given(trees())
def test_attention_mask_is_ancestor_or_self(tree):
    g = tree.to_networkx()
    mask = tree.attention_mask()
    assert mask.dtype == torch.bool and mask.shape == (tree.num_nodes, tree.num_nodes)
    for i in range(tree.num_nodes):
        expected = nx.ancestors(g, i) | {i}
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == expected


@settings(max_examples=50, deadline=None)
@given(trees(), st.integers(0, 1000))
def test_position_ids_are_prefix_plus_depth(tree, prefix_len):
    depth = nx.shortest_path_length(tree.to_networkx(), source=0)
    pos = tree.position_ids(prefix_len)
    assert pos.dtype == torch.int64
    assert pos.tolist() == [prefix_len + depth[i] for i in range(tree.num_nodes)]
    # EAGLE's formula: a node's depth is its mask row sum minus one.
    assert torch.equal(tree.depth, tree.attention_mask().sum(1) - 1)


@pytest.mark.parametrize("k", [0, 1, 2, 5, 17])
def test_chain_mask_is_lower_triangular(k):
    tree = Tree.chain(k)
    assert torch.equal(tree.attention_mask(), causal_mask(k + 1))
    assert tree.position_ids(3).tolist() == list(range(3, 3 + k + 1))
    assert tree.paths() == [list(range(k + 1))]


@settings(max_examples=50, deadline=None)
@given(trees())
def test_paths_cover_every_leaf_once(tree):
    paths = tree.paths()
    g = tree.to_networkx()
    leaves = [n for n in g if g.out_degree(n) == 0]
    assert sorted(p[-1] for p in paths) == sorted(leaves)
    assert len(paths) == len(leaves)  # so each leaf exactly once
    for p in paths:
        assert p[0] == 0
        assert all(tree.parents[b] == a for a, b in zip(p, p[1:]))
    assert set().union(*map(set, paths)) == set(range(tree.num_nodes))


@settings(max_examples=50, deadline=None)
@given(trees())
def test_padded_paths_match(tree):
    paths = tree.paths()
    padded = tree.paths(padded=True)
    assert padded.dtype == torch.int64
    assert padded.shape == (len(paths), tree.max_depth + 1)
    for row, p in zip(padded.tolist(), paths):
        assert row == p + [-1] * (tree.max_depth + 1 - len(p))


@settings(max_examples=50, deadline=None)
@given(trees())
def test_ancestors_and_children_count_match_networkx(tree):
    g = tree.to_networkx()
    for i in range(tree.num_nodes):
        assert tree.ancestors(i) == nx.shortest_path(g, 0, i)
    assert tree.children_count().tolist() == [g.out_degree(i) for i in range(tree.num_nodes)]
    assert tree.leaves() == sorted(n for n in g if g.out_degree(n) == 0)


@settings(max_examples=50, deadline=None)
@given(trees(vocab=VOCAB), st.booleans())
def test_networkx_round_trip(tree, with_scores):
    if with_scores:
        tree = tree.with_tokens(tree.tokens, -torch.arange(tree.num_nodes, dtype=torch.float32))
    g = tree.to_networkx()
    assert nx.is_arborescence(g)
    back = Tree.from_networkx(g)
    # from_networkx renumbers breadth-first, so compare by token path, which is unique.
    a, b = token_paths(tree), token_paths(back)
    assert a.keys() == b.keys()
    if with_scores:
        assert all(tree.scores[a[p]] == back.scores[b[p]] for p in a)
    else:
        assert back.scores is None
    # Nodes come back numbered breadth-first: the from_paths numbering, unchanged by a trip.
    assert back.depth[1:].diff().ge(0).all()
    canon = Tree.from_paths(tree.to_paths())
    assert torch.equal(Tree.from_networkx(canon.to_networkx()).parents, canon.parents)
    assert Tree.from_networkx(back.to_networkx()) == back


@settings(max_examples=50, deadline=None)
@given(trees())
def test_paths_round_trip(tree):
    paths = tree.to_paths()
    assert len(paths) == tree.num_drafted
    assert [len(p) for p in paths] == tree.depth[1:].tolist()
    canon = Tree.from_paths(paths)
    # from_paths numbers level by level, siblings by rank: the same tree, renumbered.
    assert sorted(canon.to_paths()) == sorted(paths)
    assert torch.equal(canon.parents, Tree.from_paths(canon.to_paths()).parents)
    assert canon.depth[1:].diff().ge(0).all()
    old_to_new = {i + 1: canon.to_paths().index(p) + 1 for i, p in enumerate(paths)}
    old_to_new[0] = 0
    for i in range(1, tree.num_nodes):
        assert canon.parents[old_to_new[i]] == old_to_new[int(tree.parents[i])]


@settings(max_examples=50, deadline=None)
@given(trees(), st.none() | st.integers(0, 30), st.none() | st.integers(0, 8))
def test_prune_keeps_ancestor_closure(tree, max_nodes, max_depth):
    ids = tree.with_tokens(torch.arange(tree.num_nodes))  # token = original node index
    pruned = ids.prune(max_nodes=max_nodes, max_depth=max_depth)
    kept = pruned.tokens.tolist()
    assert kept[0] == 0
    for i in range(1, pruned.num_nodes):
        # the kept node's original parent is kept, and is its parent in the pruned tree
        assert tree.parents[kept[i]] == kept[int(pruned.parents[i])]
    eligible = [i for i in range(1, tree.num_nodes) if max_depth is None or tree.depth[i] <= max_depth]
    expected = eligible if max_nodes is None else eligible[:max_nodes]
    assert kept[1:] == expected
    assert torch.equal(pruned.depth, tree.depth[pruned.tokens])


# ---- literal cases ------------------------------------------------------------------


def test_chain_of_three_literal():
    tree = Tree.chain(3, tokens=[11, 12, 13, 14])
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.attention_mask().int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]
    assert tree.position_ids(7).tolist() == [7, 8, 9, 10]
    assert tree.paths() == [[0, 1, 2, 3]]
    assert tree.to_paths() == [[0], [0, 0], [0, 0, 0]]
    assert tree.leaves() == [3]


def test_two_branches_of_two_literal():
    # root -> a -> b and root -> c -> d, numbered a=1, b=2, c=3, d=4 (depth-first).
    tree = Tree([-1, 0, 1, 0, 3], tokens=[0, 10, 11, 20, 21])
    assert tree.attention_mask().int().tolist() == [
        # r  a  b  c  d
        [1, 0, 0, 0, 0],  # r
        [1, 1, 0, 0, 0],  # a
        [1, 1, 1, 0, 0],  # b
        [1, 0, 0, 1, 0],  # c
        [1, 0, 0, 1, 1],  # d
    ]
    assert tree.position_ids(5).tolist() == [5, 6, 7, 6, 7]
    assert tree.paths() == [[0, 1, 2], [0, 3, 4]]
    assert tree.paths(padded=True).tolist() == [[0, 1, 2], [0, 3, 4]]
    assert tree.to_paths() == [[0], [0, 0], [1], [1, 0]]
    # from_paths numbers level by level: a=1, c=2, b=3, d=4.
    assert Tree.from_paths(tree.to_paths()).parents.tolist() == [-1, 0, 0, 1, 2]
    assert Tree.from_paths([[0], [1], [0, 0], [1, 0]]).paths() == [[0, 1, 3], [0, 2, 4]]
    back = Tree.from_networkx(tree.to_networkx())  # renumbered breadth-first too
    assert back.parents.tolist() == [-1, 0, 0, 1, 2] and back.tokens.tolist() == [0, 10, 20, 11, 21]


def test_prune_literal():
    tree = Tree([-1, 0, 1, 0, 3], tokens=[0, 10, 11, 20, 21])
    assert tree.prune(max_depth=1).tokens.tolist() == [0, 10, 20]
    assert tree.prune(max_nodes=2).parents.tolist() == [-1, 0, 1]
    assert tree.prune(max_nodes=99) is tree


def test_negative_tokens_are_not_mistaken_for_duplicate_siblings():
    # (parent 0, token 5) and (parent 1, token -1) once collided in the sibling key.
    tree = Tree([-1, 0, 1], tokens=[0, 5, -1])
    assert tree.tokens.tolist() == [0, 5, -1]


# ---- invalid inputs -----------------------------------------------------------------


@pytest.mark.parametrize(
    "parents, match",
    [
        ([-1, 2, 0], r"node 1 has parent 2: a cycle or a parent after its child"),
        ([-1, 1], r"node 1 has parent 1: a cycle"),
        ([-1, 0, -1], r"node 2 has parent -1: a tree has exactly one root"),
        ([-1, -3], r"node 1 has parent -3: a negative parent"),
        ([0, 0], r"parents\[0\] must be -1"),
        ([], r"at least the root"),
        ([[-1, 0]], r"one-dimensional"),
        ([-1.0, 0.0], r"must hold integers"),
    ],
)
def test_invalid_parents_raise(parents, match):
    with pytest.raises(ValueError, match=match):
        Tree(parents)


def test_invalid_tokens_and_scores_raise():
    with pytest.raises(ValueError, match="duplicate sibling tokens"):
        Tree([-1, 0, 0], tokens=[9, 4, 4])
    with pytest.raises(ValueError, match="tokens has 2 entries for a tree of 3 nodes"):
        Tree([-1, 0, 0], tokens=[9, 4])
    with pytest.raises(ValueError, match="scores has 1 entries"):
        Tree([-1, 0], tokens=[1, 2], scores=[0.0])
    Tree([-1, 0, 1], tokens=[9, 4, 4])  # same token under different parents is fine


@pytest.mark.parametrize(
    "paths, match",
    [
        ([[0], [0, 0, 0]], r"path \[0, 0, 0\] is listed but its prefix \[0, 0\] is missing"),
        ([[0], [0, 1]], r"path \[0, 1\] is listed but its elder sibling \[0, 0\] is missing"),
        ([[0], [1, 0]], r"prefix \[1\] is missing"),
        ([[0], [2]], r"path \[2\] is listed but its elder sibling \[1\] is missing"),
        ([[0], [0]], r"listed twice"),
        ([[]], r"empty path"),
        ([[0], [-1]], r"negative child rank"),
    ],
)
def test_invalid_paths_raise(paths, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_paths(paths)


def test_negative_chain_raises():
    with pytest.raises(ValueError, match=r"k >= 0"):
        Tree.chain(-1)


@pytest.mark.parametrize(
    "edges, match",
    [
        ([(0, 1), (0, 2), (1, 3), (2, 3)], "not a rooted arborescence"),  # a diamond
        ([(0, 1), (1, 2), (2, 0)], "not a rooted arborescence"),  # a cycle
        ([(0, 1), (2, 3)], "not a rooted arborescence"),  # two roots
        ([], "empty graph"),
    ],
)
def test_from_networkx_rejects_non_arborescence(edges, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_networkx(nx.DiGraph(edges))


def test_from_networkx_checks_the_given_root():
    g = nx.DiGraph([("r", "a"), ("r", "b")])
    assert Tree.from_networkx(g, root="r").parents.tolist() == [-1, 0, 0]
    with pytest.raises(ValueError, match="is not the graph's root"):
        Tree.from_networkx(g, root="a")
