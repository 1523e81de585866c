"""The tree growers against a slow reference, on Markov-chain drafts.

A Markov draft's log-probabilities depend only on the frontier token: request b's next-token
distribution after token t is ``table[b, t]`` (a random ``[V, V]`` log-softmax table), and
after the root it is ``root_logp[b]``. That is enough to exercise everything the builders do
with a drafter's output, with the exact answer computable by hand.

A time-homogeneous chain has exact ties: the paths 2-2-0-2 and 2-0-2-2 sum the same
transitions, so their scores can be equal to the last bit, and which of them enters a full
frontier is then arbitrary. Tests that compare node sets exactly therefore use a table per
depth (``[B, D, V, V]``, still a Markov chain, with generic values); the homogeneous table
is compared through its score multiset, which ties cannot change.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.builder import Frontier, build_dynamic_trees, build_static_trees, build_trees
from treespec.config import PRESETS, TreeConfig
from treespec.tree import Tree


def markov_draft(B: int, V: int, seed: int, depths: int | None = None):
    """(root_logp float32 [B, V], table), rows log-softmax normalised.

    The table is ``[B, V, V]`` (one chain), or ``[B, depths, V, V]`` with ``depths`` given:
    ``table[b, d - 1, t]`` is the distribution after a node of depth d carrying token t.
    """
    g = torch.Generator().manual_seed(seed)
    root = torch.randn(B, V, generator=g).mul(2).log_softmax(-1)
    shape = (B, V, V) if depths is None else (B, depths, V, V)
    table = torch.randn(*shape, generator=g).mul(2).log_softmax(-1)
    return root, table


def next_logp(table: torch.Tensor, b: int, depth: int, token: int) -> torch.Tensor:
    """float32 [V]: the draft distribution after a node (depth >= 1, token) of request b."""
    return table[b, token] if table.dim() == 3 else table[b, depth - 1, token]


def markov_step(table: torch.Tensor, record: list | None = None):
    """A DraftStep reading ``table``; its state is each node's own token ``[B, k, 1]``."""

    def step(f: Frontier):
        if record is not None:
            record.append(f)
        B = f.tokens.shape[0]
        t = table if table.dim() == 3 else table[:, f.depth - 1]
        logp = t[torch.arange(B)[:, None], f.tokens]  # [B, k, V]
        return logp, f.tokens[..., None].clone()

    return step


def token_path_scores(tree: Tree) -> dict[tuple[int, ...], float]:
    """Root-to-node token path (root excluded) -> cumulative score, drafted nodes only."""
    tok = tree.tokens.tolist()
    return {
        tuple(tok[a] for a in tree.ancestors(i)[1:]): float(tree.scores[i])
        for i in range(1, tree.num_nodes)
    }


def reference_eagle2(root_logp: np.ndarray, table: np.ndarray, depth: int, k: int, n: int):
    """EAGLE-2 as SafeAILab/EAGLE's ``Model.topK_genrate`` (``eagle/model/cnets.py``) grows a
    tree, one request, in plain Python: ``k`` children of each frontier node scored by
    cumulative log-probability, the ``k`` best of them the next frontier, every candidate
    pooled, and the ``n`` best of the pool kept.

    ``table`` is ``[V, V]`` or ``[depths, V, V]`` (see :func:`markov_draft`).

    Returns (kept: {token path: score}, frontiers: per level the set of frontier paths).
    Sums are float32, as in the builder, so scores match bit for bit.
    """

    def topk(row):
        return heapq.nlargest(k, range(len(row)), key=lambda t: row[t])

    pool = [(np.float32(root_logp[t]), (t,)) for t in topk(root_logp)]  # (score, path)
    frontier = list(range(len(pool)))  # pool indices
    frontiers = [{pool[i][1] for i in frontier}]
    for _ in range(depth - 1):
        candidates = []
        for i in frontier:
            score, path = pool[i]
            row = table[path[-1]] if table.ndim == 2 else table[len(path) - 1, path[-1]]
            for t in topk(row):
                pool.append((np.float32(score + row[t]), path + (t,)))
                candidates.append(len(pool) - 1)
        frontier = heapq.nlargest(k, candidates, key=lambda i: pool[i][0])
        frontiers.append({pool[i][1] for i in frontier})
    best = sorted(range(len(pool)), key=lambda i: (-pool[i][0], i))[:n]
    kept = {pool[i][1]: float(pool[i][0]) for i in sorted(best)}
    return kept, frontiers


@st.composite
def dynamic_cases(draw):
    k = draw(st.integers(1, 4))
    depth = draw(st.integers(1, 5))
    pool = k + (depth - 1) * k * k
    n = draw(st.integers(1, pool))
    B = draw(st.integers(1, 3))
    V = draw(st.integers(max(k, 2), 9))
    seed = draw(st.integers(0, 2**31 - 1))
    per_depth = draw(st.booleans())
    return TreeConfig.dynamic(depth, k, n), B, V, seed, per_depth


