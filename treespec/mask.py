"""Attention masks for one forward over a batch of requests.

Request b has ``L_b`` tokens already in the KV cache (its prefix) and ``n_b`` new query
tokens whose mutual visibility is a local bool mask ``[n_b, n_b]`` (a tree's
ancestor-or-self mask, or a causal triangle for prefill). Row i of b's full mask is
``[True] * L_b`` followed by local row i: the KV of the new tokens sits right after the
prefix. Letters: B requests, L prefix length, n new tokens, kv = L + n.

Two layouts of the same mask:
    dense   bool ``[B, n_max, kv_max]``, False-padded, for the PyTorch backend;
    flat    bool ``[sum_b n_b * kv_b]``, per request row-major, concatenated: FlashInfer's
            ``custom_mask`` with ``qo_indptr`` ``[B+1]`` and ``mask_indptr`` ``[B+1]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "causal_mask",
    "dense_batch_mask",
    "flat_batch_mask",
    "FlatMask",
    "pack_mask",
    "unpack_mask",
]


def causal_mask(n: int) -> torch.Tensor:
    """bool ``[n, n]`` lower triangle: the local mask of a run of sequential tokens."""
    i = torch.arange(n)
    return i[:, None] >= i[None, :]  # cheaper than tril_ for tiny n (no parallel region)


def _lengths(local_masks: Sequence[torch.Tensor], prefix_lens) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = torch.as_tensor(prefix_lens, dtype=torch.int64).reshape(-1)
    if prefix.numel() != len(local_masks):
        raise ValueError(f"{prefix.numel()} prefix lengths for {len(local_masks)} local masks")
    if (prefix < 0).any():
        raise ValueError("prefix lengths must be >= 0")
    q = []
    for m in local_masks:
        if m.dim() != 2 or m.shape[0] != m.shape[1] or m.dtype != torch.bool:
            raise ValueError(f"a local mask must be square bool [n, n], got {m.dtype} {tuple(m.shape)}")
        q.append(m.shape[0])
    return prefix, torch.tensor(q, dtype=torch.int64)


def dense_batch_mask(local_masks: Sequence[torch.Tensor], prefix_lens) -> torch.Tensor:
    """bool ``[B, n_max, kv_max]``: the full mask of every request, False-padded.

    Padding rows (i >= n_b) are all False; callers must not read their outputs.
    """
    prefix, q = _lengths(local_masks, prefix_lens)
    b = len(local_masks)
    n_max = int(q.max()) if b else 0
    kv_max = int((prefix + q).max()) if b else 0
    rows = torch.arange(n_max)
    cols = torch.arange(kv_max)
    out = (cols[None, None, :] < prefix[:, None, None]) & (rows[None, :, None] < q[:, None, None])
    for i, m in enumerate(local_masks):
        L, n = int(prefix[i]), m.shape[0]
        out[i, :n, L : L + n] = m
    return out


@dataclass(frozen=True)
class FlatMask:
    """FlashInfer's flattened custom mask for one batch.

    Attributes:
        mask:        bool ``[sum_b n_b * kv_b]``.
        qo_indptr:   int32 ``[B+1]``, query offsets.
        kv_lens:     int32 ``[B]``, ``L_b + n_b``.
        mask_indptr: int32 ``[B+1]``, offsets of each request's block in ``mask``.
    """

    mask: torch.Tensor
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    mask_indptr: torch.Tensor


def flat_batch_mask(local_masks: Sequence[torch.Tensor], prefix_lens) -> FlatMask:
    prefix, q = _lengths(local_masks, prefix_lens)
    kv = prefix + q
    blocks = []
    for i, m in enumerate(local_masks):
        L = int(prefix[i])
        blocks.append(torch.cat([torch.ones(m.shape[0], L, dtype=torch.bool), m], dim=1).reshape(-1))
    zero = torch.zeros(1, dtype=torch.int64)
    return FlatMask(
        mask=torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool),
        qo_indptr=torch.cat([zero, q.cumsum(0)]).to(torch.int32),
        kv_lens=kv.to(torch.int32),
        mask_indptr=torch.cat([zero, (q * kv).cumsum(0)]).to(torch.int32),
    )


def pack_mask(mask: torch.Tensor, indptr: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a flat bool mask into bytes in FlashInfer's little bit order.

    Element ``off`` of a segment lands in bit ``off % 8`` of the segment's byte
    ``off // 8``; each segment is padded to whole bytes, as ``flashinfer.segment_packbits``
    with ``bitorder="little"`` does.

    Args:
        mask:   bool ``[M]``.
        indptr: int ``[S+1]`` segment offsets into ``mask``; one segment when None.
    Returns:
        ``(packed uint8 [sum ceil(len_s / 8)], packed_indptr int32 [S+1])``.
    """
    mask = mask.reshape(-1)
    if mask.dtype != torch.bool:
        raise ValueError(f"pack_mask takes a bool mask, got {mask.dtype}")
    if indptr is None:
        indptr = torch.tensor([0, mask.numel()])
    indptr = torch.as_tensor(indptr, dtype=torch.int64).to(mask.device)
    if indptr[0] != 0 or indptr[-1] != mask.numel() or (indptr.diff() < 0).any():
        raise ValueError("indptr must rise from 0 to mask.numel()")
    lens = indptr.diff()
    packed_indptr = torch.cat([indptr.new_zeros(1), ((lens + 7) // 8).cumsum(0)])
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=mask.device), lens)
    off = torch.arange(mask.numel(), device=mask.device) - indptr[seg]
    byte = packed_indptr[seg] + off // 8
    bits = mask.to(torch.int32) << (off % 8).to(torch.int32)
    out = torch.zeros(int(packed_indptr[-1]), dtype=torch.int32, device=mask.device)
    out.index_add_(0, byte, bits)
    return out.to(torch.uint8), packed_indptr.to(torch.int32)


def unpack_mask(packed: torch.Tensor, lengths) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: ``lengths`` ``[S]`` are the segments' element counts."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
    nbytes = (lengths + 7) // 8
    if int(nbytes.sum()) != packed.numel():
        raise ValueError(f"packed has {packed.numel()} bytes, lengths need {int(nbytes.sum())}")
    bits = (packed.to(torch.int32)[:, None] >> torch.arange(8, dtype=torch.int32)) & 1  # [bytes, 8]
    bits = bits.reshape(-1).bool()
    starts = torch.cat([nbytes.new_zeros(1), nbytes.cumsum(0)[:-1]]) * 8
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    first = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    off = torch.arange(int(lengths.sum())) - first[seg]
    return bits[starts[seg] + off]
