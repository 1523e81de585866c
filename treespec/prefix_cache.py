"""Prefix caching: the K/V of prompt prefixes seen before, reused across requests and calls.

    cache = treespec.PrefixCache(max_bytes=2 * 2**30)
    treespec.generate(model, draft, "cpu", turn1, prefix_cache=cache)
    treespec.generate(model, draft, "cpu", turn1 + answer + turn2, prefix_cache=cache)  # turn 1 not recomputed

**The store.** A radix tree over token ids at page granularity: a node is one full page of P
token ids (P: the ``page_size`` of the calls the cache serves) under its parent, so the path
from the root spells a prefix. A node holds immutable copies of

- the target's K/V at its P positions, every layer: ``[P, 2, layers, Hkv, D]``;
- per drafter that keeps state of its own (an EAGLE head, a draft model; keyed by
  ``Drafter.prefix_key``): the drafter's rows for those positions, and for a drafter that
  reads target features, the target's features at the page's last position ``[F]``.

**The coupling.** A drafter's row t may depend only on tokens <= t, so that a page's rows hold
for every continuation of the page. An EAGLE head's entry i is built from token i+1's
embedding and the target's features at position i, so the head files entry i as row i+1 (row 0
is empty): the entry pairing a page's last position with the next token lives in the next
page's node, under that token. A hit of n tokens therefore brings every head entry below n-1;
entry n-1 is computed from the first uncached token and the feature kept at position n-1. The
first tree drafted after a hit is the tree drafted without the cache: no acceptance is lost.
(vLLM drops the last matched block and recomputes it; SGLang keys its tree on token pairs:
docs/runtime.md, "Prefix caching".)

**A hit** is the longest cached prefix of whole pages that also holds the drafter's state,
one token short of the prompt at least: the prompt's last position runs through the target
for the first token's logits (and features). So it is at most ``(len(prompt) - 1) // P * P``.

**Copies, not shared pages.** A generate call lays its requests out in one block of rows that
attention reads as a strided view (``PagedKVCache.add_sequences``); pages shared across calls
would break that layout. A hit is copied into the request's row (``PagedKVCache.load``), which
moves the hit's K/V once, far less work than the forward it replaces, and a request never
writes to a cached copy: copy-on-write by construction.

**Reference counts and eviction.** A request holds (locks) the nodes of its hit from prefill
until it ends, when its committed tokens (prompt and output, whole pages) are filed along the
same path: inserting another request's pages cannot evict a prefix a running request will
extend. Room is made by evicting the least recently used unlocked leaves. The budget counts
the bytes of the tensors held; a page that does not fit is not filed, so the cache never holds
more than ``max_bytes``.
"""

from __future__ import annotations

import heapq
import logging
import numbers
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .kv_cache import PagedKVCache

__all__ = ["PrefixCache", "PrefixUse", "DraftPrefix"]

log = logging.getLogger(__name__)

# A drafter's state for one page: its rows (name -> [P, ...]) and the target's features at the
# page's last position ([F], or None for a drafter that reads none).
PageState = tuple[dict[str, torch.Tensor], "torch.Tensor | None"]


@dataclass
class DraftPrefix:
    """Where a request's cached start ends, for its drafter (``DraftStart.prefix[b]``).

    Attributes:
        length:  n, the prompt tokens whose target K/V came from the cache (whole pages, fewer
                 than the prompt's).
        rows:    the drafter's own rows for tokens ``0 .. n-1`` (name -> ``[n, ...]``), as its
                 session's ``prefix_state`` filed them.
        feature: the target's features at position n-1 (``[F]``) for a drafter that reads
                 features, else None.
    """

    length: int
    rows: dict[str, torch.Tensor]
    feature: torch.Tensor | None = None


def _nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    return sum(_nbytes(v) for v in x)


