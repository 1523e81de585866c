"""One request's EAGLE head passes on fixed shapes, captured in CUDA graphs.

An EAGLE session's head pass attends over the keys its request holds so far, so each call has
its own shapes and launches its few dozen small kernels one by one from Python. On a GPU that
launching is the pass's cost: one tree level of an EAGLE-3 head of Llama-3.1-8B's shape took
1.5 ms eager and 0.4 ms replayed from a CUDA graph on an H200 (docs/benchmarks.md, "The first
run"), and the drafter took 40-65% of a treespec step there end to end.

:class:`StaticPasses` makes every pass of ``n`` entries one shape: it always attends over the
request's whole row of the draft cache (the row's capacity C, keys past the pass masked out)
and reads its inputs from buffers that live as long as the row, so the pass of ``n``
entries is captured once (:class:`torch.cuda.CUDAGraph`) and replayed for every later pass of
``n`` entries: a tree level (n = the frontier's width), the commit of the accepted tokens (n =
their count). The arithmetic is the session's lean pass (``EagleSession._run_one``): RoPE from
the head's table, K/V written into the row, fp32 SDPA (the query heads that share a key head
folded into one query axis, so the keys are not repeated per head), then the head's logits and
log-softmax, which the graph holds too. Masked-out keys add exact zeros to the softmax as long
as they are finite (a lent row is zeroed), so the states equal the lean pass's up to the order
the attention kernel sums in.

Capturing costs a device synchronisation and an eager warm-up per shape, so the graphs outlive
the session: a drafter keeps one :class:`GraphedRow` (a one-row draft cache and the passes
captured over it) and lends it to one session at a time, which starts from a zeroed row; the
row is rebuilt (and the graphs recaptured) when a session needs a longer row than it has or
one under a quarter of it (each pass attends over the whole row), or when the head's weights
moved or changed in place (a graph replays the addresses it captured; a compiled CPU pass holds
the weights themselves). Compiled on a CPU, where a pass reads only the keys in use, the row is
never shortened.

Without ``capture`` the same passes run eagerly on the same buffers (on a CPU, where the tests
hold them against the lean pass; capturing needs CUDA), or, with ``compile``, through
``torch.compile`` on any device: :func:`head_pass` is one function for every pass size, compiled
for one entry and, the buffers' size marked dynamic, once for two or more, both on padding
before the first step (:meth:`StaticPasses.precompile`): on a GPU its weights inputs of the
graph (:func:`treespec.compiled.compile_fixed`); on a CPU frozen into it, so that inductor
generates the products itself (its C++ GEMM templates, packed layers read on their dense
weights: 1.11 against 0.76 ms a pass of 8 entries on the 2-core Xeon, docs/runtime.md).
Compiled on a CPU, a pass attends over the row's first K keys only, the keys in use rounded up
to :data:`~treespec.fixed_shape.KEY_STEP` (K a symbolic size of the graph, as the verify
forward's), not over the whole row.

Letters: n entries of a pass, m tree entries it sees (the pass's own and the earlier levels'),
L cached entries before them, C the row's capacity, H hidden size, Vd draft vocabulary.
"""

from __future__ import annotations

import logging
import math
import time
import types
import weakref
from typing import Callable

import torch
import torch.nn.functional as F

from ..compiled import COMPILED_MIN_ROW, COMPILED_VERIFY_ROW, compile_fixed, cpu_options, own_code, pow2_row, replay
from ..fixed_shape import KEY_STEP, keys_in_use
from ..kv_cache import PagedKVCache
from ..packing import dense_in_compiled_graphs

log = logging.getLogger(__name__)

__all__ = ["StaticPasses", "GraphedRow", "head_pass", "compiled_on", "launch_body"]


