"""Growing draft trees from a drafter's log-probabilities, independent of any model.

The drafter supplies a *step*: given the current frontier (a few nodes per request, all at
one depth), it returns their children's log-probabilities. Two growers use it:

* :func:`build_dynamic_trees`, EAGLE-2 as its reference grows a tree (SafeAILab/EAGLE,
  ``eagle/model/cnets.py``, ``Model.topK_genrate``): expand ``top_k`` children of each frontier
  node, keep the ``top_k`` best by cumulative score as the next frontier, pool every
  candidate, and finally keep the ``num_nodes`` best of the pool;
* :func:`build_static_trees`: a fixed shape whose rank-r child of a node is the node's
  r-th most probable next token.

Letters: B requests, k frontier width, V vocabulary, P nodes processed by the step so far
(frontiers of earlier levels, level-major, then this frontier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .config import TreeConfig
from .tree import Tree

__all__ = ["Frontier", "DraftStep", "StopRule", "Constrain", "build_dynamic_trees", "build_static_trees",
           "build_trees", "dynamic_pool", "best_of_pool", "trees_of"]


@dataclass
class Frontier:
    """The nodes a draft step expands.

    Attributes:
        tokens:       int64 ``[B, k]``, the frontier's tokens.
        depth:        their depth (1 = children of the root).
        ancestors:    bool ``[B, k, P]``: which processed nodes (earlier frontiers and this
                      one, level-major) each frontier node sees: its ancestors and itself.
                      The step's tree mask over its own draft KV.
        parent_state: the state the step returned for each node's parent, gathered to
                      ``[B, k, ...]`` (the caller's ``root_state`` at depth 1), or None.
    """

    tokens: torch.Tensor
    depth: int
    ancestors: torch.Tensor
    parent_state: Any = None


# A draft step: frontier -> (log-probs [B, k, V] of each node's next token, per-node state).
DraftStep = Callable[[Frontier], "tuple[torch.Tensor, Any]"]

# Asked after each level whether to stop growing: (depth, frontier scores [B, k], every pool
# candidate's score so far [B, P]) -> True ends expansion (treespec.auto's early stop).
StopRule = Callable[[int, torch.Tensor, torch.Tensor], bool]

# Applied to the draft's log-probabilities before each top-k: (depth, the frontier's paths,
# int64 [B, k, depth] in the drafter's ids, root excluded; log-probs [B, k, V]) -> log-probs with
# what each node's request forbids after its path at -inf (treespec.constraints). At the root,
# depth 0, paths [B, 1, 0] and log-probs [B, 1, V].
Constrain = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def _constrained_root(constrain: Constrain | None, root_logprobs: torch.Tensor) -> torch.Tensor:
    if constrain is None:
        return root_logprobs
    B = root_logprobs.shape[0]
    empty = torch.empty(B, 1, 0, dtype=torch.int64, device=root_logprobs.device)
    return constrain(0, empty, root_logprobs[:, None])[:, 0]


def _gather_state(state, index: torch.Tensor):
    """Pick ``state[b, index[b, j]]`` for a tensor state ``[B, k_prev, ...]``."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        idx = index.to(state.device).reshape(*index.shape, *([1] * (state.dim() - 2)))
        return state.gather(1, idx.expand(*index.shape, *state.shape[2:]))
    if isinstance(state, (tuple, list)):
        return type(state)(_gather_state(s, index) for s in state)
    raise TypeError(f"draft state must be a tensor or a tuple of tensors, got {type(state).__name__}")


def _check_vocab(logp: torch.Tensor, k: int):
    if logp.shape[-1] < k:
        raise ValueError(f"top_k={k} exceeds the draft vocabulary ({logp.shape[-1]} tokens)")


def build_dynamic_trees(
    root_tokens: torch.Tensor,
    root_logprobs: torch.Tensor,
    step: DraftStep,
    config: TreeConfig,
    root_state=None,
    stop: StopRule | None = None,
    constrain: Constrain | None = None,
) -> list[Tree]:
    """EAGLE-2 dynamic trees for a batch.

    Args:
        root_tokens:   int64 ``[B]``, each request's root token.
        root_logprobs: float ``[B, V]``, the draft's log-probabilities after the root.
        step:          the drafter's :data:`DraftStep`.
        config:        a dynamic :class:`TreeConfig`.
        root_state:    per-request state ``[B, 1, ...]`` handed to depth-1 nodes.
        stop:          called after each level but the last (see :data:`StopRule`); True
                       ends expansion, and the trees keep ``min(num_nodes, pool so far)``.
        constrain:     masks what the requests forbid before each top-k, or None.
    Returns:
        B trees with ``num_nodes`` drafted nodes each (fewer after an early stop), tokens and cumulative scores; nodes in
        pool order, so parents precede children.
    """
    pool = dynamic_pool(root_logprobs, step, config, root_state, stop, constrain)
    parents, tokens, scores = best_of_pool(*pool, config.num_nodes)
    if (parents < 0).any():
        raise AssertionError("dynamic tree is not ancestor-closed (non-finite draft scores?)")
    return trees_of(root_tokens, parents, tokens, scores)


def dynamic_pool(
    root_logprobs: torch.Tensor,
    step: DraftStep,
    config: TreeConfig,
    root_state=None,
    stop: StopRule | None = None,
    constrain: Constrain | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every candidate of an EAGLE-2 expansion (:func:`build_dynamic_trees`' arguments):
    ``(scores float [B, P], tokens int64 [B, P], parents int64 [B, P])``, a node's parent its
    pool index (-1: the root). Without ``stop`` and ``constrain`` it reads nothing back from the
    device and its shapes are fixed by ``config``: what the draft graph of
    :mod:`treespec.drafters.draft_graph` runs whole."""
    # long: one EAGLE-2 expansion, level by level; the frontier's tensors (scores, tokens, pool
    # indices, state, ancestors, paths) and the pool change together at every level
    if config.kind != "dynamic":
        raise ValueError("build_dynamic_trees needs a dynamic TreeConfig")
    k, device = config.top_k, root_logprobs.device
    _check_vocab(root_logprobs, k)
    B = root_logprobs.shape[0]
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
    arange_b = torch.arange(B, device=device)[:, None]

    score, token = _constrained_root(constrain, root_logprobs.float()).topk(k, dim=-1)  # [B, k]
    path = token[:, :, None]  # [B, k, depth]: the frontier's paths (with constrain)
    pool_scores, pool_tokens = [score], [token]
    pool_parents = [torch.full((B, k), -1, dtype=torch.int64, device=device)]  # -1 = root
    front_pool = torch.arange(k, device=device).expand(B, k)  # pool index of frontier nodes
    state = _gather_state(root_state, torch.zeros(B, k, dtype=torch.int64, device=device))
    anc = eye  # [B, k, P]
    offset = k
    for depth in range(1, config.depth):
        if stop is not None and stop(depth, score, torch.cat(pool_scores, 1)):
            break
        logp, out_state = step(Frontier(token, depth, anc, state))
        _check_vocab(logp, k)
        if constrain is not None:
            logp = constrain(depth, path, logp.float())
        lp, tok = logp.float().topk(k, dim=-1)  # [B, k, k]
        cu = (score[:, :, None] + lp).flatten(1)  # [B, k*k], cumulative log-prob
        pool_scores.append(cu)
        pool_tokens.append(tok.flatten(1))
        pool_parents.append(front_pool[:, :, None].expand(B, k, k).flatten(1))
        score, sel = cu.topk(k, dim=-1)  # the next frontier
        parent_slot = sel // k
        token = tok.flatten(1).gather(1, sel)
        front_pool = offset + sel
        state = _gather_state(out_state, parent_slot)
        anc = torch.cat([anc[arange_b, parent_slot], eye], dim=-1)
        if constrain is not None:
            path = torch.cat([path[arange_b, parent_slot], token[:, :, None]], dim=-1)
        offset += k * k
    return torch.cat(pool_scores, 1), torch.cat(pool_tokens, 1), torch.cat(pool_parents, 1)


def best_of_pool(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                 num_nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each request's ``num_nodes`` best-scored pool nodes (all, if the pool is smaller), in
    pool order: ``(parents, tokens, scores)`` ``[B, n]``, a parent its node index (0: the root,
    nodes numbered from 1); a parent left out of the kept nodes (only with non-finite scores)
    shows as -1. Fixed shapes, no read back.

    Args:
        scores:  float ``[B, P]``: each pool node's cumulative log-probability.
        tokens:  int64 ``[B, P]``.
        parents: int64 ``[B, P]``: each node's parent's pool index (-1: the root).
    """
    B, device = scores.shape[0], scores.device
    # A child's score never exceeds its parent's (log-probs are <= 0) and its pool index is
    # larger, so a stable descending sort ranks every parent before its children, ties
    # included: the top num_nodes are ancestor-closed.
    n_keep = min(num_nodes, scores.shape[1])
    order = scores.sort(dim=1, descending=True, stable=True).indices[:, :n_keep]
    keep = order.sort(dim=1).values  # pool order: parents first
    node_of = torch.full_like(scores, -1, dtype=torch.int64)  # pool index -> node index
    node_of.scatter_(1, keep, torch.arange(1, n_keep + 1, device=device).expand(B, -1))
    kept_parents = parents.gather(1, keep)
    node_parents = torch.where(kept_parents < 0, 0, node_of.gather(1, kept_parents.clamp(min=0)))
    return node_parents, tokens.gather(1, keep), scores.gather(1, keep)


def trees_of(root_tokens: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor,
             scores: torch.Tensor) -> list[Tree]:
    """The trees of :func:`best_of_pool`'s nodes under each request's root token (``[B]``)."""
    trees = []
    root_tokens = torch.as_tensor(root_tokens).reshape(-1).cpu()
    for b in range(parents.shape[0]):
        trees.append(
            Tree(
                torch.cat([torch.tensor([-1]), parents[b].cpu()]),
                torch.cat([root_tokens[b : b + 1], tokens[b].cpu()]),
                torch.cat([torch.zeros(1), scores[b].cpu()]),
            )
        )
    return trees


def build_static_trees(
    root_tokens: torch.Tensor,
    root_logprobs: torch.Tensor,
    step: DraftStep,
    shape: Tree,
    root_state=None,
    constrain: Constrain | None = None,
) -> list[Tree]:
    """Fill a fixed shape: a node's rank-r child carries its r-th most probable token
    (its r-th most probable allowed token with ``constrain``).

    ``shape`` must be numbered level by level (as :meth:`Tree.from_paths` does) so that the
    processed nodes of each step form a prefix of the node order.
    """
    device = root_logprobs.device
    B = root_logprobs.shape[0]
    n = shape.num_nodes
    depth, parents = shape.depth.to(device), shape.parents.to(device)
    if n > 1 and (depth[1:].diff() < 0).any():
        raise ValueError("static tree shape must be numbered level by level")
    rank = torch.tensor(_child_ranks(shape), dtype=torch.int64, device=device)  # [n]: rank among siblings
    full_anc = shape.attention_mask().to(device)

    tokens = torch.zeros(B, n, dtype=torch.int64, device=device)
    scores = torch.zeros(B, n, device=device)
    tokens[:, 0] = torch.as_tensor(root_tokens, device=device).reshape(-1)
    logp_of = {0: _constrained_root(constrain, root_logprobs.float())}  # level -> [B, w, V] (root: [B, V])
    level_nodes = {0: torch.tensor([0], device=device)}
    state_of_level = None
    for d in range(1, shape.max_depth + 1):
        nodes = torch.nonzero(depth == d).flatten()
        par = parents[nodes]
        prev = level_nodes[d - 1]
        slot = torch.searchsorted(prev, par)  # parent's index within its level
        lp = logp_of[d - 1]
        if d == 1:
            lp = lp[:, None, :]
        k = int(rank[nodes].max()) + 1
        _check_vocab(lp, k)
        top_lp, top_tok = lp.topk(k, dim=-1)  # [B, w_prev, k]
        tokens[:, nodes] = top_tok[:, slot, rank[nodes]]
        scores[:, nodes] = scores[:, par] + top_lp[:, slot, rank[nodes]]
        level_nodes[d] = nodes
        if d == shape.max_depth:
            break
        if d == 1:
            parent_state = _gather_state(root_state, torch.zeros(B, nodes.numel(), dtype=torch.int64, device=device))
        else:
            parent_state = _gather_state(state_of_level, slot.expand(B, -1))
        processed = int(nodes.max())  # nodes 1..processed, level-major
        anc = full_anc[nodes][:, 1 : processed + 1].expand(B, -1, -1)
        logp_of[d], state_of_level = step(Frontier(tokens[:, nodes], d, anc, parent_state))
        if constrain is not None:  # each node's path: its ancestors, level by level, root dropped
            path_idx = torch.nonzero(full_anc[nodes][:, 1:])[:, 1].view(nodes.numel(), d) + 1
            logp_of[d] = constrain(d, tokens[:, path_idx], logp_of[d].float())

    return [Tree(shape.parents, tokens[b].cpu(), scores[b].cpu()) for b in range(B)]


def _child_ranks(shape: Tree) -> list[int]:
    seen: dict[int, int] = {}
    ranks = [0]
    for p in shape.parents.tolist()[1:]:
        ranks.append(seen.get(p, 0))
        seen[p] = ranks[-1] + 1
    return ranks


def build_trees(root_tokens, root_logprobs, step: DraftStep, config: TreeConfig, root_state=None,
                stop: StopRule | None = None, constrain: Constrain | None = None) -> list[Tree]:
    """Dispatch on ``config.kind``; ``stop`` applies to dynamic trees (a static shape is fixed)."""
    if config.kind == "dynamic":
        return build_dynamic_trees(root_tokens, root_logprobs, step, config, root_state, stop, constrain)
    return build_static_trees(root_tokens, root_logprobs, step, config.static_tree(), root_state, constrain)