class _Node:
    __slots__ = ("tokens", "parent", "children", "kv", "draft", "refs", "used", "nbytes")

    def __init__(self, tokens: tuple[int, ...], parent: "_Node | None", kv: torch.Tensor | None):
        self.tokens = tokens  # the page's P ids: its key under its parent
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.kv = kv  # [P, 2, layers, Hkv, D]; None at the root
        self.draft: dict[int, PageState] = {}  # drafter slot -> its state for this page
        self.refs = 0  # requests (and a filing in progress) holding this node
        self.used = 0  # tick of the last lookup or filing that passed through it (LRU)
        self.nbytes = _nbytes(kv)


class PrefixCache:
    """Prompt prefixes' K/V (and drafter state), kept across ``generate`` / ``stream`` calls.

    Pass the same cache as ``prefix_cache=`` to calls on one model; a later prompt that starts
    with a cached prefix copies it instead of running it through the model. The output is the
    same with or without the cache. See the module docstring for how it works.

    Args:
        max_bytes: the most bytes of tensors the cache holds (on the model's device): the
                   target's K/V of every cached page, plus the drafter's state. About
                   ``2 * layers * Hkv * D * element size`` bytes per token for the target
                   (SmolLM2-135M in fp32: 30 * 2 * 3 * 64 * 4 = 46 KB per token).

    The cache binds to the model (and the call's ``page_size``) it is first used with; using
    it with another model, another dtype or device of the model, or another page size raises
    a ValueError (:meth:`clear` empties it for another use; once the model is garbage, the next
    model empties it). It assumes the weights do not
    change while it holds their K/V: after training or editing the model or the draft head,
    call :meth:`clear`. Thread-safe.
    """

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Integral) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int (bytes of K/V the cache may hold, e.g. 2 * 2**30), "
                             f"got {max_bytes!r}")
        self.max_bytes = int(max_bytes)
        self._lock = threading.RLock()
        self._reset()

    def _reset(self) -> None:
        self._root = _Node((), None, None)
        self._nodes: set[_Node] = set()  # every node but the root
        self._bytes = 0
        self._tick = 0
        self._model = None  # weakref to the model it serves
        self._layout: dict | None = None
        self.page_size: int | None = None
        self._owners: list[tuple[Callable | None, tuple]] = []  # drafter slot -> (weakref to owner, details)
        self._counts = dict(lookups=0, hit_tokens=0, filed_pages=0, evicted_pages=0)

    # ---- what it holds -------------------------------------------------------------------

    @property
    def bytes(self) -> int:
        """Bytes of tensors held now (never more than ``max_bytes``)."""
        return self._bytes

    @property
    def num_pages(self) -> int:
        return len(self._nodes)

    def stats(self) -> dict:
        """``bytes``, ``max_bytes``, ``pages`` (nodes), ``page_size``, ``pages_in_use`` (held by
        running requests), and counts since creation or :meth:`clear`: ``lookups``,
        ``hit_tokens`` (prompt tokens served from the cache), ``filed_pages``, ``evicted_pages``."""
        with self._lock:
            return dict(bytes=self._bytes, max_bytes=self.max_bytes, pages=len(self._nodes), page_size=self.page_size,
                        pages_in_use=sum(1 for n in self._nodes if n.refs), **self._counts)

    def clear(self) -> None:
        """Drop every page and the binding to a model. Refused while a generation holds pages."""
        with self._lock:
            if any(n.refs for n in self._nodes):
                raise RuntimeError("this PrefixCache is in use by a running generation: finish it (or close the "
                                   "stream) before clearing the cache")
            self._reset()

    def check(self) -> None:
        """Raise AssertionError when the accounting does not balance: the bytes counted equal
        the bytes held and fit the budget, every node hangs once under the root, no reference
        count is negative, and a drafter's state is present on a node only when present on its
        parent (a hit may stop at any node). For tests and the soak."""
        with self._lock:
            seen, stack, total = set(), [self._root], 0
            while stack:
                node = stack.pop()
                for key, child in node.children.items():
                    if child.parent is not node or child.tokens != key or len(key) != self.page_size:
                        raise AssertionError("a node hangs under the wrong parent or key")
                    if child in seen:
                        raise AssertionError("a node is reachable twice")
                    seen.add(child)
                    if child.refs < 0:
                        raise AssertionError(f"negative reference count {child.refs}")
                    if node is not self._root and not set(child.draft) <= set(node.draft):
                        raise AssertionError("a drafter's state on a node whose parent lacks it")
                    if child.nbytes != _nbytes(child.kv) + sum(_nbytes(s) for s in child.draft.values()):
                        raise AssertionError("a node's byte count is not its tensors' bytes")
                    total += child.nbytes
                    stack.append(child)
            if seen != self._nodes:
                raise AssertionError(f"{len(self._nodes)} nodes listed, {len(seen)} reachable")
            if total != self._bytes or self._bytes > self.max_bytes:
                raise AssertionError(f"bytes counted {self._bytes}, held {total}, budget {self.max_bytes}")

    def __repr__(self) -> str:
        return (f"PrefixCache({len(self._nodes)} pages of {self.page_size} tokens, "
                f"{self._bytes} of {self.max_bytes} bytes)")

    # ---- binding -------------------------------------------------------------------------

    def bind(self, model, page_size: int, layout: dict) -> None:
        """Serve ``model`` with pages of ``page_size`` tokens; ``layout`` describes its K/V
        (shapes, dtypes, device). The first call binds; later ones must match."""
        with self._lock:
            if self._model is not None and self._model() is None and not any(n.refs for n in self._nodes):
                log.info("prefix cache: the model it was filled with is gone; emptied for another")
                self._reset()
            if self._model is None:
                self._model, self.page_size, self._layout = weakref.ref(model), int(page_size), dict(layout)
                return
            if self._model() is not model:
                raise ValueError("this PrefixCache holds the K/V of another model: K/V are reusable only with the "
                                 "model that computed them. Use one PrefixCache per model (or cache.clear() first)")
            if page_size != self.page_size:
                raise ValueError(f"this PrefixCache holds pages of {self.page_size} tokens and this call's "
                                 f"page_size is {page_size}: pass page_size={self.page_size}, or use another cache")
            if dict(layout) != self._layout:
                diff = {k: (self._layout.get(k), v) for k, v in layout.items() if self._layout.get(k) != v}
                raise ValueError(f"the model's K/V changed since this PrefixCache was filled ({diff}, as (then, now)): "
                                 "a model cast to another dtype or moved to another device computes other K/V. "
                                 "Call cache.clear() first")

    def slot(self, key: tuple) -> int:
        """The slot of a drafter's state, from its ``prefix_key``: ``(owner, *details)``, the
        owner (the module whose state it is) compared by identity and held weakly, the details
        by equality."""
        owner, details = key[0], tuple(key[1:])
        with self._lock:
            for i, (ref, d) in enumerate(self._owners):
                if ref is not None and ref() is owner and d == details:
                    return i
            dead = {i for i, (ref, _) in enumerate(self._owners) if ref is not None and ref() is None}
            if dead:  # a drafter gone: its state can never be read again
                for i in dead:
                    self._owners[i] = (None, ())
                for node in self._nodes:
                    for i in dead & set(node.draft):
                        size = _nbytes(node.draft.pop(i))
                        node.nbytes -= size
                        self._bytes -= size
            try:
                ref = weakref.ref(owner)
            except TypeError:  # not weakly referable: held for the cache's life
                ref = (lambda o: lambda: o)(owner)
            self._owners.append((ref, details))
            return len(self._owners) - 1

    # ---- lookups and filing --------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int, slot: int | None) -> list[_Node]:
        """The nodes of the longest cached prefix of ``tokens`` of at most ``limit`` tokens
        whose every page holds drafter ``slot``'s state (None: the target's alone); they are
        held until :meth:`release`."""
        P = self.page_size
        with self._lock:
            self._tick += 1
            node, path = self._root, []
            for i in range(max(limit, 0) // P):
                child = node.children.get(tuple(tokens[i * P: (i + 1) * P]))
                if child is None or (slot is not None and slot not in child.draft):
                    break
                path.append(child)
                node = child
            for n in path:
                n.refs += 1
                n.used = self._tick
            self._counts["lookups"] += 1
            self._counts["hit_tokens"] += len(path) * P
            return path

    def release(self, path: Sequence[_Node]) -> None:
        with self._lock:
            for n in path:
                if n.refs <= 0:
                    raise RuntimeError("a PrefixCache page was released more often than it was held")
                n.refs -= 1

    def insert(self, tokens: Sequence[int], path: Sequence[_Node], read_kv: Callable[[int, int], torch.Tensor],
               slot: int | None = None, rows: dict[str, torch.Tensor] | None = None,
               ends: dict[int, torch.Tensor] | None = None) -> int:
        """File the whole pages of ``tokens`` past ``path`` (the caller's held hit, a prefix of
        ``tokens``); returns the pages added. Pages already cached are kept as they are (and
        given drafter ``slot``'s state where they lack it).

        Args:
            tokens:  token ids with committed K/V (the caller cuts them to the committed length).
            read_kv: ``read_kv(start, end)`` -> the target's K/V at those positions,
                     ``[end - start, 2, layers, Hkv, D]`` (called once, for the pages to add).
            slot, rows: the drafter's slot and its rows for positions ``s ..`` on, where
                     ``s = len(path) * P`` (name -> ``[R, ...]``); pages past ``s + R`` get
                     no drafter state (nor any page after them).
            ends:    page index -> the target's features at its last position, for a drafter
                     that reads features (None: it reads none).
        """
        # long: one walk down the tree that reads, makes room for and files each page in turn
        P = self.page_size
        start, end = len(path) * P, len(tokens) // P * P
        with self._lock:
            self._tick += 1
            node = path[-1] if path else self._root
            draft = slot is not None and rows is not None
            held, kv, kv_from, added = [], None, 0, 0
            try:
                for a in range(start, end, P):
                    key = tuple(tokens[a: a + P])
                    child = node.children.get(key)
                    state = None
                    if draft and (child is None or slot not in child.draft):
                        state = self._page_state(rows, ends, a - start, a // P)
                        draft = state is not None
                    if child is None:
                        if kv is None:
                            kv, kv_from = read_kv(a, end), a
                        child = _Node(key, node, kv[a - kv_from: a - kv_from + P].clone())
                        if not self._make_room(child.nbytes + _nbytes(state)):
                            log.debug("prefix cache: %d bytes do not fit a budget of %d (the rest held); "
                                      "%d of %d tokens filed", child.nbytes + _nbytes(state), self.max_bytes, a, end)
                            break
                        node.children[key] = child
                        self._nodes.add(child)
                        self._bytes += child.nbytes
                        added += 1
                    child.refs += 1  # held until the filing ends: making room later must not evict it
                    child.used = self._tick
                    held.append(child)
                    if state is not None and self._make_room(_nbytes(state)):
                        child.draft[slot] = state
                        child.nbytes += _nbytes(state)
                        self._bytes += _nbytes(state)
                    draft = draft and slot in child.draft  # a drafter's state only under its state
                    node = child
            finally:
                for n in held:
                    n.refs -= 1
            self._counts["filed_pages"] += added
            return added

    def _page_state(self, rows: dict[str, torch.Tensor], ends: dict[int, torch.Tensor] | None, offset: int,
                    page: int) -> PageState | None:
        """The drafter's state for the page whose rows start at ``offset``, copied; None when
        ``rows`` or ``ends`` do not cover it."""
        P = self.page_size
        if any(t.shape[0] < offset + P for t in rows.values()):
            return None
        feature = None
        if ends is not None:
            feature = ends.get(page)
            if feature is None:
                return None
        return {k: t[offset: offset + P].clone() for k, t in rows.items()}, feature

    def _make_room(self, need: int) -> bool:
        """Evict least recently used unheld leaves until ``need`` more bytes fit the budget."""
        if self._bytes + need <= self.max_bytes:
            return True
        if need > self.max_bytes:
            return False
        heap = [(n.used, id(n), n) for n in self._nodes if not n.children and n.refs == 0]
        heapq.heapify(heap)
        while self._bytes + need > self.max_bytes and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.tokens]
            self._nodes.discard(leaf)
            self._bytes -= leaf.nbytes
            self._counts["evicted_pages"] += 1
            if parent is not self._root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.used, id(parent), parent))
        return self._bytes + need <= self.max_bytes