class StaticPasses:
    """Fixed-shape head passes over one request's row of an EAGLE session's cache.

    Args:
        head:        the session's :class:`~treespec.drafters.eagle.EagleHead`.
        keys:        ``[C, Hkv, D]``, the request's row of the draft cache's keys (a view:
                     the passes write into it); ``values`` likewise.
        capture:     capture each pass shape in a CUDA graph on its first use (CUDA only).
        max_entries: passes of more entries run elsewhere (a prompt's prefill: one shape per
                     prompt length would be captured once and never replayed).
    """

    def __init__(self, head, keys: torch.Tensor, values: torch.Tensor, capture: bool, max_entries: int,
                 compile: bool = False):
        if capture and keys.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the draft head on a CUDA device; it is on {keys.device}")
        if capture and compile:
            raise ValueError("static head passes are captured in CUDA graphs or compiled, not both")
        self.max_entries = max_entries
        self.passes: dict[int, _Pass] = {}
        self._compiled_once = False
        self._shared = _Shared(head, keys, values, head.rope_table(keys.shape[0]),  # positions < L + m <= C
                               torch.cuda.graph_pool_handle() if capture else None,  # one pool for all shapes
                               compiled_on(head_pass, keys.device, head_dtype(head)) if compile else None)

    @classmethod
    def over_row(cls, head, cache: PagedKVCache, seq: int, capture: bool, max_entries: int,
                 compile: bool = False) -> "StaticPasses":
        """The passes over sequence ``seq``'s row of a one-layer cache made by
        :meth:`PagedKVCache.with_rows`."""
        first, stride, (row,) = cache.block_rows([seq], 0)
        start = first + row * stride
        keys, values = cache.flat(0)
        return cls(head, keys[start: start + stride], values[start: start + stride], capture, max_entries, compile)

    @property
    def keys(self) -> torch.Tensor:  # [C, Hkv, D], the row's keys; values likewise
        return self._shared.keys

    @property
    def values(self) -> torch.Tensor:
        return self._shared.values

    @property
    def capacity(self) -> int:
        return self._shared.capacity

    @property
    def drafts(self) -> dict:
        """The whole drafts over this row, by tree configuration (:mod:`~treespec.drafters.draft_graph`)."""
        return self._shared.drafts

    @property
    def commits(self) -> dict:
        """The commit passes over this row, by size (:mod:`~treespec.drafters.draft_graph`)."""
        return self._shared.commits

    def _pass(self, n: int) -> "_Pass":
        """The buffers (and graph) of the pass of ``n`` entries, made on first use."""
        if n not in self.passes:
            self.passes[n] = _Pass(self._shared, n)
        return self.passes[n]

    @torch.inference_mode()
    def precompile(self) -> float:
        """Compiled: compile the passes of one entry and of two or more (one dynamic graph) now,
        on padding, so that no draft step waits for a compile (nor an ``auto`` tree learns from
        one). Writes K/V at the row's first slot: call it before the row is zeroed for a request.
        Returns the seconds it took (0 when not compiled or already done)."""
        if self._shared.compiled is None or self._compiled_once:
            return 0.0
        start = time.perf_counter()
        for n in (1, 2):
            p = self._pass(n)
            p.mask[:, 0] = True  # each entry sees one key: no all-masked softmax
            if self._shared.narrow:  # a key count unlike any other size of the pass, so none is taken for it
                p.keys_in_use = min(KEY_STEP + 1, self.capacity)
            p.launch()
        self._compiled_once = True
        seconds = time.perf_counter() - start
        log.info("compiled the draft head's passes in %.0f s", seconds)
        return seconds

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
            cached: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One head pass; ``(states [n, H], log-probs [n, Vd] fp32)``, or None when the pass does
        not fit (more than ``max_entries`` entries, or past the row).

        Args:
            tokens:    int64 ``[n]`` (any other dtype is refused: the buffers are int64).
            hidden:    ``[n, H]`` input states.
            positions: int64 ``[n]`` RoPE positions.
            mask:      bool ``[n, m]``: which of the m tree entries each new entry sees; the new
                       entries are the last n, written at row slots ``cached + m - n ..``.
            cached:    L, the row's entries every new entry sees in full.
        """
        n, m = mask.shape
        if n > self.max_entries or n > m or cached + m > self.capacity:
            return None
        p = self._pass(n)
        p.fill(tokens, hidden, positions, mask, cached)
        p.launch()
        # Clones: the next launch of this shape overwrites the graph's outputs in place.
        return p.states.clone(), p.logp.clone()


def compiled_on(fn: Callable, device: torch.device, dtype: torch.dtype = torch.float32) -> Callable:
    """``fn`` (a function of the head and its row, :func:`head_pass` or the whole draft)
    compiled; on a CPU with the head's weights (of ``dtype``) frozen into the graph, so that
    inductor generates its products (:func:`~treespec.compiled.cpu_options`), packed layers
    included (:func:`~treespec.packing.dense_in_compiled_graphs`)."""
    if device.type != "cpu":
        return compile_fixed(fn)
    # A code object of its own: dynamo keeps graphs per code object, and the weights are
    # constants of these graphs, which its guards (on the tensors' identity) do not see change.
    own = own_code(fn)
    compiled = compile_fixed(own, cpu_options(dtype))

    def run(*args):
        with dense_in_compiled_graphs():
            return compiled(*args)

    # Dynamo keeps a code object's graphs (and records of its recompiles) for the process: drop
    # them with the passes, or every rebuild would keep its frozen weights alive.
    weakref.finalize(run, _forget_code, own.__code__)
    return run


def head_dtype(head) -> torch.dtype:
    """The dtype of ``head``'s weights (what :func:`compiled_on` compiles for)."""
    return next(head.parameters()).dtype


