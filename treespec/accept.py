"""The acceptance rule: which drafted nodes a request keeps, decided by the target's own
choice at each node.

Glossary:
    root      node 0, the newest committed token; the target's choice at the root is the
              first new token.
    node      a drafted token; the target's choice at a node (from the logits there) is the
              token after it.
    choice    the target's token after a node: the argmax of its processed logits (greedy), or
              the argmax of those plus the Gumbel noise of its position (sampling: a sample).
    path      root-to-node chain of nodes.
    accepted  drafted nodes on the chosen path: each one carries its parent's choice.
    bonus     the choice at the last accepted node. It is committed but its KV is not: it
              becomes the next step's root.

The rule (:func:`accept`): a child is accepted exactly when its token is its parent's choice;
the request commits the longest accepted path's tokens, then the bonus. Per step that is
``len(accepted) + 1`` tokens, at least one, so speculation never slows the token rate per
forward below plain decoding. One rule serves greedy and sampled requests alike:

**Gumbel-max sampling.** The target's token at absolute position ``t`` of request ``r`` is
``argmax(scores + g)`` with ``g`` standard Gumbel noise drawn from a generator seeded by
``(seed_r, t)``: an exact sample of ``softmax(scores)`` (the Gumbel-max trick), and, since the
noise at ``t`` is independent of everything before it, the tokens follow the target's
autoregressive distribution exactly. The noise depends on the position only, not on the tree,
the drafter, the batch or how many tokens a step accepts, so a seed fixes the output whatever
drafts are made (on one machine, dtype and thread count: ties of the rounding aside). The
probability of accepting a node's children is the sum of their target probabilities, as with
recursive rejection sampling against deterministic drafts, so acceptance is unchanged
(``tests/helpers/rejection_sampling.py`` keeps that rule, the reference the tests compare with).

Each node's choice is :class:`RequestDecoding`'s: the request's processors, run with the node's
own history (:class:`treespec.processing.NodeProcessor`), then its seed's noise.

Letters: B requests, n nodes (root included), L committed tokens, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .processing import NodeProcessor
from .tree import Tree

__all__ = ["Verdict", "accept", "accept_fixed", "first_argmax", "verdicts_of", "target_choices", "RequestDecoding",
           "gumbel_noise", "PaddedTrees", "pad_trees"]


@dataclass(frozen=True)
class Verdict:
    """What one request commits this step.

    Attributes:
        path:   node indices of the accepted path, root first (``len = accepted + 1``).
        tokens: the committed tokens: the accepted drafted tokens, then the bonus.
    """

    path: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def accept(trees: list[Tree], choices: torch.Tensor) -> list[Verdict]:
    """Each tree's longest path whose every token is its parent's choice, and its bonus.

    Args:
        trees:   B trees with tokens.
        choices: int64 ``[B, n_max]``, the target's choice at each node (padding, and any
                 value at a node whose parent was not reached, ignored).
    """
    pt = pad_trees(trees, choices.device)
    correct = pt.tokens == choices.gather(1, pt.parents)  # a node carries its parent's choice
    correct[:, 0] = True
    # A node is reachable if it and all its ancestors match: no False under its mask row.
    ok = ~(pt.mask & ~correct[:, None, :]).any(-1) & pt.valid
    # Siblings carry distinct tokens, so at most one node per depth is reachable.
    best = torch.where(ok, pt.depth, -1).argmax(dim=1)  # [B]
    rows = torch.arange(len(trees), device=best.device)
    paths = pt.mask[rows, best].tolist()  # [B, n_max]: each best node's ancestors and itself
    bonus = choices[rows, best].tolist()  # [B]: the target's own token after each path
    out = []
    for b, (on, t) in enumerate(zip(paths, bonus)):
        path = [j for j, x in enumerate(on) if x]
        toks = pt.tokens[b, path[1:]].tolist() + [t]
        out.append(Verdict(path, toks))
    return out


def first_argmax(x: torch.Tensor, block: int = 1024, two_stage: bool | None = None) -> torch.Tensor:
    """int64 ``[...]``: the index of each last-dim row's first maximum, as ``x.argmax(-1)`` (of
    ``x`` widened to fp32 if narrower, the order HF generate takes). Compiled, in two reductions: each
    block's maximum, then the first block holding the row's maximum and the first maximum
    inside it (rows padded with -inf to whole blocks). The same index (a NaN counts as the
    maximum in both), but several times faster than inductor's one-pass argmax on a CPU: 0.06
    against 0.40 ms for ``[16, 49152]`` bf16 logits on the 2-core Xeon, where eagerly the two
    reductions cost 1.9 ms and ATen's argmax 0.6 (``benchmarks/micro/accept_on_device.py``).
    ``two_stage``: the two reductions or ATen's argmax (None: the two where compiled)."""
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()  # widened: never narrowed
    if not (torch.compiler.is_compiling() if two_stage is None else two_stage):
        return x.argmax(-1)
    V = x.shape[-1]
    blocks = -(-V // block)
    y = F.pad(x, (0, blocks * block - V), value=-math.inf).unflatten(-1, (blocks, block))
    first = y.amax(-1).argmax(-1)  # [...]: the first block holding the maximum
    inside = y.gather(-2, first[..., None, None].expand(*first.shape, 1, block)).squeeze(-2).argmax(-1)
    return first * block + inside


def accept_fixed(choices: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                 reach: torch.Tensor) -> torch.Tensor:
    """:func:`accept`'s rule on a fixed-shape bucket's tensors (``treespec/fixed_shape.py``),
    with no read back and no shape that depends on the data: what a compiled or captured verify
    runs after its forward.

    Args:
        choices: int64 ``[R, N]``, the target's choice at every token of each row's bucket.
        tokens:  int64 ``[R, N]``, the bucket's tokens (a row's tree first, then padding).
        parents: int64 ``[R, N]``, each token's parent in its row; -1: the root, or padding.
        reach:   bool ``[R, N, N]``, token j is token i or one of its ancestors
                 (:func:`~treespec.fixed_shape.ancestor_masks`).
    Returns:
        int64 ``[R, 1 + 2N]``, per row: the accepted count ``a``, then the path (its ``a + 1``
        node indices, root first; then ``a + 1, a + 2, ...``, what a compaction leaves where it
        is), then the committed tokens (the ``a`` accepted ones and the bonus; then -1). A row
        of padding alone accepts nothing and commits its root's choice.
    """
    R, N = tokens.shape
    idx = torch.arange(N, device=tokens.device)
    correct = (tokens == choices.gather(1, parents.clamp(min=0))) & (parents >= 0) | (idx == 0)
    ok = ~(reach & ~correct[:, None, :]).any(-1)  # every ancestor (and itself) carries its parent's choice
    depth = reach.sum(-1) - 1
    best = torch.where(ok, depth, -1).argmax(1)  # at most one reachable node per depth (distinct siblings)
    on = reach.gather(1, best[:, None, None].expand(R, 1, N))[:, 0]  # [R, N]: the path's nodes
    count = on.sum(1) - 1
    # Parents precede children: the path's nodes in index order are root first; the rest after.
    order = torch.where(on, idx, N + idx).sort(1).values % N
    steps = idx[None] <= count[:, None]
    path = torch.where(steps, order, idx)
    committed = torch.where(steps, choices.gather(1, order), -1)  # an accepted node's choice is its child's token
    return torch.cat([count[:, None], path, committed], 1)


def verdicts_of(packed: list[list[int]], rows: Sequence[int]) -> list[Verdict]:
    """The verdicts of rows ``rows`` from :func:`accept_fixed`'s output read back (``tolist``)."""
    out = []
    for r in rows:
        a, N = packed[r][0], (len(packed[r]) - 1) // 2
        out.append(Verdict(packed[r][1: a + 2], packed[r][1 + N: a + 2 + N]))
    return out


def target_choices(trees: list[Tree], logits: list[torch.Tensor], decodings: Sequence["RequestDecoding"],
                   histories: Sequence[Sequence[int]], keep_scores: bool = False):
    """The target's choice at the nodes of each request's tree, for :func:`accept`.

    Args:
        trees:       one per request, ``n_b`` nodes.
        logits:      float ``[n_b, V]`` per request: the target's logits at each node of its tree.
        decodings:   each request's processors and seed.
        histories:   each request's committed tokens, the tree's root last.
        keep_scores: also return each request's processed logits at every node (``[n_b, V]``).
    Returns:
        int64 ``[B, n_max]`` choices (at least at the nodes verification reaches), and the
        processed logits (None without ``keep_scores``).
    """
    n = max(t.num_nodes for t in trees)
    choices = torch.zeros(len(trees), n, dtype=torch.int64, device=logits[0].device)
    kept = [] if keep_scores else None
    for i, (t, l, d, h) in enumerate(zip(trees, logits, decodings, histories)):
        # Processing costs per node, and on a CPU so does a plain argmax: the path's alone. (On
        # a GPU one argmax over the tree is cheaper than a host sync per node of the path.)
        if kept is None and (d.processor or not d.greedy or l.device.type == "cpu"):
            choices[i, : l.shape[0]] = d.choose_reached_nodes(h, l, t)
            continue
        scores = d.processed_scores(h, l, t)
        choices[i, : l.shape[0]] = d.choose_from_scores(scores, len(h), t)
        if kept is not None:
            kept.append(scores)
    return choices, kept


@dataclass
class RequestDecoding:
    """How one request turns the target's logits into tokens: its processors, and, when it
    samples, the seed of its Gumbel noise.

    Attributes:
        processor: the request's processors (warpers included when it samples).
        seed:      None: greedy (the argmax of the processed logits); else the seed of the
                   noise that makes each position's choice a sample.
        stop:      None, or a callable ``(input_ids [1, L], scores) -> bool [1]`` that says the
                   sequence ends here (transformers' stopping criteria: stop strings,
                   ``max_time``, the user's own), asked with ``scores`` None.
    """

    processor: NodeProcessor
    seed: int | None = None
    stop: Callable | None = None  # a StoppingCriteriaList

    @property
    def greedy(self) -> bool:
        return self.seed is None

    def stops(self, sequence: list[int]) -> bool:
        """Whether the request ends after ``sequence`` (prompt and output so far), as
        ``generate``'s stopping criteria decide after its last token (a stop string across
        token boundaries, for one)."""
        return self.stop is not None and bool(self.stop(torch.tensor([sequence]), None)[0])

    def choose_all_nodes(self, history: Sequence[int], logits: torch.Tensor,
                         tree: Tree | None = None) -> torch.Tensor:
        """int64 ``[n]``: the target's token after each node (after the history alone when
        ``tree`` is None, ``logits`` then ``[1, V]``): its argmax, or its sample at that position.

        Args:
            history: the committed tokens (the tree's root last).
            logits:  ``[n, V]``, the target's logits at each node.
        """
        return self.choose_from_scores(self.processed_scores(history, logits, tree), len(history), tree)

    def choose_reached_nodes(self, history: Sequence[int], logits: torch.Tensor,
                             tree: Tree) -> torch.Tensor:
        """int64 ``[n]``: :meth:`choose_all_nodes`'s choice at the nodes verification reaches
        (the root, then each node that carries its parent's choice), -1 at the others; the
        processors run on those nodes alone. :func:`accept` needs no more: a node whose parent
        was not reached is rejected whatever its parent's choice. A sampled request with top-p
        sorts the whole vocabulary at every node it processes (milliseconds a node on a CPU), so
        processing the three or four nodes of the accepted path instead of a tree's sixteen is
        most of its step's processing saved; each node's choice is the one
        :meth:`choose_all_nodes` makes there (the same rows through the same processors, its
        position's noise)."""
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        child = {(parents[i], tokens[i]): i for i in range(1, len(parents))}
        out = torch.full((len(parents),), -1, dtype=torch.int64, device=logits.device)
        if self.greedy and not self.processor:
            # The argmax of each reached row alone. Widening to fp32 keeps the order and the
            # first maximum (HF generate widens too); on a CPU it is also several times faster
            # than a bf16 argmax (0.05 against 0.18 ms a row), and a tree's every row costs more.
            node = 0
            while node >= 0:
                row = logits[node]
                c = int((row.float() if row.dtype in (torch.bfloat16, torch.float16) else row).argmax())
                out[node] = c
                node = child.get((node, c), -1)
            return out
        h = torch.as_tensor(history, dtype=torch.int64)
        node, path = 0, []
        while True:
            ids = torch.cat([h, torch.tensor(path, dtype=torch.int64)])
            row = logits[node: node + 1]
            scores = self.processor(ids, row.clone() if row.dtype == torch.float32 else row)
            c = int(self.choose_from_scores(scores, len(h) + len(path))[0])
            out[node] = c
            node = child.get((node, c), -1)
            if node < 0:
                return out
            path.append(c)

    def processed_scores(self, history: Sequence[int], logits: torch.Tensor,
                         tree: Tree | None = None) -> torch.Tensor:
        """``[n, V]``: each node's logits after the request's processors (what ``output_scores``
        reports); the logits themselves, in their own dtype, when there is nothing to apply."""
        if self.greedy and not self.processor:
            return logits  # argmax in the logits' own dtype: widening to fp32 would pick the same
        return self.processor(torch.as_tensor(history, dtype=torch.int64), logits, tree)

    def choose_from_scores(self, scores: torch.Tensor, position: int,
                           tree: Tree | None = None) -> torch.Tensor:
        """int64 ``[n]``: the argmax of each row of ``scores``, with the Gumbel noise of its
        position added when sampling (a node at depth d chooses the token at ``position + d``,
        whatever tree it is in)."""
        if not self.greedy:
            depth = tree.depth if tree is not None else torch.zeros(1, dtype=torch.int64)
            noise = gumbel_noise(self.seed, range(position, position + int(depth.max()) + 1), scores.shape[-1])
            scores = scores + noise.to(scores.device)[depth.to(scores.device)]
        return scores.argmax(-1)


def _mix(seed: int, position: int) -> int:
    """A 63-bit seed for ``(seed, position)`` (splitmix64's finaliser): neighbouring positions
    get unrelated generator states."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def gumbel_noise(seed: int, positions: Sequence[int], vocab: int) -> torch.Tensor:
    """float32 ``[len(positions), V]``: standard Gumbel noise of each absolute position,
    a function of ``(seed, position)`` alone."""
    out = torch.empty(len(positions), vocab)
    g = torch.Generator()
    for i, t in enumerate(positions):
        g.manual_seed(_mix(seed, int(t)))
        out[i].uniform_(generator=g)
    # u in [0, 1): u = 0 gives -inf noise, a token that is never chosen (probability 2^-24 per entry).
    return -torch.log(-torch.log(out))


@dataclass(frozen=True)
class PaddedTrees:
    """A batch of trees padded to ``n`` nodes (padding nodes are invalid leaves).

    tokens, parents, depth: int64 ``[B, n]``; valid: bool ``[B, n]``; mask: bool ``[B, n, n]``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor


def pad_trees(trees: list[Tree], device=None) -> PaddedTrees:
    B = len(trees)
    n = max(t.num_nodes for t in trees)
    tokens = torch.zeros(B, n, dtype=torch.int64)
    parents = torch.zeros(B, n, dtype=torch.int64)
    depth = torch.zeros(B, n, dtype=torch.int64)
    valid = torch.zeros(B, n, dtype=torch.bool)
    mask = torch.zeros(B, n, n, dtype=torch.bool)
    for b, t in enumerate(trees):
        if t.tokens is None:
            raise ValueError("verification needs trees with tokens")
        m = t.num_nodes
        tokens[b, :m] = t.tokens
        parents[b, 1:m] = t.parents[1:]
        depth[b, :m] = t.depth
        valid[b, :m] = True
        mask[b, :m, :m] = t.attention_mask()
    return PaddedTrees(*(x.to(device) for x in (tokens, parents, depth, valid, mask)))