class PrefixUse:
    """One generation's use of a :class:`PrefixCache`: the hit of each request, the target
    features kept at page ends as tokens are committed, and the filing of each request when it
    ends. Without a cache (``cache=None``) every hit is 0 and every method does nothing.

    Args:
        cache:    the cache, bound to the model already (:meth:`PrefixCache.bind`), or None.
        key:      the drafter's ``prefix_key`` (None: it keeps no state of its own).
        lookup:   False: file requests but serve no hit (a drafter that reads target features
                  and cannot start from a cached prefix).
        features: the drafter reads target features (kept at page ends for later hits).
    """

    def __init__(self, cache: PrefixCache | None, key: tuple | None = None, lookup: bool = True,
                 features: bool = False):
        self.cache = cache
        self.slot = cache.slot(key) if cache is not None and key is not None else None
        self.lookup = lookup
        self.features = features and self.slot is not None
        self.hits: list[int] = []
        self._paths: dict[int, list[_Node]] = {}  # request -> the nodes it holds
        self._ends: dict[int, dict[int, torch.Tensor]] = {}  # request -> page -> feature at its end

    def load(self, kv_cache: PagedKVCache, seqs: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Copy each prompt's hit into its sequence (empty until now); returns the hit lengths."""
        self.hits = [0] * len(prompts)
        if self.cache is None:
            return self.hits
        P = self.cache.page_size
        for b, (seq, prompt) in enumerate(zip(seqs, prompts)):
            path = self.cache.match(prompt, len(prompt) - 1 if self.lookup else 0, self.slot)
            self._paths[b] = path
            self._ends[b] = {}
            if path:
                kv_cache.load(seq, torch.cat([n.kv for n in path]))
            self.hits[b] = len(path) * P
        return self.hits

    def draft_prefixes(self) -> list[DraftPrefix | None] | None:
        """``DraftStart.prefix``: per request its :class:`DraftPrefix` (None: no hit); None
        for a drafter without state of its own."""
        if self.slot is None:
            return None
        out = []
        for b in range(len(self.hits)):
            states = [n.draft[self.slot] for n in self._paths.get(b, [])]
            if not states:
                out.append(None)
                continue
            rows = {name: torch.cat([s[0][name] for s in states]) for name in states[0][0]}
            out.append(DraftPrefix(self.hits[b], rows, states[-1][1]))
        return out

    def record(self, requests: Sequence[int], starts: Sequence[int], features: Sequence[torch.Tensor] | None) -> None:
        """Committed target features: ``features[i]`` ``[n_i, F]`` at positions ``starts[i]``
        on of request ``requests[i]``; those at page ends are kept for filing."""
        if not self.features or features is None:
            return
        P = self.cache.page_size
        for b, start, f in zip(requests, starts, features):
            first = start + (P - 1 - start % P)  # the first page end at or after start
            for p in range(first, start + f.shape[0], P):
                self._ends[b][p // P] = f[p - start].clone()

    def file(self, request: int, kv_cache: PagedKVCache, seq: int, tokens: Sequence[int],
             draft_rows: Callable[[int], dict[str, torch.Tensor] | None]) -> None:
        """Request ``request`` ended: file its committed tokens' whole pages (``tokens``: its
        prompt and output; ``draft_rows(start)``: the drafter's rows from ``start`` on) and
        let go of its hit."""
        if self.cache is None:
            return
        path = self._paths.pop(request, [])
        try:
            n = kv_cache.seq_lens[seq]
            start = len(path) * self.cache.page_size
            if n // self.cache.page_size > len(path):
                self.cache.insert(tokens[:n], path, lambda a, e: kv_cache.read(seq, a, e), self.slot,
                                  draft_rows(start) if self.slot is not None else None,
                                  self._ends.pop(request, {}) if self.features else None)
        finally:
            self.cache.release(path)

    def close(self) -> None:
        """Let go of every hit still held (requests that never ended: an error, a stream
        closed early)."""
        if self.cache is not None:
            for path in self._paths.values():
                self.cache.release(path)
        self._paths.clear()
        self._ends.clear()
