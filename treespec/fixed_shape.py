"""The verify forward on fixed shapes: the tree padded to a bucket, its inputs read from buffers
that live as long as the loop's cache rows, each layer attending over the rows' first K keys.

Today's verify forward (:meth:`~treespec.runner.ModelRunner.forward`) has new shapes at every
step: n tree tokens, L + n keys, a mask and index tensors built for them. That is cheapest when
every operation is launched from Python anyway (a CPU running eagerly), but nothing can be
captured in a CUDA graph or compiled once: ``torch.compile`` of the eager forward recompiles at
every change of the prefix's length (issue 48 counted eight recompiles, then its limit).

:class:`FixedShapeVerify` runs the same model, through the same registered attention function,
on shapes that depend only on the bucket (1, 4, 8, 16, 32 or 64 tokens a row) and on the cache:

- the ids and parents ``[R, N]`` and the committed lengths ``[R]`` are buffers allocated once
  per bucket and refilled before each forward (two copies a request); the tree's ancestor mask
  and positions are computed from them inside the forward (:func:`ancestor_masks`);
- row r's node i writes its K/V at row position ``committed[r] + i``: a tree node where today's
  path writes it, a padded node just past the tree, scratch that nothing reads (every later
  tree writes there again before a commit can keep it);
- each layer attends over the first K keys of every row, key j seen by node i when
  ``j < committed[r]`` or j - committed[r] is token i or its ancestor: the mask is computed
  from the buffers inside the forward, once, so the prefix grows in a tensor and not in a shape. A
  padded node sees the committed prefix and itself (no all-masked softmax); the rows of finished
  requests are all padding, and their writes land in their own row: the loop's cache is its own
  (``new_rows_cache``) and nothing takes pages from its pool while the loop runs, so the pages a
  finished request gave back are never another's. Keys outside the mask add exact zeros to the softmax as long as they are finite,
  and the cache holds only finite K/V (it starts zeroed). K is the row's whole capacity C on
  CUDA (a captured graph replays fixed shapes); on a CPU, the longest row's committed prefix and
  bucket rounded up to ``KEY_STEP``, a size the compiled forward takes as symbolic, so one compile
  serves every length and a long row costs no time (at a 32-token tree after 128 tokens in a
  512-token row, attention went from 10.3 to 4.3 ms of a 40 ms forward, ``torch.profiler``).

Trees past the largest bucket, or past their row, go through today's forward. With
``compile=True`` the forward runs through ``torch.compile(dynamic=False)``: one compile per
bucket (and row capacity), none as the prefix grows (``tests/model/test_fixed_shape.py`` counts them),
one compiled body per model whose calls skip dynamo's guards on the model's modules
(:func:`~treespec.compiled.compile_for_model`).

With ``graphs=True`` (CUDA) each bucket's forward, eager, is captured once in a CUDA graph and
replayed: the launches of a whole forward (a few thousand kernels for a 30-layer model) become
one. A graph replays the addresses it captured, so what it reads lives longer than one call: the
buckets' buffers, each row's first slot and the graphs' outputs are kept per model
(:class:`_Rows`) with the cache storage they were captured on, and the loop's next cache of the
same layout is made on that storage (:meth:`~treespec.runner.ModelRunner.release_cache`), rows a
power of two long (:func:`row_capacity`): a later call replays what the first captured.

Letters: R rows of the cache (one per request of the batch), N tokens of a bucket, n tree nodes,
C a row's capacity, V vocabulary, F features, H query heads, Hkv key heads, D head dim.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from .accept import RequestDecoding, Verdict, accept_fixed, first_argmax, verdicts_of
from .compiled import COMPILED_MIN_ROW, COMPILED_VERIFY_ROW, compile_for_model, cpu_options, pow2_row, replay
from .device_sampling import SamplingRows, row_warp, sampled_choices
from .kv_cache import PagedKVCache
from .runner import ForwardOutput, drop_spare_storage
from .tree import Tree

__all__ = ["FixedShapeVerify", "Accepted", "FixedRowsAttention", "BUCKETS", "bucket_for", "row_capacity",
           "fixed_row_tokens", "tree_rows_mask", "ancestor_masks", "release_graphs"]

log = logging.getLogger(__name__)

BUCKETS = (1, 4, 8, 16, 32, 64)  # tree tokens a row, root and padding included (1: decoding without a draft)
KEY_STEP = 64  # a narrowed forward's key count is a multiple of this


def keys_in_use(keys: int, capacity: int) -> int:
    """The key count a narrowed (compiled CPU) forward or pass attends over for ``keys`` keys in
    use: rounded up to :data:`KEY_STEP`, at most the row's ``capacity``."""
    return min(capacity, -(-keys // KEY_STEP) * KEY_STEP)


# model -> (its linears' kinds, rows, row capacity, block start, bucket, features, acceptance)
# compiled in this process: what precompile skips (dynamo's own cache holds the graphs)
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, set[tuple]]" = weakref.WeakKeyDictionary()
# model -> the rows its verify forwards were last captured over (graphs=True): one layout a model
_CAPTURED: "weakref.WeakKeyDictionary[torch.nn.Module, _Rows]" = weakref.WeakKeyDictionary()


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket that holds ``n`` tree tokens, or None past the largest."""
    return next((b for b in buckets if b >= n), None)


def row_capacity(tokens: int, mode: bool | str) -> int:
    """The row length a fixed-shape cache (``mode``: True, ``"compile"`` or ``"graphs"``) asks
    for to hold ``tokens`` positions: exactly that, eager; compiled, a power of two of at least
    :data:`~treespec.compiled.COMPILED_VERIFY_ROW`: every row capacity is a new shape to compile,
    and prompts and budgets vary from call to call; captured, a power of two of at least
    :data:`~treespec.compiled.COMPILED_MIN_ROW` (a new row, new captures, and every replay
    attends over the whole row)."""
    if mode == "compile":
        return pow2_row(tokens, COMPILED_VERIFY_ROW)
    return pow2_row(tokens, COMPILED_MIN_ROW) if mode == "graphs" else tokens


def fixed_row_tokens(committed: int, tree_tokens: int, mode: bool | str) -> int:
    """The row a request needs on fixed shapes (``mode``: True, ``"compile"`` or ``"graphs"``):
    room for ``committed`` tokens and, after them, the bucket of a tree of ``tree_tokens`` (root
    included; the tree itself past the largest bucket, which today's forward runs)."""
    return row_capacity(committed + (bucket_for(tree_tokens) or tree_tokens), mode)


@dataclass(eq=False)
class _Bucket:
    """One bucket's buffers (N tokens a row), on the cache's device (or their pinned host
    copies, filled on the CPU and copied over in one go each)."""

    ids: torch.Tensor  # int64 [R, N]; padding: token 0
    parents: torch.Tensor  # int64 [R, N]: each token's parent in its row's bucket; -1: a root or padding
    committed: torch.Tensor  # int64 [R]: L, the row's keys every token sees
    copied: object = None  # pinned host copies: the CUDA event of their last copy to the device

    @classmethod
    def empty(cls, rows: int, n: int, device) -> "_Bucket":
        return cls(torch.zeros(rows, n, dtype=torch.int64, device=device),
                   torch.full((rows, n), -1, dtype=torch.int64, device=device),
                   torch.zeros(rows, dtype=torch.int64, device=device))

    def pinned(self) -> "_Bucket":
        """A copy of these (host) buffers in pinned memory, for copies to the device that do not wait."""
        return _Bucket(self.ids.pin_memory(), self.parents.pin_memory(), self.committed.pin_memory())

    def copy_from(self, other: "_Bucket") -> None:
        """Copy ``other``'s (pinned) buffers here without waiting; ``other`` is not to be
        written again before :meth:`wait` says the copies are done."""
        for name in ("ids", "parents", "committed"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)
        if self.ids.device.type == "cuda":
            other.copied = other.copied or torch.cuda.Event()
            other.copied.record(torch.cuda.current_stream(self.ids.device))  # the copies' stream

    def wait(self) -> None:
        """Until the last copy out of these (host) buffers is done."""
        if self.copied is not None:
            self.copied.synchronize()


@dataclass(eq=False)
class _Captured:
    """One bucket's forward captured in a CUDA graph, and the outputs its replays overwrite (and
    may any later replay of another graph of the pool: they hold until the next forward)."""

    key: tuple  # (N, features, acceptance, feature layers)
    graph: object = None  # torch.cuda.CUDAGraph
    outputs: tuple = ()  # (logits, features, packed) as the body returns them
    replays: int = 0

    def __repr__(self):
        return "the verify forward of {} tokens a row (features: {}, acceptance: {})".format(*self.key)


@dataclass(eq=False)
class _Rows:
    """What a fixed-shape forward reads besides the cache and the weights: each row's first flat
    slot and every bucket's buffers. Captured (``graphs=True``), also the graphs, keyed by
    ``(bucket, features, acceptance, feature layers)``, their memory pool and the cache storage
    they write, kept alive with them: one per model (:data:`_CAPTURED`), reused by every later
    :class:`FixedShapeVerify` whose cache has the same layout on the same storage and whose model
    holds its weights where they were captured (``key``). :func:`release_graphs` lets them go."""

    row_start: torch.Tensor  # int64 [R]: row r's first flat slot
    buffers: dict = field(default_factory=dict)  # N -> (_Bucket on the device, _Bucket on the CPU)
    graphs: dict = field(default_factory=dict)  # (N, capture, accept, feature layers) -> _Captured
    pool: object = None
    storage: torch.Tensor | None = None
    key: tuple = ()
    sampling: SamplingRows | None = None  # sampled acceptance inside: the rows' warpers and noise


def _rows_for(runner, cache: PagedKVCache, first: int, rows: int, stride: int, graphs: bool) -> _Rows:
    """The rows' state: the model's captured one when its cache layout is this cache's, else new
    (captured, it replaces the model's: the graphs of another layout are let go)."""
    row_start = first + stride * torch.arange(rows, device=cache.device)
    if not graphs:
        return _Rows(row_start)
    # a graph replays the addresses it captured: the cache's and the weights' (moved, reloaded or
    # swapped, they are elsewhere; changed in place, a replay reads the new values, as it should)
    weights = tuple(t.data_ptr() for t in itertools.chain(runner.model.parameters(), runner.model.buffers()))
    key = (cache.kv.data_ptr(), tuple(cache.kv.shape), cache.kv.dtype, first, rows, stride, weights)
    held = _CAPTURED.get(runner.model)
    if held is None or held.key != key:
        pool = torch.cuda.graph_pool_handle() if cache.device.type == "cuda" else None
        held = _CAPTURED[runner.model] = _Rows(row_start, pool=pool, storage=cache.storage, key=key)
    return held


def release_graphs(model: torch.nn.Module) -> bool:
    """Let go of ``model``'s captured verify forwards (``fixed_shapes="graphs"``): their graphs
    and memory pool, the buckets' buffers, the cache storage they were captured on (the runner's
    spare, :meth:`~treespec.runner.ModelRunner.release_cache`, goes too). The next call captures
    again. Returns whether there was anything to let go."""
    drop_spare_storage(model)
    return _CAPTURED.pop(model, None) is not None


def fill(b: _Bucket, committed: Sequence[int], rows: Sequence[int], trees: Sequence[Tree]) -> None:
    """Write one step into ``b`` (CPU tensors): every row's ``committed`` length, and request
    i's tree (its tokens and parents) at row ``rows[i]``; the other rows (finished requests) are
    all padding. Two copies a request, none a node, and nothing read back from a tensor."""
    b.ids.zero_()
    b.parents.fill_(-1)
    b.committed.copy_(torch.as_tensor(committed, dtype=torch.int64))
    for r, tree in zip(rows, trees):
        n = tree.num_nodes
        b.ids[r, :n] = tree.tokens
        b.parents[r, :n] = tree.parents


def ancestor_masks(parents: torch.Tensor) -> torch.Tensor:
    """bool ``[R, N, N]`` from int64 ``parents`` ``[R, N]`` (-1: a root, or padding):
    ``mask[r, i, j]`` is True iff token j is token i or one of its ancestors, as
    :meth:`Tree.attention_mask` gives it. One step (a token and its parent) squared until it
    spans the longest possible path: ``log2(N)`` products of fixed shape, no loop over depths
    (whose count a tensor holds) and no read back to the host. fp32 products of 0/1 entries
    are exact (sums of at most N ones)."""
    R, N = parents.shape
    idx = torch.arange(N, device=parents.device)
    reach = ((parents[:, :, None] == idx) | (idx[:, None] == idx)).float()  # [R, N, N]: itself and its parent
    for _ in range((N - 1).bit_length()):  # paths of up to 2, 4, ... steps: 2^k >= N - 1 at the end
        reach = (reach @ reach > 0).float()
    return reach > 0


def tree_rows_mask(committed: torch.Tensor, tree_mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """bool ``[R, 1, N, C]``: which of its row's C keys each node sees. Key j: the committed
    prefix (``j < committed[r]``), then the bucket's own keys (``tree_mask[r, i, j - committed[r]]``),
    nothing past them. Tensor operations only, of shapes fixed by the bucket and the capacity."""
    R, N, _ = tree_mask.shape
    rel = torch.arange(capacity, device=committed.device)[None] - committed[:, None]  # [R, C]
    local = tree_mask.gather(2, rel.clamp(0, N - 1)[:, None, :].expand(R, N, capacity))  # [R, N, C]
    own = (rel >= 0) & (rel < N)
    return ((rel < 0)[:, None, :] | (own[:, None, :] & local))[:, None]


@dataclass(eq=False)
class _RowsBatch:
    """What the attention layers of one fixed-shape forward read (treespec_attention's
    ``treespec_batch``: ``cache``, ``write_slots`` and ``backend`` as a ForwardBatch has them)."""

    cache: PagedKVCache
    write_slots: torch.Tensor  # int64 [R * N]: flat cache slot of every bucket token
    backend: "FixedRowsAttention"
    mask: torch.Tensor  # bool [R, 1, N, K]
    positions: torch.Tensor  # int64 [R, N]: the bucket's RoPE positions (sliding windows)
    committed: torch.Tensor  # int64 [R]
    keys: int  # K, each row's first keys that a layer attends over (a symbolic size when compiled)


class FixedRowsAttention:
    """Attention of a fixed-shape forward: each row's N queries over the row's first K keys
    (K <= C, the batch's ``keys``), read as one strided view of the cache's block of rows (no
    gather), fp32 on a CPU as :class:`~treespec.attention.TorchBackend` attends there."""

    name = "fixed-rows"

    def __init__(self, first: int, rows: int, capacity: int):
        self.first, self.rows, self.capacity = first, rows, capacity  # block: row r at first + r * capacity

    def run(self, batch: _RowsBatch, layer: int, q: torch.Tensor, scaling: float, sliding_window=None):
        """``q`` ``[R * N, H, D]`` -> ``[R * N, H, D]``; the layer's new K/V are already cached."""
        R, C, K = self.rows, self.capacity, batch.keys
        N, H, D = q.shape[0] // R, q.shape[1], q.shape[2]
        dtype = torch.float32 if q.device.type == "cpu" else q.dtype
        fk, fv = batch.cache.flat(layer)
        k = fk[self.first: self.first + R * C].view(R, C, *fk.shape[1:])[:, :K].transpose(1, 2).to(dtype)  # [R, Hkv, K, D]
        v = fv[self.first: self.first + R * C].view(R, C, *fv.shape[1:])[:, :K].transpose(1, 2).to(dtype)
        qp = q.to(dtype).view(R, N, H, D).transpose(1, 2)  # [R, H, N, D]
        mask = batch.mask if sliding_window is None else _windowed(batch, sliding_window, K)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != H)
        return out.to(q.dtype).transpose(1, 2).reshape(R * N, H, D)


def _windowed(batch: _RowsBatch, window: int, keys: int) -> torch.Tensor:
    """The batch's mask narrowed to a sliding window (transformers' convention, as the torch
    backend's: a query at position p sees keys at positions > p - window). A key's position is
    its index in the prefix, its node's position in the bucket; a node always sees itself."""
    R, N = batch.positions.shape
    rel = torch.arange(keys, device=batch.positions.device)[None] - batch.committed[:, None]  # [R, K]
    in_bucket = batch.positions.gather(1, rel.clamp(0, N - 1))
    key_pos = torch.where(rel < 0, rel + batch.committed[:, None], in_bucket)  # [R, K]
    near = batch.positions[:, :, None] - key_pos[:, None, :] < window  # [R, N, K]
    return batch.mask & near[:, None]


@dataclass(eq=False)
class Accepted:
    """A fixed-shape verify that also accepted (``FixedShapeVerify(accept=True)``): each
    request's verdict, the K/V of its path already moved to the positions right after its
    committed ones (what :meth:`PagedKVCache.commit` of those positions keeps in place), and,
    when features were captured, the features at its path's nodes, root first
    (``[N, F]`` a request: the first ``len(path)`` rows are the path's)."""

    verdicts: list[Verdict]
    features: list[torch.Tensor] | None


class FixedShapeVerify:
    """The loop's verify forward on fixed shapes, over one cache's block of rows.

    Built once per request cache (its buffers live as long as the rows); :meth:`forward` takes
    the arguments the loop's tree forward has and returns what :meth:`ModelRunner.forward`
    returns (with ``accept``, the verdicts: :class:`Accepted`), falling back to it for a tree
    past the largest bucket or past its row.

    Args:
        runner:  the target's :class:`~treespec.runner.ModelRunner`; forwards run while it is
                 attached.
        cache:   the loop's cache, its sequences in one block of rows
                 (:meth:`~treespec.kv_cache.PagedKVCache.with_rows`).
        seqs:    the block's sequences.
        compile: run the forward through ``torch.compile(dynamic=False)``.
        buckets: the tree sizes a forward is padded to (ascending).
        accept:  greedy requests with no processors: the forward also takes the target's argmax at
                 every token, applies the acceptance rule and moves the accepted path's K/V into
                 place (:func:`~treespec.accept.accept_fixed`, :meth:`PagedKVCache.move`), all
                 inside the compiled or captured body, and reads back one small tensor a step:
                 :meth:`forward` then returns :class:`Accepted`.
        sampling: with ``accept``, the decoding of each sequence that samples (seq -> its
                 :class:`~treespec.accept.RequestDecoding`; the others greedy): the choice at each
                 token is then its warped scores' and its position's noise's
                 (``treespec/device_sampling.py``). ValueError when a decoding's processors are not
                 only the warpers that module applies.
        graphs:  capture each bucket's forward in a CUDA graph on first use (or in
                 :meth:`precompile`) and replay it; the graphs outlive this object, for the
                 model's next cache on the same storage (:class:`_Rows`). The outputs of a
                 replay hold until the next forward.
    """

    def __init__(self, runner, cache: PagedKVCache, seqs: Sequence[int], compile: bool = False,
                 buckets: Sequence[int] = BUCKETS, accept: bool = False, graphs: bool = False,
                 sampling: dict[int, RequestDecoding] | None = None):
        block = cache.block_rows(seqs, 0)
        if block is None or not seqs:
            raise ValueError("the verify forward on fixed shapes needs the cache's sequences in one block of rows "
                             "(PagedKVCache.with_rows)")
        if compile and graphs:
            raise ValueError("the fixed-shape verify runs compiled (compile) or captured in CUDA graphs (graphs), "
                             "not both")
        first, stride, rows = block
        self.runner, self.cache, self.buckets = runner, cache, tuple(sorted(buckets))
        self.row_of = dict(zip(seqs, rows))
        R = max(rows) + 1
        self.attention = FixedRowsAttention(first, R, stride)
        self.committed = [0] * R  # each row's committed length at its last forward (host ints)
        self._rows = _rows_for(runner, cache, first, R, stride, graphs)
        if compile and runner.feature_layers:
            _install_output_hooks(runner.model)
        self.compiled, self.accepts, self.graphs = compile, accept, graphs
        self._uses = self._set_sampling(runner, sampling) if sampling else None
        if self._uses is not None:  # a key of its own: the compiled or captured body differs
            self.accepts = ":".join(["sample", *sorted(self._uses)])
        self._layers = tuple(runner.feature_layers or ())  # with the bucket, features and acceptance: a graph's key
        # On a CPU each forward attends over the longest row's keys rounded up to KEY_STEP, a size
        # the compiled forward takes as symbolic (one compile serves every length); a CUDA graph
        # replays fixed shapes, so there every forward attends over the whole row.
        self.narrow = cache.device.type == "cpu" and not graphs
        self._spans: dict[int, torch.Tensor] = {}  # K -> a tensor of K elements, the forward's key count
        options = cpu_options(runner.dtype) if cache.device.type == "cpu" else {}
        self._run = self._replay if graphs else self._body
        if compile:  # one compiled body per model and device, its graphs for every instance
            body = compile_for_model(FixedShapeVerify._body, runner.model, cache.device.type, options, dynamic=False)
            self._run = functools.partial(body, self)
        # whose kernels a compiled forward runs: inductor's GEMM templates on frozen weights, or
        # ATen's and oneDNN's called from the graph (the cost curves' cache key tells them apart)
        self.kernels = "inductor-gemm" if compile and options else "cuda-graphs" if graphs else "aten"
        self.fixed_forwards = self.fallbacks = 0  # how forwards ran (tests, logs)

    def _set_sampling(self, runner, sampling: dict[int, RequestDecoding]) -> frozenset[str]:
        """The rows' warpers and seeds set from ``sampling`` (the rows' buffers made on first use);
        returns the warpers any row applies."""
        if not self.accepts:
            raise ValueError("sampling on the device is acceptance inside the forward: pass accept=True")
        warps = {}
        for seq, decoding in sampling.items():
            warps[self.row_of[seq]] = w = row_warp(decoding)
            if w is None:
                raise ValueError("acceptance on the device applies temperature, top-k, top-p and min-p alone, in "
                                 f"transformers' order; sequence {seq} has {decoding.processor.processors}: "
                                 "leave it to the host's rule (no sampling=)")
        if self._rows.sampling is None:
            self._rows.sampling = SamplingRows.empty(self.attention.rows, self.buckets[-1], runner.vocab_size,
                                                     self.cache.device)
        self._rows.sampling.set_rows(warps)
        return frozenset().union(*(w.uses for w in warps.values()))

    @torch.inference_mode()
    def precompile(self, tree_tokens: int, capture: bool) -> float:
        """Compile (or capture) now every bucket up to the one that holds ``tree_tokens`` (root
        included), for the forward with or without features (``capture``), so that no step waits
        for a compile: a forward of padding alone per bucket not yet compiled for this model and
        cache shape in this process (captured: for these rows). Returns the seconds it took (0
        when eager, or all were ready).

        Call it before the first step: the dummy forwards write K/V at the start of every row,
        positions that the prompt's prefill and the trees write again before anything reads them."""
        if not (self.compiled or self.graphs):
            return 0.0
        top = bucket_for(tree_tokens, self.buckets) or self.buckets[-1]
        model = self.runner.model
        kinds = frozenset(type(m).__name__ for m in model.modules())  # packed or not, quantized or not
        seen = _COMPILED.setdefault(model, set())
        start, done = time.perf_counter(), 0
        capture = capture and bool(self.runner.feature_layers)
        for n in (b for b in self.buckets if b <= top):
            key = (kinds, self.attention.rows, self.capacity, self.attention.first, n, capture, self.accepts)
            if (n, capture, self.accepts, self._layers) in self._rows.graphs or (key in seen and not self.graphs):
                continue
            device, _ = self._bucket(n)
            device.ids.zero_()
            device.parents.fill_(-1)
            device.committed.zero_()
            # a key count unlike any bucket's or the row's own: no size is taken for another
            self._run(device, self._span(self._keys(n) if not self.narrow else min(n + KEY_STEP + 1, self.capacity)),
                      capture, self.accepts)
            if not self.graphs:
                seen.add(key)
            done += 1
        seconds = time.perf_counter() - start if done else 0.0
        if done:
            log.info("%s the verify forward for %d bucket(s) up to %d tokens (row of %d) in %.1f s",
                     "captured" if self.graphs else "compiled", done, top, self.capacity, seconds)
        return seconds

    @property
    def capacity(self) -> int:
        """C, the positions of a row."""
        return self.attention.capacity

    @torch.inference_mode()
    def forward(self, seqs: Sequence[int], trees: Sequence[Tree], cached: Sequence[int],
                capture: bool = False) -> ForwardOutput | Accepted:
        """The target's logits (``[n_i, V]``) and, with ``capture``, features (``[n_i, F]``) at
        every node of request i's tree ``trees[i]``, in its sequence ``seqs[i]`` after
        ``cached[i]`` committed tokens: a :class:`~treespec.runner.ForwardOutput`; or, built
        with ``accept`` and on a bucket (not today's forward), the requests' verdicts:
        :class:`Accepted`."""
        N = bucket_for(max(t.num_nodes for t in trees), self.buckets)
        rows = [self.row_of.get(s) for s in seqs]
        for r, L in zip(rows, cached):
            if r is not None:
                self.committed[r] = L
        if N is None or None in rows or max(self.committed) + N > self.capacity:
            self.fallbacks += 1
            log.debug("fixed-shape verify: a tree of %d nodes does not fit; today's forward runs it",
                      max(t.num_nodes for t in trees))
            return self.runner.forward(self.cache, seqs, [t.tokens for t in trees],
                                       [t.position_ids(L) for t, L in zip(trees, cached)],
                                       [t.attention_mask() for t in trees], capture=capture)
        for s, t, L in zip(seqs, trees, cached):
            self.cache.reserve(s, L + t.num_nodes)  # inside the row: bookkeeping only
        device, host = self._bucket(N)
        host.wait()  # its last step's copy to the device
        fill(host, self.committed, rows, trees)
        if device is not host:
            device.copy_from(host)
        if self._uses is not None:
            self._rows.sampling.fill_noise(rows, cached, trees)
        capture = capture and bool(self.runner.feature_layers)
        logits, features, packed = self._run(device, self._span(self._keys(N)), capture, self.accepts)
        self.fixed_forwards += 1
        if packed is not None:  # the step's one read back
            kept = None if features is None else [features[r] for r in rows]
            return Accepted(verdicts_of(packed.tolist(), rows), kept)
        return _per_request(logits, features, rows, [t.num_nodes for t in trees])

    def _bucket(self, n: int) -> tuple[_Bucket, _Bucket]:
        buffers = self._rows.buffers
        if n not in buffers:
            R, dev = self.attention.rows, self.cache.device
            device = _Bucket.empty(R, n, dev)
            host = device if dev.type == "cpu" else _Bucket.empty(R, n, "cpu").pinned()
            buffers[n] = (device, host)
        return buffers[n]

    def _keys(self, n: int) -> int:
        """K, the keys a forward of bucket ``n`` attends over: the whole row, or narrowed, the
        longest row's committed prefix and bucket rounded up to :data:`KEY_STEP`."""
        if not self.narrow:
            return self.capacity
        return keys_in_use(max(self.committed) + n, self.capacity)

    def _span(self, k: int) -> torch.Tensor:
        """A tensor of ``k`` elements whose size is the forward's key count, dynamic when compiled."""
        if k not in self._spans:
            span = self._spans[k] = torch.empty(k, dtype=torch.uint8)
            if self.compiled and self.narrow:
                torch._dynamo.mark_dynamic(span, 0)
        return self._spans[k]

    def _replay(self, b: _Bucket, span: torch.Tensor, capture: bool, accept: bool):
        """:meth:`_body`'s outputs, from its CUDA graph for this bucket (captured on first use).
        Accepting, the logits are not kept: nothing reads them, and the pool reuses their memory."""
        key = (b.ids.shape[1], capture, accept, self._layers)
        held = self._rows.graphs.setdefault(key, _Captured(key))

        def body():
            logits, features, packed = self._body(b, span, capture, accept)
            held.outputs = (None if accept else logits, features, packed)

        replay(held, body, self._rows.pool, self.cache.device)
        return held.outputs

    def _body(self, b: _Bucket, span: torch.Tensor, capture: bool, accept: bool):
        """One forward of bucket ``b`` over the first ``len(span)`` keys of each row: logits
        ``[R, N, V]``, features ``[R, N, F]`` (None unless ``capture``) and, with ``accept``, the
        rows' verdicts (:func:`~treespec.accept.accept_fixed`'s ``[R, 1 + 2N]``; else None), the
        accepted paths' K/V moved into place and the features gathered at the paths' nodes. Reads
        only ``b``'s buffers and the cache: what a compile or a CUDA graph holds."""
        R, N = b.ids.shape
        slots = (self._rows.row_start + b.committed)[:, None] + torch.arange(N, device=b.ids.device)  # [R, N]
        tree_mask = ancestor_masks(b.parents)  # [R, N, N]
        depth = tree_mask.sum(-1) - 1  # [R, N]; padding: 0
        positions = b.committed[:, None] + depth
        K = span.shape[0]
        batch = _RowsBatch(self.cache, slots.reshape(-1), self.attention,
                           tree_rows_mask(b.committed, tree_mask, K), positions, b.committed, K)
        out = self.runner.model(input_ids=b.ids.view(1, R * N), position_ids=positions.view(1, R * N),
                                use_cache=False, output_hidden_states=capture, treespec_batch=batch)
        logits = out.logits.view(R, N, -1)
        features = None
        if capture:  # hidden_states[i]: what enters layer i; [-1]: the final norm's output (FINAL_NORM)
            features = torch.cat([out.hidden_states[fid] for fid in self.runner.feature_layers], dim=-1).view(R, N, -1)
        if not accept:
            return logits, features, None
        choices = (first_argmax(logits) if self._uses is None else
                   sampled_choices(logits, depth, self._rows.sampling, self._uses, first_argmax))
        packed = accept_fixed(choices, b.ids, b.parents, tree_mask)
        path = packed[:, 1: N + 1]
        self.cache.move(slots.gather(1, path), slots)  # row r's node path[j] to position committed + j
        if features is not None:
            features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
        return logits, features, packed


def _install_output_hooks(model) -> None:
    """transformers hooks a model for ``output_hidden_states`` on the first call that asks, under
    a lock torch.compile cannot trace (a graph break, then a recompile once the hooks are there):
    install them first. Versions without the function install nothing and compile as they can."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    maybe_install_capturing_hooks(model.get_decoder())


def _per_request(logits: torch.Tensor, features: torch.Tensor | None, rows: Sequence[int], n: Sequence[int]):
    """``[R, N, ...]`` outputs cut to each request's row and tree nodes."""
    return ForwardOutput([logits[r, :k] for r, k in zip(rows, n)],
                         None if features is None else [features[r, :k] for r, k in zip(rows, n)])