def _forget_code(code: types.CodeType) -> None:
    """Let go of what dynamo keeps for ``code``: its compiled graphs and its recompile records."""
    from torch._dynamo import utils as dynamo_utils

    torch._C._dynamo.eval_frame.reset_code(code)
    getattr(dynamo_utils, "guard_failures", {}).pop(code, None)


class _Shared:
    """What every pass shape of a :class:`StaticPasses` reads (no reference back to it, so a
    dropped one is freed at once, graphs, pool and cache row with it). ``compiled``: the
    compiled :func:`head_pass` that every shape runs, or None."""

    def __init__(self, head, keys, values, rope, pool, compiled=None):
        self.head, self.keys, self.values, self.rope, self.pool = head, keys, values, rope, pool
        self.compiled = compiled
        self.capacity = keys.shape[0]
        # draft_graph.py's, kept with the row whose addresses their graphs replay: the whole draft
        # of each tree configuration, the commit pass of each size, their compiled functions (one
        # for every commit size), and the root's log-probs and state ([1, Vd] fp32, [1, 1, H])
        # that a commit pass writes and a whole draft reads
        self.drafts: dict[tuple, object] = {}
        self.commits: dict[int, object] = {}
        self.compiled_bodies: dict[object, Callable] = {}
        self.root: tuple[torch.Tensor, torch.Tensor] | None = None
        # Compiled on a CPU, a pass attends over the row's first K keys, K the keys in use rounded
        # up to KEY_STEP (a symbolic size: one graph for every K); captured or eager, over all C.
        self.narrow = compiled is not None and keys.device.type == "cpu"


