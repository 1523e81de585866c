"""One request's whole EAGLE-2 draft on fixed shapes: one graph a tree configuration.

Level by level (:meth:`EagleSession.propose` over :class:`~treespec.drafters.graphs.StaticPasses`),
a dynamic tree of depth D costs D-1 head passes, each filled from the host and launched on its
own, with the builder's top-k, gathers and the early stop's read of the pool between them: on a
GPU, hundreds of small kernels and a device read a level (issue 47: the drafter took 40-65% of a
step on an H200). :func:`draft_tree` is the same draft as one function of fixed shapes:

* the expansion of :func:`treespec.builder.dynamic_pool`, each level's head pass
  (:func:`~treespec.drafters.graphs.head_pass`) writing its frontier's K/V into the request's
  row past the committed entries, as the level-by-level passes do;
* each level's tree mask, slots and positions computed on the device from the row's committed
  length L (a 0-dim tensor), not built on the host;
* the best ``num_nodes`` of the pool (:func:`treespec.builder.best_of_pool`), mapped to the
  target's ids, packed in one ``[3, N]`` tensor (parents, tokens, scores) that the host reads
  once: the step's one read for the draft.

Its partner :class:`CommitPass` is the commit's pass of the ``n`` accepted tokens as one function
too (:func:`commit_row`): their features projected, their mask, positions and slots made from L,
the head's pass, and the last entry's log-probabilities and state written into the row's root
buffers, where the next whole draft reads them. So a step of the draft fills the accepted
tokens and their features, and L for each of the two, launches twice and reads once.

:class:`DraftGraph` holds its input buffers (the root's log-probabilities and state, L) over a
:class:`StaticPasses` row and runs it eagerly, compiled (on a CPU with the head's weights frozen
into the graph, over the row's keys in use rounded up to ``KEY_STEP``) or captured in one CUDA
graph, as the row's passes are. Eagerly its trees are the level-by-level trees bit for bit (the
same passes on the same masks; tests/drafters/test_draft_graph.py).

What stays level by level: the early stop (``auto``'s rule reads the pool after every level; a
whole draft drafts every level and ``auto`` then chooses the part worth verifying from the
whole tree), generation rules (masked per path on the host), batches of several requests and
static tree shapes.

Letters: k the tree's top-k, D its depth, N its nodes, P the pool's candidates, C the row's
capacity, K the keys a compiled CPU draft reads (K <= C).
"""

from __future__ import annotations

import logging
import time

import torch

from ..builder import Frontier, best_of_pool, dynamic_pool
from ..config import TreeConfig
from ..fixed_shape import keys_in_use
from ..tree import Tree
from .graphs import StaticPasses, compiled_on, head_dtype, head_pass, launch_body

log = logging.getLogger(__name__)

__all__ = ["DraftGraph", "CommitPass", "draft_tree", "commit_row", "draft_graph_for", "commit_pass_for"]


def draft_graph_for(static: StaticPasses, config: TreeConfig) -> "DraftGraph":
    """The whole draft of ``config`` over ``static``'s row, made on first use and kept with the
    passes (its graph replays the row's addresses)."""
    if config.kind != "dynamic":
        raise ValueError(f"a whole draft grows dynamic trees; this configuration is {config.kind}")
    key = _config_key(config)
    if key not in static.drafts:
        static.drafts[key] = DraftGraph(static._shared, config)
    return static.drafts[key]


def commit_pass_for(static: StaticPasses, n: int) -> "CommitPass":
    """The commit pass of ``n`` entries over ``static``'s row, made on first use and kept."""
    if n not in static.commits:
        static.commits[n] = CommitPass(static._shared, n)
    return static.commits[n]


def _config_key(config: TreeConfig) -> tuple[int, int, int]:
    """What tells two dynamic configurations' whole drafts apart."""
    return config.depth, config.top_k, config.num_nodes


