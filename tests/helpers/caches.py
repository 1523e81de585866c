"""A paged KV cache of random K/V for the attention backends' tests."""

from __future__ import annotations

import torch

from treespec.kv_cache import PagedKVCache


def random_cache(prefixes, masks, page_size: int, rows: bool, seed: int, heads_kv: int = 2, head_dim: int = 4,
                 dtype=torch.float32, device="cpu"):
    """A one-layer cache of random K/V holding ``prefixes`` committed tokens per sequence, room
    after them for each ``masks[i]``'s keys (``(mask [n, m], ...)`` pairs): in one block of rows
    (read as a view, ``rows``) or on pages handed out in a scrambled order (gathered). Returns
    the cache and its sequences."""
    g = torch.Generator().manual_seed(seed)
    longest = max(L + m.shape[1] for L, (m, _) in zip(prefixes, masks))
    pages = len(prefixes) * (-(-longest // page_size) + 1)
    cache = PagedKVCache(1, heads_kv, head_dim, pages, page_size, dtype, device)
    if rows:
        seqs = cache.add_sequences(len(prefixes), longest)
    else:
        cache._free = torch.randperm(pages, generator=g).tolist()
        seqs = [cache.add_sequence() for _ in prefixes]
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    for s, L in zip(seqs, prefixes):
        cache.reserve(s, L)
        cache.commit(s, torch.arange(L))
    return cache, seqs
