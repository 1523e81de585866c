"""How an EAGLE session runs the head: one strategy, chosen when the session starts.

A head pass takes each request's new entries (the prompt, a tree level, a commit's accepted
tokens) and returns the head's output states, and their log-probabilities where the pass
computed them. Three strategies; each hands a call it cannot take to the one below it:

    StaticRowPasses  one request on fixed shapes over its row of the cache
                     (:class:`~treespec.drafters.graphs.StaticPasses`), replayed from CUDA
                     graphs (``cuda_graphs=True``) or run eagerly (tests, benchmarks);
    RowPasses        one request over its row with the torch backend's arithmetic (fp32 SDPA,
                     RoPE from the head's table) and none of its batch planning, which on a CPU
                     costs more than the head's attention itself;
    PackedPasses     every request's entries packed into one pass through the attention
                     backend: any batch, any backend, any cache layout.

Letters: per request b, ``n_b`` new entries, ``m_b`` tree entries after its cached prefix
(its new ones last), ``L_b`` cached entries; H the head's hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import AttentionBackend, make_batch
from ..kv_cache import PagedKVCache
from .eagle_head import EagleHead
from .graphs import StaticPasses

__all__ = ["PackedPasses", "RowPasses", "StaticRowPasses"]

# What every strategy's ``run`` returns: the states ``[n_b, H]`` per request, and their fp32
# log-probabilities ``[n_b, V_draft]`` per request where the pass computed them, else None.
Passed = tuple[list[torch.Tensor], "list[torch.Tensor] | None"]


class PackedPasses:
    """Every request's new entries in one head pass through ``backend`` over ``cache``."""

    def __init__(self, head: EagleHead, cache: PagedKVCache, backend: AttentionBackend):
        self.head, self.cache, self.backend = head, cache, backend
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype

    @torch.inference_mode()
    def run(self, seqs, tokens, hidden, positions, masks, extra_keys=None) -> Passed:
        """One pass. Per request b: ``seqs[b]`` its cache sequence; ``tokens[b]`` int64
        ``[n_b]``; ``hidden[b]`` ``[n_b, H]``; ``positions[b]`` int64 ``[n_b]`` RoPE positions;
        ``masks[b]`` bool ``[n_b, m_b]``; ``extra_keys[b]`` int64 ``[m_b - n_b]``: the RoPE
        positions of the tree entries already cached after the prefix (None: none)."""
        prefix = [self.cache.seq_lens[s] for s in seqs]
        kpos = [p if extra_keys is None else torch.cat([extra_keys[i], p]) for i, p in enumerate(positions)]
        batch = make_batch(self.cache, seqs, prefix, masks, kpos, self.backend)
        scale = self.head.config.head_dim ** -0.5

        def attend(q, k, v):
            self.cache.write(0, batch.write_slots, k, v)
            return self.backend.run(batch, 0, q, scale)

        toks = torch.cat(tokens).to(self.device)
        h = self.head(toks, torch.cat(hidden).to(self.dtype), torch.cat(positions).to(self.device), attend)
        return list(torch.split(h, [t.numel() for t in tokens])), None


class RowPasses:
    """A lone request's pass over its row of the cache (a row of
    :meth:`~treespec.kv_cache.PagedKVCache.with_rows`), the torch backend's arithmetic without
    its plan; a batch, or entries the row cannot hold, go to ``fallback``.

    ``rope_length``: positions the head's RoPE table must cover (the row's capacity)."""

    def __init__(self, fallback: PackedPasses, rope_length: int):
        self.fallback = fallback
        self.head, self.cache, self.device, self.dtype = fallback.head, fallback.cache, fallback.device, fallback.dtype
        self.rope = self.head.rope_table(rope_length)  # (cos, sin) [C, D]

    @torch.inference_mode()
    def run(self, seqs, tokens, hidden, positions, masks, extra_keys=None) -> Passed:
        """As :meth:`PackedPasses.run` (a row's tree entries are in place: ``extra_keys`` is
        read only by the fallback)."""
        if len(seqs) == 1:
            states = self.run_one(seqs[0], tokens[0], hidden[0], positions[0], masks[0])
            if states is not None:
                return [states], None
        return self.fallback.run(seqs, tokens, hidden, positions, masks, extra_keys)

    @torch.inference_mode()
    def run_one(self, seq, tokens, hidden, positions, mask) -> torch.Tensor | None:
        """The states ``[n, H]`` of one request's pass (arguments as one request's of
        :meth:`run`), or None when its row cannot hold the entries."""
        cache = self.cache
        L = cache.seq_lens[seq]
        n, m = mask.shape
        kv = L + m
        block = cache.block_rows([seq], kv)
        if block is None or n > m:
            return None
        cache.reserve(seq, kv)
        first, stride, (row,) = block
        start = first + row * stride
        full = torch.ones(n, kv, dtype=torch.bool)
        full[:, L:] = mask
        full = full.to(self.device)[None, None]  # [1, 1, n, kv]
        scale = self.head.config.head_dim ** -0.5

        def attend(q, k, v):  # q [n, Hq, D], k/v [n, Hkv, D]
            fk, fv = cache.flat(0)
            fk[start + kv - n: start + kv] = k.to(fk.dtype)
            fv[start + kv - n: start + kv] = v.to(fv.dtype)
            keys = fk[start: start + kv].transpose(0, 1).to(torch.float32)[None]  # [1, Hkv, kv, D]
            values = fv[start: start + kv].transpose(0, 1).to(torch.float32)[None]
            out = F.scaled_dot_product_attention(q.to(torch.float32).transpose(0, 1)[None], keys, values,
                                                 attn_mask=full, scale=scale,
                                                 enable_gqa=keys.shape[1] != q.shape[1])
            return out[0].transpose(0, 1).to(q.dtype)

        pos = positions.to(self.device)
        rope = (self.rope[0][pos], self.rope[1][pos])
        return self.head(tokens.to(self.device), hidden.to(self.dtype), pos, attend, rope)


class StaticRowPasses:
    """A lone request's pass on the fixed shapes of ``static`` (over the request's row), its
    log-probabilities computed with it; a batch, or a pass that does not fit the shapes (more
    entries than ``static.max_entries``, past the row), go to ``fallback``."""

    def __init__(self, static: StaticPasses, fallback: RowPasses | PackedPasses):
        self.static, self.fallback = static, fallback
        self.cache, self.device = fallback.cache, fallback.device

    @torch.inference_mode()
    def run(self, seqs, tokens, hidden, positions, masks, extra_keys=None) -> Passed:
        """As :meth:`PackedPasses.run`."""
        if len(seqs) == 1:
            seq, mask = seqs[0], masks[0]
            L = self.cache.seq_lens[seq]
            n, m = mask.shape
            if self.cache.block_rows([seq], L + m) is not None and n <= m:
                self.cache.reserve(seq, L + m)
                out = self.static.run(tokens[0].to(self.device), hidden[0], positions[0].to(self.device), mask, L)
                if out is not None:
                    return [out[0]], [out[1]]
        return self.fallback.run(seqs, tokens, hidden, positions, masks, extra_keys)