class _Pass:
    """The static buffers of one pass shape (n entries) and, once captured, its graph."""

    def __init__(self, owner: _Shared, n: int):
        head, dev = owner.head, owner.keys.device
        dtype = next(head.parameters()).dtype
        self.owner, self.n = owner, n
        self.replays = 0
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(n, head.config.hidden_size, dtype=dtype, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(n, dtype=torch.int64, device=dev)  # row slots the pass's K/V go to
        self.mask = torch.zeros(n, owner.capacity, dtype=torch.bool, device=dev)
        self._mask_host = torch.zeros(n, owner.capacity, dtype=torch.bool)  # built here, copied over in one go
        self.graph = None
        self.states = self.logp = None
        self.keys_in_use = owner.capacity  # K: the mask's columns the next launch passes
        if owner.compiled is not None and n >= 2:  # one graph for every size from 2 (1 is dynamo's special case)
            for t in (self.tokens, self.hidden, self.positions, self.slots, self.mask):
                torch._dynamo.mark_dynamic(t, 0)

    def fill(self, tokens, hidden, positions, mask, cached: int) -> None:
        # A captured graph reads its buffers' bytes as their dtype: refuse what a caller might
        # pass by mistake (vLLM's compiled drafter once drafted gibberish from int64 ids fed to
        # int32 buffers, without a warning) rather than rely on a conversion.
        for name, t in (("tokens", tokens), ("positions", positions)):
            if t.dtype != torch.int64:
                raise TypeError(f"static head pass: {name} must be int64 (the buffers it was built with), "
                                f"got {t.dtype}")
        if not hidden.is_floating_point() or mask.dtype != torch.bool:
            raise TypeError(f"static head pass: hidden must be floating point and mask bool, got {hidden.dtype} "
                            f"and {mask.dtype}")
        n, m = mask.shape
        kv = cached + m
        self.tokens.copy_(tokens)
        self.hidden.copy_(hidden)
        self.positions.copy_(positions)
        torch.arange(kv - n, kv, out=self.slots)  # on the buffer's device: no host copy to wait for
        host = self._mask_host
        host.zero_()
        host[:, :cached] = True
        host[:, cached:kv] = mask
        self.mask.copy_(host)
        if self.owner.narrow:
            self.keys_in_use = keys_in_use(kv, self.owner.capacity)

    def __repr__(self):
        return f"the draft head's pass of {self.n} entries"

    @torch.inference_mode()
    def launch(self) -> None:
        launch_body(self, self.owner)

    def _body(self) -> None:
        owner = self.owner
        run = owner.compiled or head_pass
        mask = self.mask
        if owner.narrow:  # the first K columns, K (and n from 2) symbolic sizes of the graph
            mask = mask[:, :self.keys_in_use]
            torch._dynamo.mark_dynamic(mask, 1)
            if self.n >= 2:
                torch._dynamo.mark_dynamic(mask, 0)
        # Outputs in the graphs' shared pool: another shape's replay may overwrite them, so
        # StaticPasses.run hands out clones taken right after this shape's launch.
        self.states, self.logp = run(owner.head, owner.keys, owner.values, owner.rope[0], owner.rope[1],
                                     self.tokens, self.hidden, self.positions, self.slots, mask)


def launch_body(holder, shared: "_Shared") -> None:
    """Run ``holder._body()`` over ``shared``'s row: eagerly when its passes are not captured,
    else by replaying ``holder.graph``, captured on first use (``holder.replays`` counts them)."""
    if shared.pool is None:  # not captured: run eagerly
        holder._body()
        return
    replay(holder, holder._body, shared.pool, shared.keys.device)  # on the head's GPU


def head_pass(head, keys, values, cos_table, sin_table, tokens, hidden, positions, slots, mask):
    """One fixed-shape head pass: the states ``[n, H]`` and fp32 log-probabilities ``[n, Vd]``
    of ``n`` entries (``tokens``, ``hidden``, ``positions``), their K/V written into the row
    (``keys``, ``values`` ``[C, Hkv, D]``) at ``slots``, each attending over the row's keys that
    ``mask`` ``[n, K]`` lets it see among the row's first K (K <= C; K = C but where compiled on
    a CPU). What a CUDA graph captures (a graph a size), and what a compile compiles (one graph
    for one entry, one for every size from two: :class:`_Pass` marks those buffers' size, and K,
    dynamic)."""
    c = head.config
    C = mask.shape[1]
    cos = cos_table.index_select(0, positions)  # [n, D]
    sin = sin_table.index_select(0, positions)

    def attend(q, k, v):  # q [n, Hq, D], k/v [n, Hkv, D]
        keys.index_copy_(0, slots, k.to(keys.dtype))
        values.index_copy_(0, slots, v.to(values.dtype))
        n, Hq, D = q.shape
        Hkv = k.shape[1]
        g = Hq // Hkv  # query heads per key head: head h reads key head h // g
        kf = keys[:C].transpose(0, 1).to(torch.float32)  # [Hkv, C, D]
        vf = values[:C].transpose(0, 1).to(torch.float32)
        q = q.to(torch.float32).view(n, Hkv, g, D).permute(1, 2, 0, 3).reshape(Hkv, g * n, D)
        m = mask[None].expand(g, n, C).reshape(g * n, C)
        out = F.scaled_dot_product_attention(q, kf, vf, attn_mask=m, scale=c.head_dim ** -0.5)
        return out.view(Hkv, g, n, D).permute(2, 0, 1, 3).reshape(n, Hq, D).to(k.dtype)

    states = head(tokens, hidden, positions, attend, (cos, sin))
    return states, head.logits(states).float().log_softmax(-1)


class GraphedRow:
    """A drafter's one-row draft cache and the static passes captured over it, lent to one
    session at a time (:meth:`lend`) so that graphs captured by one request serve the next.
    ``capture=False`` runs the same passes uncaptured (what the CUDA tests compare with);
    ``compile=True`` runs them through ``torch.compile`` (:func:`head_pass`; on a CPU the head's
    weights frozen into the graph), on rows of at least 512 entries (on a CPU one row of at least
    2,048, grown for a longer request and never shortened: a new row compiles again)."""

    def __init__(self, capture: bool = True, compile: bool = False):
        self.capture, self.compile = capture, compile
        self.compile_seconds = 0.0  # what the last lend spent compiling
        self.cache: PagedKVCache | None = None
        self.seq = 0
        self.passes: StaticPasses | None = None
        self._weights: tuple = ()
        self._holder: Callable[[], object] | None = None  # a weak reference to the borrowing session

    def lend(self, session, head, tokens: int, max_entries: int, make_cache: Callable[[int], tuple],
             prepare: Callable[["StaticPasses"], float] | None = None):
        """``(cache, seq, passes)`` for ``session``, its row holding at least ``tokens`` entries
        and empty, or None while another live session holds it. ``make_cache(tokens)`` makes a
        one-row cache as the session would (``PagedKVCache.with_rows``); ``prepare(passes)``,
        run before the row is zeroed, compiles what else the session runs over it (its whole
        draft) and returns the seconds it took."""
        if self._holder is not None and self._holder() is not None:
            return None
        weights = _addresses(head)
        # Too short, or far too long (every pass reads the whole row); compiled, rows of at least
        # COMPILED_MIN_ROW, so that short requests after long ones keep theirs. Compiled on a CPU a
        # pass reads the keys in use only, and a new row means compiling again (its weights
        # frozen into the graph: 4-5 s a graph on the 2-core Xeon): one row of
        # COMPILED_VERIFY_ROW, grown only for a longer request, never shortened.
        narrow = self.compile and next(head.parameters()).device.type == "cpu"
        shortest = COMPILED_VERIFY_ROW if narrow else COMPILED_MIN_ROW if self.compile else 0
        longest = math.inf if narrow else 4 * (pow2_row(tokens, shortest) if self.compile else tokens)
        fits = self.passes is not None and tokens <= self.passes.capacity < longest
        if not fits or weights != self._weights:
            self.passes = self.cache = None  # the old graphs and row go first: the new ones need the memory
            if weights != self._weights:
                head.forget_rope_table()  # recomputed from the weights as they are now
            # A power of two: a session a little longer than the last reuses the row.
            self.cache, (self.seq,) = make_cache(pow2_row(tokens, shortest))
            self.passes = StaticPasses.over_row(head, self.cache, self.seq, self.capture, max_entries, self.compile)
            self._weights = weights
        else:
            self.cache.truncate(self.seq, 0)
            self.passes.max_entries = max(self.passes.max_entries, max_entries)
        # compiled: before any step (its padding's K/V are zeroed next)
        self.compile_seconds = self.passes.precompile() + (prepare(self.passes) if prepare is not None else 0.0)
        # Zeroed: every pass reads the whole row, and a masked key still turns the softmax to
        # NaN if it is not finite (say, a tree node of an earlier request's diverged head).
        self.passes.keys.zero_()
        self.passes.values.zero_()
        self._holder = weakref.ref(session)
        return self.cache, self.seq, self.passes

    def give_back(self, session) -> None:
        if self._holder is not None and self._holder() is session:
            self._holder = None


def _addresses(head) -> tuple:
    """Where every tensor a captured pass reads lives (the head's, and the target's embedding
    and output layer it borrows), and its version (bumped by every in-place change): a graph
    replays these addresses, and a compiled CPU pass holds the weights frozen into its graph, so
    a change of either means capturing or compiling again."""
    modules = [head, head._embed[0]] + ([head._target_lm_head[0]] if head._target_lm_head[0] is not None else [])
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    return tuple((t.data_ptr(), t.dtype, t.device, tuple(t.shape), _version(t)) for t in tensors)


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter; an inference tensor has none, so a change made to one in place
    (inside inference mode) goes unseen: load a head's new weights as new tensors, or outside
    inference mode."""
    return -1 if t.is_inference() else t._version