def root_of(shared) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's root buffers: fp32 log-probabilities ``[1, Vd]`` and state ``[1, 1, H]``
    (``shared``: the row's ``StaticPasses._shared``)."""
    if shared.root is None:
        head = shared.head
        c, p = head.config, next(head.parameters())
        width = c.draft_vocab_size if c.eagle3 else c.vocab_size
        shared.root = (torch.zeros(1, width, dtype=torch.float32, device=p.device),
                       torch.zeros(1, 1, c.hidden_size, dtype=p.dtype, device=p.device))
    return shared.root


class _Launched:
    """A body over a :class:`StaticPasses` row run eagerly, compiled or captured (as the row's
    passes are): subclasses hold the buffers and define :meth:`_body`. It holds what the row's
    passes share (``StaticPasses._shared``), not the passes, so that a dropped row is freed at
    once, its graphs with it."""

    def __init__(self, shared, fn):
        self.shared = shared
        self.cached = torch.zeros((), dtype=torch.int64, device=shared.keys.device)  # L: the row's committed entries
        self.cols = torch.arange(shared.capacity, device=shared.keys.device)  # the row's key indices
        self.keys_in_use = shared.capacity
        self.graph = None
        self.replays = 0
        self._run = fn
        if shared.compiled is not None:  # one compiled function a body, for the row: dynamic sizes share it
            key = (fn, self._key())
            if key not in shared.compiled_bodies:
                shared.compiled_bodies[key] = compiled_on(fn, shared.keys.device, head_dtype(shared.head))
            self._run = shared.compiled_bodies[key]
        self._compiled_once = False

    def _set_cached(self, cached: int, reach: int) -> None:
        """L, and the keys a compiled CPU body reads: those in use (``cached + reach``) rounded up."""
        self.cached.fill_(cached)
        if self.shared.narrow:
            self.keys_in_use = keys_in_use(cached + reach, self.shared.capacity)

    def _cols(self) -> torch.Tensor:
        if not self.shared.narrow:
            return self.cols
        cols = self.cols[:self.keys_in_use]  # the row's first K keys, K a symbolic size of the graph
        torch._dynamo.mark_dynamic(cols, 0)
        return cols

    @torch.inference_mode()
    def launch(self) -> None:
        launch_body(self, self.shared)

    def _key(self):
        """What tells this body's compiled function apart from the row's others of the same code."""
        return None

    def _body(self) -> None:
        raise NotImplementedError

    def _precompile(self, fill, reach: int) -> float:
        """Compiled: ``fill()`` padding, then compile on it (writes K/V into the row: call it
        before the row is zeroed for a request). The seconds it took (0 when not compiled or
        already done)."""
        if self.shared.compiled is None or self._compiled_once:
            return 0.0
        start = time.perf_counter()
        fill()
        if self.shared.narrow:  # a key count unlike any other size of the graph, so none is taken for it
            self.keys_in_use = min(self.shared.capacity, keys_in_use(1 + reach, self.shared.capacity) + 1)
        self.launch()
        self._compiled_once = True
        seconds = time.perf_counter() - start
        log.info("compiled %s in %.0f s", self, seconds)
        return seconds


class CommitPass(_Launched):
    """The commit's pass of ``n`` entries over a :class:`StaticPasses` row (use
    :func:`commit_pass_for`): the accepted tokens and their target features in, the row's root
    buffers out. Compiled, one graph for one entry and one for every size from two (the buffers'
    size marked dynamic), as the row's passes."""

    def __init__(self, shared, n: int):
        super().__init__(shared, commit_row)
        head = shared.head
        c, p = head.config, next(head.parameters())
        self.n = n
        self.tokens = torch.zeros(n, dtype=torch.int64, device=p.device)
        self.features = torch.zeros(n, head.fc.in_features if c.eagle3 else c.hidden_size, dtype=p.dtype,
                                    device=p.device)
        if shared.compiled is not None and n >= 2:
            for t in (self.tokens, self.features):
                torch._dynamo.mark_dynamic(t, 0)

    def __repr__(self):
        return f"the draft head's commit pass of {self.n} entries"

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, features: torch.Tensor, cached: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries L .. L+n-1 of the row from the accepted ``tokens`` (int64 ``[n]``) and their
        target ``features`` ``[n, F]``; the root's fp32 log-probabilities ``[Vd]`` and state
        ``[1, H]`` after them: views of the row's root buffers, which the next commit overwrites."""
        if tokens.dtype != torch.int64:
            raise TypeError(f"commit pass: tokens must be int64 (the buffers it was built with), got {tokens.dtype}")
        self.tokens.copy_(tokens)
        self.features.copy_(features)
        self._set_cached(cached, self.n)
        self.launch()
        logp, state = root_of(self.shared)
        return logp[0], state[0]

    def _body(self) -> None:
        shared = self.shared
        logp, state = root_of(shared)
        self._run(shared.head, shared.keys, shared.values, shared.rope[0], shared.rope[1], self.tokens,
                  self.features, self.cached, self._cols(), logp, state)

    @torch.inference_mode()
    def precompile(self) -> float:
        def fill():
            self.tokens.zero_()
            self.features.zero_()
            self.cached.fill_(1)
        return self._precompile(fill, self.n)


class DraftGraph(_Launched):
    """The whole draft of one tree configuration over a :class:`StaticPasses` row (use
    :func:`draft_graph_for`): the row's root buffers and L in, the tree out."""

    def __init__(self, shared, config: TreeConfig):
        self.config = config
        super().__init__(shared, draft_tree)
        self.out: torch.Tensor | None = None  # [3, N] float64: parents, target ids, scores

    def __repr__(self):
        return f"the whole draft of {self.config}"

    def _key(self):
        return _config_key(self.config)

    @property
    def reach(self) -> int:
        """Entries past L the draft writes: its levels' frontiers."""
        return (self.config.depth - 1) * self.config.top_k

    def fits(self, cached: int) -> bool:
        return cached >= 1 and cached + self.reach <= self.shared.capacity

    @torch.inference_mode()
    def fill(self, root_logp: torch.Tensor, root_state: torch.Tensor, cached: int) -> None:
        """The root's fp32 log-probabilities ``[Vd]`` and state ``[1, H]`` (copied into the row's
        root buffers unless they are those buffers, as a :class:`CommitPass` leaves them), and L
        (the root's entry is the row's entry L-1)."""
        if not self.fits(cached):
            raise ValueError(f"a whole draft of {self.reach} entries past {cached} does not fit the row of "
                             f"{self.shared.capacity}")
        logp, state = root_of(self.shared)
        if root_logp.data_ptr() != logp.data_ptr():
            logp[0].copy_(root_logp)
        if root_state.data_ptr() != state.data_ptr():
            state[0].copy_(root_state)
        self._set_cached(cached, self.reach)

    def _body(self) -> None:
        shared = self.shared
        logp, state = root_of(shared)
        self.out = self._run(shared.head, shared.keys, shared.values, shared.rope[0], shared.rope[1], logp, state,
                             self.cached, self._cols(), self.config)

    @torch.inference_mode()
    def draft(self, root_logp: torch.Tensor, root_state: torch.Tensor, cached: int, root: int) -> Tree:
        """The request's tree under ``root`` (a target id), read back in one go."""
        self.fill(root_logp, root_state, cached)
        self.launch()
        parents, tokens, scores = self.out.tolist()
        if min(parents) < 0:
            raise AssertionError("dynamic tree is not ancestor-closed (non-finite draft scores?)")
        return Tree(torch.tensor([-1] + [int(p) for p in parents]), torch.tensor([root] + [int(t) for t in tokens]),
                    torch.tensor([0.0] + scores, dtype=torch.float32))  # fp32 scores: exact in fp64

    @torch.inference_mode()
    def precompile(self) -> float:
        def fill():
            for t in root_of(self.shared):
                t.zero_()
            self.cached.fill_(1)
        return self._precompile(fill, self.reach)


def draft_tree(head, keys, values, cos_table, sin_table, root_logp, root_state, cached, cols,
               config: TreeConfig) -> torch.Tensor:
    """The whole dynamic draft of one request: ``[3, N]`` float64, each kept node's parent (its
    node index, 0 the root; -1 only with non-finite scores), token (a target id) and cumulative
    log-probability, nodes in pool order.

    Args:
        head:       the :class:`~treespec.drafters.eagle_head.EagleHead`.
        keys:       ``[C, Hkv, D]``, the request's row of the draft cache (written past L);
                    ``values`` likewise; ``cos_table``, ``sin_table`` its RoPE rows.
        root_logp:  fp32 ``[1, Vd]``, the head's log-probabilities after the root.
        root_state: ``[1, 1, H]``, the head's state at the root's entry.
        cached:     int64, 0-dim: L, the row's committed entries (the root's is entry L-1).
        cols:       int64 ``[K]``, ``0 .. K-1``: the row's keys a pass reads.
        config:     the dynamic tree's configuration (a constant of the graph).
    """
    def step(f: Frontier):
        k, seen = f.tokens.shape[1], f.ancestors.shape[2]  # the frontier's width, the tree entries so far
        rel = cols - cached  # a key's tree index (negative: committed)
        tree = f.ancestors[0].gather(1, rel.clamp(0, seen - 1).expand(k, -1))
        mask = (rel < 0) | (tree & (rel < seen))
        positions = (cached + (f.depth - 1)).expand(k)
        slots = cached + (seen - k) + torch.arange(k, device=cols.device)
        states, logp = head_pass(head, keys, values, cos_table, sin_table, head.draft_to_target(f.tokens[0]),
                                 f.parent_state[0], positions, slots, mask)
        return logp[None], states[None]

    parents, tokens, scores = best_of_pool(*dynamic_pool(root_logp, step, config, root_state), config.num_nodes)
    return torch.stack([parents[0].double(), head.draft_to_target(tokens[0]).double(), scores[0].double()])


def commit_row(head, keys, values, cos_table, sin_table, tokens, features, cached, cols, root_logp, root_state):
    """The commit's pass of ``n`` entries: the head reads the accepted ``tokens`` (int64 ``[n]``)
    with their target ``features`` ``[n, F]`` (projected here) at positions and row slots
    ``L .. L+n-1``, each entry seeing the row's keys up to its own; the last entry's fp32
    log-probabilities and state go to ``root_logp`` ``[1, Vd]`` and ``root_state`` ``[1, 1, H]``.
    ``cached``: L, 0-dim int64; ``cols``: ``0 .. K-1``, the row's keys a pass reads."""
    positions = cached + torch.arange(tokens.shape[0], device=cols.device)
    mask = cols[None] <= positions[:, None]
    states, logp = head_pass(head, keys, values, cos_table, sin_table, tokens, head.project(features), positions,
                             positions, mask)
    root_logp.copy_(logp[-1:])
    root_state.copy_(states[-1:][None])