def assert_invariants(tree: Tree, config: TreeConfig, root_token: int):
    assert tree.num_drafted == config.num_nodes
    assert tree.tokens[0] == root_token and tree.scores[0] == 0
    assert tree.max_depth <= config.depth
    assert (tree.parents[1:] < torch.arange(1, tree.num_nodes)).all()  # parents first
    par = tree.parents[1:]
    assert (tree.scores[1:] <= tree.scores[par]).all()  # scores never increase downwards
    siblings = list(zip(par.tolist(), tree.tokens[1:].tolist()))
    assert len(set(siblings)) == len(siblings)  # distinct sibling tokens


# ---- dynamic (EAGLE-2) ----------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(dynamic_cases())
def test_dynamic_matches_reference(case):
    config, B, V, seed, per_depth = case
    root_logp, table = markov_draft(B, V, seed, config.depth if per_depth else None)
    root_tokens = torch.arange(100, 100 + B)
    trees = build_dynamic_trees(root_tokens, root_logp, markov_step(table), config)
    assert len(trees) == B
    for b, tree in enumerate(trees):
        assert_invariants(tree, config, 100 + b)
        got = token_path_scores(tree)
        want, _ = reference_eagle2(root_logp[b].numpy(), table[b].numpy(), config.depth, config.top_k, config.num_nodes)
        if per_depth:  # generic values: the node set is unique
            assert got.keys() == want.keys()
            assert list(got) == list(want)  # numbered in pool order, as the reference keeps them
            np.testing.assert_allclose([got[p] for p in want], list(want.values()), rtol=1e-6, atol=1e-6)
        else:  # exact ties possible (see the module docstring): the scores still agree
            np.testing.assert_allclose(sorted(got.values()), sorted(want.values()), rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(dynamic_cases())
def test_dynamic_scores_are_path_sums(case):
    config, B, V, seed, per_depth = case
    root_logp, table = markov_draft(B, V, seed, config.depth if per_depth else None)
    trees = build_dynamic_trees(torch.zeros(B, dtype=torch.int64), root_logp, markov_step(table), config)
    for b, tree in enumerate(trees):
        for path, score in token_path_scores(tree).items():
            s = root_logp[b, path[0]] + sum(next_logp(table, b, d, a)[c] for d, (a, c) in enumerate(zip(path, path[1:]), 1))
            assert score == pytest.approx(float(s), abs=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),  # top_k
    st.integers(1, 5),  # depth
    st.integers(1, 3),  # B
    st.sampled_from(["uniform", "few-values", "with-zeros"]),
    st.integers(0, 2**31 - 1),
    st.data(),
)
def test_dynamic_with_exact_ties_stays_a_tree(k, depth, B, kind, seed, data):
    pool = k + (depth - 1) * k * k
    n = data.draw(st.integers(1, pool))
    config = TreeConfig.dynamic(depth, k, n)
    V = max(k, 3)
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        root = torch.full((B, V), -float(np.log(V)))
        table = torch.full((B, V, V), -float(np.log(V)))
    else:
        # Small integers add exactly, so equal sums are true ties; a 0 makes child == parent.
        values = torch.tensor([0.0, -1.0, -2.0] if kind == "with-zeros" else [-1.0, -2.0])
        root = values[torch.randint(len(values), (B, V), generator=g)]
        table = values[torch.randint(len(values), (B, V, V), generator=g)]
    trees = build_dynamic_trees(torch.zeros(B, dtype=torch.int64), root, markov_step(table), config)
    for tree in trees:
        assert_invariants(tree, config, 0)  # a Tree is only built if ancestor-closed


def test_dynamic_full_pool_reaches_config_depth():
    # num_nodes == pool keeps everything: depth levels, k + (depth-1) k^2 nodes.
    root, table = markov_draft(2, 6, seed=3)
    config = TreeConfig.dynamic(depth=3, top_k=2, num_nodes=2 + 2 * 4)
    for tree in build_dynamic_trees(torch.zeros(2, dtype=torch.int64), root, markov_step(table), config):
        assert tree.max_depth == 3
        assert (tree.depth == 1).sum() == 2 and (tree.depth == 2).sum() == 4 and (tree.depth == 3).sum() == 4


