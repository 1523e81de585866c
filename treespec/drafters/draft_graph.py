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

:class:`DraftGraph` holds its input buffers (the root's log-probabilities and state, L) over a
:class:`StaticPasses` row and runs it eagerly, compiled (on a CPU with the head's weights frozen
into the graph, over the row's keys in use rounded up to ``KEY_STEP``) or captured in one CUDA
graph, as the row's passes are. Eagerly its trees are the level-by-level trees bit for bit (the
same passes on the same masks; tests/model/test_draft_graph.py).

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
from ..fixed_shape import KEY_STEP
from ..tree import Tree
from .graphs import StaticPasses, capture_graph, compiled_on, head_pass

log = logging.getLogger(__name__)

__all__ = ["DraftGraph", "draft_tree", "draft_graph_for"]


def draft_graph_for(static: StaticPasses, config: TreeConfig) -> "DraftGraph":
    """The whole draft of ``config`` over ``static``'s row, made on first use and kept with the
    passes (its graph replays the row's addresses)."""
    if config.kind != "dynamic":
        raise ValueError(f"a whole draft grows dynamic trees; this configuration is {config.kind}")
    key = (config.depth, config.top_k, config.num_nodes)
    if key not in static.drafts:
        static.drafts[key] = DraftGraph(static, config)
    return static.drafts[key]


class DraftGraph:
    """The buffers, and once captured the graph, of one tree configuration's whole draft over a
    :class:`StaticPasses` row (use :func:`draft_graph_for`)."""

    def __init__(self, static: StaticPasses, config: TreeConfig):
        shared = static._shared
        self.static, self.config = static, config
        dev = shared.keys.device
        self.cached = torch.zeros((), dtype=torch.int64, device=dev)  # L: the row's committed entries
        self.cols = torch.arange(shared.capacity, device=dev)  # the row's key indices
        self.root_logp: torch.Tensor | None = None  # [1, Vd] fp32, made at the first fill
        self.root_state: torch.Tensor | None = None  # [1, 1, H]
        self.keys_in_use = shared.capacity
        self.out: torch.Tensor | None = None  # [3, N] float64: parents, target ids, scores
        self.graph = None
        self.replays = 0
        self._run = compiled_on(draft_tree, dev) if shared.compiled is not None else draft_tree
        self._compiled_once = False

    @property
    def reach(self) -> int:
        """Entries past L the draft writes: its levels' frontiers."""
        return (self.config.depth - 1) * self.config.top_k

    def fits(self, cached: int) -> bool:
        return cached >= 1 and cached + self.reach <= self.static.capacity

    def fill(self, root_logp: torch.Tensor, root_state: torch.Tensor, cached: int) -> None:
        """The root's fp32 log-probabilities ``[Vd]`` and state ``[1, H]``, and L (the root's
        entry is the row's entry L-1)."""
        if not self.fits(cached):
            raise ValueError(f"a whole draft of {self.reach} entries past {cached} does not fit the row of "
                             f"{self.static.capacity}")
        if self.root_logp is None:
            self.root_logp = torch.zeros((1, root_logp.shape[-1]), dtype=torch.float32, device=self.cached.device)
            self.root_state = torch.zeros((1, *root_state.shape), dtype=root_state.dtype, device=self.cached.device)
        self.root_logp.copy_(root_logp.reshape(1, -1))
        self.root_state.copy_(root_state.reshape(self.root_state.shape))
        self.cached.fill_(cached)
        if self.static._shared.narrow:
            self.keys_in_use = min(self.static.capacity, -(-(cached + self.reach) // KEY_STEP) * KEY_STEP)

    @torch.inference_mode()
    def launch(self) -> None:
        shared = self.static._shared
        if shared.pool is None:
            self._body()
            return
        with torch.cuda.device(shared.keys.device):
            if self.graph is None:
                self.graph = capture_graph(self._body, shared.pool)
                log.debug("captured the whole draft of %s in a CUDA graph", self.config)
            self.graph.replay()
        self.replays += 1

    def _body(self) -> None:
        shared = self.static._shared
        cols = self.cols
        if shared.narrow:  # the row's first K keys, K a symbolic size of the graph
            cols = cols[:self.keys_in_use]
            torch._dynamo.mark_dynamic(cols, 0)
        self.out = self._run(shared.head, shared.keys, shared.values, shared.rope[0], shared.rope[1],
                             self.root_logp, self.root_state, self.cached, cols, self.config)

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
        """Compiled: compile the draft now, on padding, so that no step waits for it. Writes K/V
        into the row past its first entry: call it before the row is zeroed for a request.
        Returns the seconds it took (0 when not compiled or already done)."""
        if self.static._shared.compiled is None or self._compiled_once:
            return 0.0
        start = time.perf_counter()
        head = self.static._shared.head
        c = head.config
        width = c.draft_vocab_size if c.eagle3 else c.vocab_size
        p = next(head.parameters())
        self.fill(torch.zeros(width), torch.zeros(1, c.hidden_size, dtype=p.dtype, device=p.device), 1)
        if self.static._shared.narrow:  # a key count unlike any other size of the graph, so none is taken for it
            self.keys_in_use = min(self.static.capacity, -(-(1 + self.reach) // KEY_STEP) * KEY_STEP + 1)
        self.launch()
        self._compiled_once = True
        seconds = time.perf_counter() - start
        log.info("compiled the whole draft of %s in %.0f s", self.config, seconds)
        return seconds


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
