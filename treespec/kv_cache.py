"""treespec's paged KV cache.

Every layer has one K and one V tensor in FlashInfer's NHD layout,
``[num_pages, page_size, Hkv, D]``, views of one tensor that holds every layer's (so that a
commit moves the accepted entries of all layers with one indexed copy). A sequence owns a
page table; its logical position p lives in page ``table[p // page_size]`` at offset
``p % page_size``, i.e. at the flat slot
``table[p // page_size] * page_size + p % page_size`` of the ``[num_pages * page_size,
Hkv, D]`` view.

A step's life cycle for one sequence of committed length L:
    reserve(seq, L + n)  lookahead slots for the n tree tokens (pages allocated on demand)
    (the forward writes the tree's K/V at logical positions L .. L+n-1)
    commit(seq, keep)    move the KV of the accepted nodes (logical positions ``keep``) to
                         L .. L+len(keep)-1; later slots are free again, whole pages go back
                         to the pool. Nothing of the prefix is ever recomputed.

Across calls (prefix caching, :mod:`treespec.prefix_cache`): ``read(seq, start, end)`` copies
committed K/V out as ``[n, 2, layers, Hkv, D]`` and ``load(seq, kv)`` commits such a copy as
the first positions of an empty sequence.
"""

from __future__ import annotations

import math

import torch

__all__ = ["PagedKVCache", "CacheFullError", "as_slice"]


