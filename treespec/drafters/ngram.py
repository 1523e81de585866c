"""Prompt lookup, extended to trees.

The newest tokens (an n-gram ending at the root) are looked up in everything the request
has seen so far, prompt and output. Each earlier occurrence proposes the tokens that
followed it; with several occurrences the continuations branch where they differ and
share their common prefixes, forming a trie under the root. Nodes are ranked by how many
continuations pass through them (then by recency), and the best ``num_nodes`` are kept:
a node never has more support than its parent, so the kept set is ancestor-closed.
A node's score is the log of the share of continuations through it, plus
``log(depth_decay)`` per level, so a child always scores below its parent; ``auto`` trees
calibrate it into an acceptance probability like a draft's log-probability. The decay makes
depths distinguishable: without it every node of a lone match would score 0, and the
calibration could not learn that its first token holds more often than its sixth.

As in vLLM's ngram proposer and transformers' ``prompt_lookup_num_tokens``, the longest
n-gram (``max_ngram`` down to ``min_ngram``) that occurs at all wins. No model, no
training: strong on code editing, extraction and summarisation, where output copies input.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from ..tree import Tree
from .base import DraftSession, DraftStart, Drafter

__all__ = ["NgramDrafter"]


class NgramDrafter(Drafter):
    """Args:
        max_ngram, min_ngram: n-gram lengths tried, longest first.
        max_matches: most recent occurrences used as branches.
        depth, num_nodes: per-step tree limits; None takes them from the tree config.
        depth_decay: per-level factor in a node's score (see the module docstring).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 8,
                 depth: int | None = None, num_nodes: int | None = None, depth_decay: float = 0.9):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        if not 0 < depth_decay <= 1:
            raise ValueError(f"depth_decay must be in (0, 1], got {depth_decay}")
        self.depth_decay = depth_decay
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches
        self.depth, self.num_nodes = depth, num_nodes

    def start(self, model, ctx: DraftStart) -> "NgramSession":
        depth = self.depth or ctx.tree_cfg.depth
        nodes = self.num_nodes or ctx.tree_cfg.num_nodes
        return NgramSession(self, [list(p) + [t] for p, t in zip(ctx.prompts, ctx.first_tokens)], depth, nodes)

    def __repr__(self):
        return f"NgramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, max_matches={self.max_matches})"


def continuations(context: np.ndarray, max_ngram: int, min_ngram: int, max_matches: int, depth: int):
    """Token runs that followed earlier occurrences of the context's final n-gram,
    most recent first (``context[-1]`` is the root)."""
    n_ctx = context.size
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        pattern = context[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        if starts.size == 0:
            continue
        out = []
        for s in starts[::-1][:max_matches]:
            run = context[s + n : s + n + depth]
            if run.size:
                out.append(run.tolist())
        if out:
            return out
    return []


def trie_tree(root: int, runs: Sequence[Sequence[int]], num_nodes: int, depth_decay: float = 1.0) -> Tree:
    """The trie of ``runs`` under ``root``, cut to the ``num_nodes`` best-supported nodes;
    scores: log of the share of runs through each node plus ``log(depth_decay)`` per level
    (root 0)."""
    children: list[dict[int, int]] = [{}]
    parent, token, support, first_seen, depth = [-1], [root], [0], [0], [0]
    for r, run in enumerate(runs):
        node = 0
        for tok in run:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(parent)
                children[node][tok] = nxt
                children.append({})
                parent.append(node)
                token.append(tok)
                depth.append(depth[node] + 1)
                support.append(0)
                first_seen.append(r)
            support[nxt] += 1
            node = nxt
    # More support first, then earlier (more recent) runs, then shallower; parents always
    # rank before their children since support never grows and they appear first.
    order = sorted(range(1, len(parent)), key=lambda i: (-support[i], first_seen[i], i))[:num_nodes]
    kept = sorted(order)  # creation order: parents first
    index = {0: 0, **{old: new for new, old in enumerate(kept, start=1)}}
    decay = math.log(depth_decay)
    share = [0.0] + [math.log(support[i] / len(runs)) + decay * depth[i] for i in kept]
    return Tree([-1] + [index[parent[i]] for i in kept], [root] + [token[i] for i in kept], share)


class NgramSession(DraftSession):
    def __init__(self, drafter: NgramDrafter, contexts: list[list[int]], depth: int, num_nodes: int):
        self.d = drafter
        self.contexts = contexts
        self.depth, self.num_nodes = depth, num_nodes

    def propose(self, requests, roots, max_depth):
        trees = []
        for r, root, md in zip(requests, roots, max_depth):
            ctx = self.contexts[r]
            assert ctx[-1] == root, "ngram context out of sync with the engine"
            depth = min(self.depth, md)
            runs = []
            if depth > 0:
                runs = continuations(np.asarray(ctx), self.d.max_ngram, self.d.min_ngram,
                                     self.d.max_matches, depth)
            trees.append(trie_tree(root, runs, self.num_nodes, self.d.depth_decay))
        return trees

    def commit(self, requests, tokens, features):
        for r, toks in zip(requests, tokens):
            self.contexts[r].extend(toks)