def test_dynamic_frontier_ancestors_and_state():
    for seed, (depth, k, n) in enumerate([(5, 3, 20), (4, 2, 10), (6, 4, 40), (2, 1, 2)]):
        B, V = 3, 8
        root_logp, table = markov_draft(B, V, seed, depths=depth)
        record: list[Frontier] = []
        config = TreeConfig.dynamic(depth, k, n)
        root_tokens = torch.tensor([50, 51, 52])
        build_dynamic_trees(root_tokens, root_logp, markov_step(table, record), config, root_tokens[:, None, None])
        assert [f.depth for f in record] == list(range(1, depth))
        for d, f in enumerate(record, start=1):
            assert f.ancestors.dtype == torch.bool and f.ancestors.shape == (B, k, d * k)
            for b in range(B):
                _, ref_frontiers = reference_eagle2(root_logp[b].numpy(), table[b].numpy(), depth, k, n)
                paths = set()
                for j in range(k):
                    cols = torch.nonzero(f.ancestors[b, j]).flatten().tolist()
                    # one node per earlier level, level-major, and the node itself last
                    assert [c // k for c in cols] == list(range(d))
                    assert cols[-1] == (d - 1) * k + j
                    path = tuple(int(record[c // k].tokens[b, c % k]) for c in cols)
                    paths.add(path)
                    # parent_state is the state the step returned for the parent
                    parent_token = path[-2] if d > 1 else int(root_tokens[b])
                    assert int(f.parent_state[b, j, 0]) == parent_token
                assert paths == ref_frontiers[d - 1]


def test_dynamic_rejects_bad_input():
    root, table = markov_draft(1, 3, seed=0)
    with pytest.raises(ValueError, match="top_k=4 exceeds the draft vocabulary"):
        build_dynamic_trees(torch.zeros(1), root, markov_step(table), TreeConfig.dynamic(2, 4, 4))
    with pytest.raises(ValueError, match="needs a dynamic TreeConfig"):
        build_dynamic_trees(torch.zeros(1), root, markov_step(table), TreeConfig.chain(2))


# ---- static ---------------------------------------------------------------------------


STATIC_PRESETS = ["eagle1", "medusa-63", "chain-1", "chain-4", "chain-8"]


@pytest.mark.parametrize("name", STATIC_PRESETS)
def test_static_rank_r_child_is_rth_token(name):
    config = PRESETS[name].config
    shape = config.static_tree()
    B, V = 2, 12
    root_logp, table = markov_draft(B, V, seed=len(name))
    root_tokens = torch.tensor([7, 8])
    trees = build_static_trees(root_tokens, root_logp, markov_step(table), shape)
    ranks = [0] + [p[-1] for p in shape.to_paths()]
    for b, tree in enumerate(trees):
        assert torch.equal(tree.parents, shape.parents)
        tok = tree.tokens.tolist()
        assert tok[0] == int(root_tokens[b])
        for i in range(1, tree.num_nodes):
            p = int(shape.parents[i])
            dist = root_logp[b] if p == 0 else next_logp(table, b, int(shape.depth[p]), tok[p])
            order = torch.argsort(dist, descending=True, stable=True).tolist()
            assert tok[i] == order[ranks[i]]
            assert float(tree.scores[i]) == pytest.approx(float(tree.scores[p] + dist[tok[i]]), abs=1e-5)
    # build_trees dispatches static configs here
    again = build_trees(root_tokens, root_logp, markov_step(table), config)
    assert all(a == b for a, b in zip(again, trees))


def test_static_chain_is_greedy_markov_walk():
    root_logp, table = markov_draft(1, 6, seed=11)
    (tree,) = build_static_trees(torch.tensor([0]), root_logp, markov_step(table), Tree.chain(5))
    walk = [int(root_logp[0].argmax())]
    for _ in range(4):
        walk.append(int(table[0, walk[-1]].argmax()))
    assert tree.tokens.tolist()[1:] == walk


@pytest.mark.parametrize("name", ["eagle1", "medusa-63", "chain-3"])
def test_static_frontier_ancestors_and_state(name):
    shape = PRESETS[name].config.static_tree()
    B, V = 2, 12
    root_logp, table = markov_draft(B, V, seed=5)
    root_tokens = torch.tensor([90, 91])
    record: list[Frontier] = []
    (t0, t1) = build_static_trees(root_tokens, root_logp, markov_step(table, record), shape, root_tokens[:, None, None])
    final = [t0, t1]
    assert [f.depth for f in record] == list(range(1, shape.max_depth))
    processed: list[int] = []  # node indices seen by the step so far, in column order
    for f in record:
        nodes = torch.nonzero(shape.depth == f.depth).flatten().tolist()
        processed += nodes
        assert f.ancestors.shape == (B, len(nodes), len(processed))
        for j, node in enumerate(nodes):
            expected = {processed.index(a) for a in shape.ancestors(node)[1:]}
            for b in range(B):
                assert set(torch.nonzero(f.ancestors[b, j]).flatten().tolist()) == expected
                assert int(f.tokens[b, j]) == int(final[b].tokens[node])
                parent = int(shape.parents[node])
                assert int(f.parent_state[b, j, 0]) == int(final[b].tokens[parent])


def test_static_rejects_shape_not_level_by_level():
    root, table = markov_draft(1, 4, seed=0)
    with pytest.raises(ValueError, match="level by level"):
        build_static_trees(torch.zeros(1), root, markov_step(table), Tree([-1, 0, 1, 0]))