@torch.library.custom_op("treespec::move_slots", mutates_args=("layers",))
def move_slots(layers: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """``layer[dst] = layer[src]`` for each of ``layers`` (``[slots, ...]``), the rows read into a
    copy first: :meth:`PagedKVCache.move` inside a compiled graph."""
    for t in layers:
        t.index_copy_(0, dst, t.index_select(0, src))


@move_slots.register_fake
def _(layers, src, dst) -> None:
    return None


class CacheFullError(RuntimeError):
    pass


def as_slice(slots: torch.Tensor) -> torch.Tensor | slice:
    """``slots`` as a ``slice`` when they are consecutive (one request whose pages came out
    of the pool in order, the common case), else unchanged. Indexing the cache with a slice
    reads a view and writes with one copy, where a tensor index gathers or scatters:
    ``[176, 3, 64]`` bf16, 27 us as a gather, 2 us as a view (AMD EPYC, one thread)."""
    n = slots.numel()
    if slots.dim() == 1 and n and int(slots[-1]) - int(slots[0]) == n - 1 and (n == 1 or bool((slots.diff() == 1).all())):
        return slice(int(slots[0]), int(slots[0]) + n)
    return slots


class PagedKVCache:
    """Paged K/V storage for ``num_layers`` layers of ``num_kv_heads x head_dim``."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        storage: torch.Tensor | None = None,
    ):
        if min(num_layers, num_kv_heads, head_dim, num_pages, page_size) < 1:
            raise ValueError("cache dimensions must be >= 1")
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        # One tensor for all layers, so that moving a sequence's entries (commit) is one indexed
        # copy, not one per layer; ``k[layer]`` and ``v[layer]`` are views of it, the layout the
        # backends read (tuples: the storage is fixed, a layer cannot be swapped for another).
        # ``storage``: an earlier cache's (:attr:`storage`), taken when it holds at least this
        # one's elements, of its dtype and device: its first elements are zeroed and used (see
        # ModelRunner.release_cache); else a new one.
        need = 2 * math.prod(shape)
        fits = (storage is not None and storage.dim() == 1 and storage.is_contiguous() and storage.numel() >= need
                and storage.dtype == dtype and storage.device == torch.device(device)
                # one made under inference_mode can be written only there
                and (torch.is_inference_mode_enabled() or not storage.is_inference()))
        self._storage = storage if fits else torch.empty(need, dtype=dtype, device=device)
        self._kv = self._storage[:need].view(2, *shape).zero_()
        self.k = tuple(self._kv[0][layer] for layer in range(num_layers))
        self.v = tuple(self._kv[1][layer] for layer in range(num_layers))
        self._flat = [(k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])) for k, v in zip(self.k, self.v)]
        self.device = torch.device(device)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self.page_tables: list[list[int]] = []
        self.seq_lens: list[int] = []
        self._pinned: list[int] = []  # per sequence: leading pages kept until free_sequence
        self._block: tuple[int, int] | None = None  # add_sequences: (first flat slot, slots per row)
        self._row: dict[int, int] = {}  # sequence -> its row of the block

    # ---- sequences ----------------------------------------------------------------------

    def add_sequence(self) -> int:
        self.page_tables.append([])
        self.seq_lens.append(0)
        self._pinned.append(0)
        return len(self.seq_lens) - 1

    def add_sequences(self, count: int, tokens: int) -> list[int]:
        """``count`` new sequences whose first ``tokens`` positions lie in one block of
        consecutive pages, one equal row per sequence: sequence ``i``'s position ``p`` is the
        flat slot ``first + i * stride + p``. A backend can then read a batch's K/V as one
        strided view where it would otherwise gather them (``[32, 300, 3, 64]`` fp32 K and V:
        2.7 ms of gathering per layer, AMD EPYC, 2 threads). The rows stay reserved until
        :meth:`free_sequence`; a sequence that outgrows its row takes pages from the pool as
        usual and is gathered from then on. One block per cache."""
        if self._block is not None:
            raise ValueError("this cache already holds a block of rows (one add_sequences per cache)")
        pages = max(1, -(-int(tokens) // self.page_size))
        need = count * pages
        free = sorted(self._free)
        start = next((free[i] for i in range(len(free) - need + 1) if free[i + need - 1] - free[i] == need - 1),
                     None) if need else 0
        if start is None:
            raise CacheFullError(
                f"KV cache: no {need} consecutive free pages for {count} sequences of {tokens} tokens "
                f"({len(self._free)} pages free)"
            )
        taken = set(range(start, start + need))
        self._free = [p for p in self._free if p not in taken]
        seqs = []
        for i in range(count):
            seq = self.add_sequence()
            self.page_tables[seq] = list(range(start + i * pages, start + (i + 1) * pages))
            self._pinned[seq] = pages
            self._row[seq] = i
            seqs.append(seq)
        self._block = (start * self.page_size, pages * self.page_size)
        return seqs

    @property
    def storage(self) -> torch.Tensor:
        """The flat tensor whose first elements hold every layer's K/V (:attr:`kv`): what a
        later cache of this size or smaller can be made on (``storage=``)."""
        return self._storage

    @property
    def kv(self) -> torch.Tensor:
        """Every layer's K/V, ``[2, layers, pages, page_size, Hkv, D]``."""
        return self._kv

    @classmethod
    def with_rows(cls, num_layers: int, num_kv_heads: int, head_dim: int, count: int, tokens: int,
                  page_size: int = 16, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", storage: torch.Tensor | None = None,
                  ) -> tuple["PagedKVCache", list[int]]:
        """A cache of ``count`` sequences in one block of rows of ``tokens`` positions each
        (:meth:`add_sequences`), plus a spare page per sequence; returns it and the sequences.
        ``storage``: an earlier cache's, reused when it is at least this one's size."""
        pages = max(1, -(-int(tokens) // page_size))
        cache = cls(num_layers, num_kv_heads, head_dim, count * (pages + 1), page_size, dtype, device, storage)
        return cache, cache.add_sequences(count, tokens)

    def block_rows(self, seqs, length: int) -> tuple[int, int, list[int]] | None:
        """``(first slot, stride, rows)``: where sequences ``seqs`` hold their first ``length``
        positions in the block of :meth:`add_sequences` (position ``p`` of ``seqs[b]`` is the
        flat slot ``first + rows[b] * stride + p``); None when one of them does not."""
        if self._block is None or length > self._block[1]:
            return None
        rows = [self._row.get(s) for s in seqs]
        if any(r is None for r in rows):
            return None
        return self._block[0], self._block[1], rows

    def free_sequence(self, seq: int) -> None:
        self._free.extend(reversed(self.page_tables[seq]))
        self.page_tables[seq] = []
        self.seq_lens[seq] = 0
        self._pinned[seq] = 0
        self._row.pop(seq, None)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def capacity(self, seq: int) -> int:
        """Tokens sequence ``seq`` could hold now: its pages plus every free page."""
        return (len(self.page_tables[seq]) + len(self._free)) * self.page_size

    def reserve(self, seq: int, length: int) -> None:
        """Make logical positions ``[0, length)`` of ``seq`` addressable."""
        need = -(-length // self.page_size) - len(self.page_tables[seq])
        if need > len(self._free):
            raise CacheFullError(
                f"KV cache full: sequence {seq} needs {need} more pages of {self.page_size} "
                f"tokens, {len(self._free)} free"
            )
        for _ in range(max(need, 0)):
            self.page_tables[seq].append(self._free.pop())

    def slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        """int64 flat slots of logical ``positions`` of ``seq`` (on the cache's device)."""
        return self._cpu_slots(seq, positions).to(self.device)

    def _cpu_slots(self, seq: int, positions) -> torch.Tensor:
        positions = torch.as_tensor(positions, dtype=torch.int64).cpu()
        table = torch.tensor(self.page_tables[seq], dtype=torch.int64)
        if positions.numel() and int(positions.max()) >= table.numel() * self.page_size:
            raise IndexError(f"position {int(positions.max())} of sequence {seq} is not reserved")
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def span(self, seq: int, start: int, end: int) -> torch.Tensor:
        return self.slots(seq, torch.arange(start, end))

    # ---- data ---------------------------------------------------------------------------

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` as ``[num_pages * page_size, Hkv, D]`` views (made once: a
        forward asks for them in every layer)."""
        return self._flat[layer]

    def write(self, layer: int, slots: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[T, Hkv, D]`` at flat ``slots`` (int64 ``[T]`` or a slice)."""
        fk, fv = self.flat(layer)
        fk[slots] = k.to(fk.dtype)
        fv[slots] = v.to(fv.dtype)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V at flat slots ``src`` to flat slots ``dst`` (int64 tensors of
        one shape): one indexed read and one indexed write for all layers, nothing read back to
        the host, so a compiled or captured step can compact its tree's K/V itself. The read
        copies first: ``src`` and ``dst`` may overlap. The bookkeeping is the caller's
        (:meth:`commit` of the positions then in place)."""
        src, dst = src.reshape(-1), dst.reshape(-1)
        if not torch.compiler.is_compiling():
            every = self._kv.view(2, len(self.k), -1, *self._kv.shape[4:])  # [2, layers, slots, Hkv, D]
            every.index_copy_(2, dst, every.index_select(2, src))
            return
        # Compiled: one opaque operation over the views the forward writes (another alias of the
        # storage as an input of the graph breaks inductor's frozen graphs), so that the read is a
        # copy made before any write: a fused read-and-write kernel would race where the path skips.
        move_slots([t for kv in self._flat for t in kv], src, dst)

    def gather(self, layer: int, slots: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at flat ``slots`` (any shape of int64 indices; a slice gives views)."""
        fk, fv = self.flat(layer)
        return fk[slots], fv[slots]

    def read(self, seq: int, start: int, end: int) -> torch.Tensor:
        """A copy of the K/V at logical positions ``start .. end-1`` of ``seq``:
        ``[end - start, 2, num_layers, Hkv, D]`` (index 0 of dim 1 is K, 1 is V)."""
        if not 0 <= start <= end <= self.seq_lens[seq]:
            raise ValueError(f"positions {start}..{end} are not committed in sequence {seq} "
                             f"(length {self.seq_lens[seq]})")
        slots = as_slice(self.span(seq, start, end))
        return torch.stack([torch.stack(self.gather(layer, slots), 1) for layer in range(len(self.k))], 2)

    def load(self, seq: int, kv: torch.Tensor) -> None:
        """Commit ``kv`` ``[n, 2, num_layers, Hkv, D]`` (as :meth:`read` gives it) as positions
        ``0 .. n-1`` of the empty sequence ``seq``."""
        if self.seq_lens[seq]:
            raise ValueError(f"load needs an empty sequence; sequence {seq} holds {self.seq_lens[seq]} tokens")
        want = (2, len(self.k), *self.k[0].shape[2:])
        if kv.dim() != 5 or tuple(kv.shape[1:]) != want:
            raise ValueError(f"K/V of shape {tuple(kv.shape)} do not fit this cache: "
                             f"expected [n, {', '.join(map(str, want))}]")
        n = kv.shape[0]
        self.reserve(seq, n)
        slots = as_slice(self.span(seq, 0, n))
        for layer in range(len(self.k)):
            self.write(layer, slots, kv[:, 0, layer], kv[:, 1, layer])
        self.seq_lens[seq] = n

    def commit(self, seq: int, keep) -> None:
        """Keep the KV at logical positions ``keep`` (ascending, all >= the committed
        length L; a list of ints, a range or an int64 tensor) as positions ``L, L+1, ...``;
        release the rest of the lookahead. The bookkeeping runs on host ints: a tensor
        ``keep`` is read once (``tolist``), a list not at all."""
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else [int(p) for p in keep]
        L = self.seq_lens[seq]
        new_len = L + len(keep)
        if keep and min(keep) < L:
            raise ValueError(f"commit would overwrite the committed prefix ({min(keep)} < {L})")
        if any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError(f"commit keeps positions in ascending order, each once; got {keep}")
        src = self._host_slots(seq, keep)  # raises past the reserved positions
        if keep != list(range(L, new_len)):  # else the kept entries are already in place
            dst = self._host_slots(seq, range(L, new_len))
            every = self._kv.view(2, len(self.k), -1, *self._kv.shape[4:])  # [2, layers, slots, Hkv, D]
            # An index read copies first, so overlapping moves are safe; the destination is
            # usually consecutive, and a slice is written with one copy.
            consecutive = dst[-1] - dst[0] == len(dst) - 1 and all(b - a == 1 for a, b in zip(dst, dst[1:]))
            to = slice(dst[0], dst[-1] + 1) if consecutive else torch.tensor(dst, device=self.device)
            every[:, :, to] = every.index_select(2, torch.tensor(src, device=self.device))
        self.seq_lens[seq] = new_len
        self.truncate(seq, new_len)

    def _host_slots(self, seq: int, positions) -> list[int]:
        """Flat slots of logical ``positions`` (host ints) of ``seq``, as host ints."""
        table, ps = self.page_tables[seq], self.page_size
        if positions and max(positions) >= len(table) * ps:
            raise IndexError(f"position {max(positions)} of sequence {seq} is not reserved")
        return [table[p // ps] * ps + p % ps for p in positions]

    def truncate(self, seq: int, length: int) -> None:
        """Drop positions ``>= length`` and give back pages no longer needed (a block row's
        pages stay)."""
        self.seq_lens[seq] = min(self.seq_lens[seq], length)
        keep_pages = max(-(-self.seq_lens[seq] // self.page_size), self._pinned[seq])
        table = self.page_tables[seq]
        while len(table) > keep_pages:
            self._free.append(table.pop())
