"""Recursive rejection sampling over a tree: the reference rule the engine's acceptance is
compared with (tests/unit/test_verify.py, tests/unit/test_processing.py).

The engine accepts a child exactly when it is the target's own Gumbel-max sample at its parent
(``treespec.accept``); for drafts with a known distribution of their own, the lossless rule is
SpecInfer's / EAGLE's rejection sampling, kept here. Under deterministic drafts both rules
accept each node's children with the same probability, which the tests check; this module is
also the statistical tests' exact reference for "the committed tokens follow the target".

Letters: B requests, n nodes (root included), V vocabulary.
"""

from __future__ import annotations

import torch

from treespec import Tree
from treespec.accept import Verdict, pad_trees

__all__ = ["verify_sampling"]


def _sample_inverse_cdf(r: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample from unnormalised rows ``r`` ``[B, V]`` with uniforms ``u`` ``[B]``."""
    cdf = r.cumsum(-1)
    x = (u * cdf[:, -1])[:, None]
    # First index whose cdf exceeds x: zero-probability tokens can never be picked.
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
    return idx.clamp_(max=r.shape[-1] - 1)


def _children(trees: list[Tree], n: int, C: int, device) -> torch.Tensor:
    """int64 ``[B, n, C]``: ``[b, i, c]`` is the node index of node i's c-th child (-1: none)."""
    children = torch.full((len(trees), n, C), -1, dtype=torch.int64, device=device)
    for b, t in enumerate(trees):
        seen: dict[int, int] = {}
        for i, p in enumerate(t.parents.tolist()[1:], start=1):
            c = seen.get(p, 0)
            if c >= C:
                raise ValueError(f"uniforms allow {C} children per node, tree has more")
            children[b, p, c] = i
            seen[p] = c + 1
    return children


def _residual_(r: torch.Tensor, q: torch.Tensor, rej: torch.Tensor, x: torch.Tensor) -> None:
    """In place, for the rows ``rej`` (bool ``[B]``) whose sampled draft ``x`` (int64 ``[B]``)
    was rejected: ``r <- max(r - q, 0)`` and ``q[x] <- 0``, both renormalised (float ``[B, V]``)."""
    rn = r[rej] / r[rej].sum(-1, keepdim=True)
    qn = q[rej] / q[rej].sum(-1, keepdim=True)
    resid = (rn - qn).clamp_(min=0)
    # Numerically r <= q everywhere: fall back to r itself.
    empty = resid.sum(-1, keepdim=True) <= 0
    r[rej] = torch.where(empty, rn, resid)
    qr = q[rej]
    qr[torch.arange(qr.shape[0], device=r.device), x[rej]] = 0
    q[rej] = qr


def _refuse_undrawable(impossible: torch.Tensor, x: torch.Tensor) -> None:
    """ValueError where a tested child (bool ``[B]``) has draft probability 0: q could not have
    drawn it, and the rule's ratio r/q is undefined there."""
    if impossible.any():
        b = int(torch.nonzero(impossible)[0])
        raise ValueError(f"tree {b}: a child's token {int(x[b])} has draft probability 0 at its parent (after its "
                         "rejected siblings' removal): draft_probs must be the distribution the children were "
                         "sampled from, without replacement")


def verify_sampling(
    trees: list[Tree],
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> list[Verdict]:
    """Lossless recursive rejection sampling over each tree.

    From the root: let ``r`` be the processed target distribution at the current node.
    Try its children in node order. With deterministic drafts (``draft_probs`` None: the
    children are the drafter's top-k, so their draft probability is taken as 1) accept child
    x with probability ``r[x] / sum(r)``, else set ``r[x] = 0`` and try the next. With drafts
    sampled *without replacement* from a known ``q`` at the node, accept with
    ``min(1, r[x] / q[x])``, else ``r <- max(r - q, 0)`` and ``q[x] <- 0`` (both renormalised).
    An accepted child becomes the current node; when every child is rejected (or at a
    leaf) the bonus is sampled from ``r``. Either way the committed token at each position
    is distributed exactly as the target's processed distribution (docs/runtime.md).

    Args:
        trees:        B trees with tokens (siblings distinct).
        target_probs: float ``[B, n_max, V]``: processed target distribution at each node.
        uniforms:     float ``[B, D+1, C+1]`` in [0, 1): ``D >= max depth``, ``C >= most
                      children of any node``. Entry ``[b, d, c]`` decides child ``c`` at
                      depth ``d``; entry ``[b, d, C]`` samples the bonus. Drawing them per
                      request from its own generator keeps requests independent.
        draft_probs:  float ``[B, n_max, V]`` or None: the distribution each node's children
                      were sampled from (a child it gives probability 0: ValueError).
    """
    device = target_probs.device
    pt = pad_trees(trees, device)
    B, n = pt.tokens.shape
    C = uniforms.shape[2] - 1
    arange_b = torch.arange(B, device=device)
    children = _children(trees, n, C, device)
    if uniforms.shape[1] <= int(pt.depth.max()):
        raise ValueError("uniforms must cover every depth of every tree")

    node = torch.zeros(B, dtype=torch.int64, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    paths = [[0] for _ in range(B)]
    toks: list[list[int]] = [[] for _ in range(B)]
    for d in range(uniforms.shape[1]):
        r = target_probs[arange_b, node].clone()  # [B, V]
        q = None if draft_probs is None else draft_probs[arange_b, node].clone()
        chosen = torch.full((B,), -1, dtype=torch.int64, device=device)
        for c in range(C):
            child = children[arange_b, node, c]
            test = alive & (chosen < 0) & (child >= 0)
            if not test.any():
                break
            x = pt.tokens[arange_b, child.clamp(min=0)]
            rx = r[arange_b, x]
            u = uniforms[:, d, c]
            if q is None:
                # P(u < r[x]/sum r) = r[x]/sum r; a zero-probability token is never taken.
                acc = test & (u * r.sum(-1) < rx)
                rej = test & ~acc
                r[rej, x[rej]] = 0
            else:
                _refuse_undrawable(test & ~(q[arange_b, x] > 0), x)
                qx = q[arange_b, x] / q.sum(-1)
                acc = test & (u * qx * r.sum(-1) < rx)  # u < min(1, r/q)
                rej = test & ~acc
                if rej.any():
                    _residual_(r, q, rej, x)
            chosen = torch.where(acc, child, chosen)
        stop = alive & (chosen < 0)
        if stop.any():
            bonus = _sample_inverse_cdf(r[stop], uniforms[stop, d, C])
            for b, tok in zip(torch.nonzero(stop).flatten().tolist(), bonus.tolist()):
                toks[b].append(tok)
        go = alive & (chosen >= 0)
        for b in torch.nonzero(go).flatten().tolist():
            paths[b].append(int(chosen[b]))
            toks[b].append(int(pt.tokens[b, chosen[b]]))
        node = torch.where(go, chosen, node)
        alive = go
        if not alive.any():
            break
    return [Verdict(p, t) for p, t in zip(paths, toks)]
