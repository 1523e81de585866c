"""Batch masks (dense and FlashInfer flat) and the little-endian bit packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.mask import causal_mask, dense_batch_mask, flat_batch_mask, pack_mask, unpack_mask
from treespec.tree import Tree


@st.composite
def local_tree_masks(draw, max_nodes: int = 12) -> torch.Tensor:
    """The ancestor-or-self mask of a random tree (``parents[i]`` in ``[0, i)``)."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    return Tree(parents).attention_mask()


ragged_batches = st.lists(
    st.tuples(local_tree_masks(), st.integers(0, 20)), min_size=1, max_size=4
)  # [(local mask [n_b, n_b], prefix length L_b)]

segments = st.lists(st.lists(st.booleans(), max_size=40), min_size=0, max_size=6)


def _flat(segs: list[list[bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(s) for s in segs], dtype=torch.int64)
    mask = torch.tensor([b for s in segs for b in s], dtype=torch.bool)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    return mask, indptr


# ---- bit packing ----------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(segments)
def test_pack_unpack_round_trip(segs):
    mask, indptr = _flat(segs)
    packed, packed_indptr = pack_mask(mask, indptr)
    assert packed.dtype == torch.uint8 and packed_indptr.dtype == torch.int32
    assert packed_indptr.tolist() == [0] + np.cumsum([(len(s) + 7) // 8 for s in segs]).tolist()
    assert torch.equal(unpack_mask(packed, [len(s) for s in segs]), mask)


@settings(max_examples=50, deadline=None)
@given(segments)
def test_pack_bit_order_is_numpy_little(segs):
    mask, indptr = _flat(segs)
    packed, packed_indptr = pack_mask(mask, indptr)
    for s, (a, b) in enumerate(zip(packed_indptr.tolist(), packed_indptr.tolist()[1:])):
        expected = np.packbits(np.array(segs[s], dtype=bool), bitorder="little")
        assert packed[a:b].numpy().tolist() == expected.tolist()


def test_pack_bit_order_literal():
    # Element off goes to bit off % 8 of byte off // 8: [1,0,1,1,0,0,0,0] -> 0b00001101 = 13.
    packed, indptr = pack_mask(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0], dtype=torch.bool))
    assert packed.tolist() == [13] and indptr.tolist() == [0, 1]
    # Nine elements need two bytes; each segment starts on a fresh byte.
    packed, indptr = pack_mask(
        torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1] + [0, 1], dtype=torch.bool), torch.tensor([0, 9, 11])
    )
    assert packed.tolist() == [255, 1, 2] and indptr.tolist() == [0, 2, 3]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="bool mask"):
        pack_mask(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="indptr must rise from 0"):
        pack_mask(torch.ones(4, dtype=torch.bool), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="indptr must rise from 0"):
        pack_mask(torch.ones(4, dtype=torch.bool), torch.tensor([0, 3, 2, 4]))
    with pytest.raises(ValueError, match="packed has 1 bytes, lengths need 2"):
        unpack_mask(torch.zeros(1, dtype=torch.uint8), [9])


# ---- batch layouts --------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(ragged_batches)
def test_flat_batch_mask_offsets(batch):
    local = [m for m, _ in batch]
    prefix = [L for _, L in batch]
    n = [m.shape[0] for m in local]
    kv = [L + q for L, q in zip(prefix, n)]
    flat = flat_batch_mask(local, prefix)
    assert flat.qo_indptr.dtype == torch.int32 and flat.mask_indptr.dtype == torch.int32
    assert flat.kv_lens.dtype == torch.int32
    assert flat.qo_indptr.tolist() == [0] + np.cumsum(n).tolist()
    assert flat.kv_lens.tolist() == kv
    assert flat.mask_indptr.tolist() == [0] + np.cumsum([q * k for q, k in zip(n, kv)]).tolist()
    assert flat.mask.numel() == flat.mask_indptr[-1]

    dense = dense_batch_mask(local, prefix)
    for b in range(len(batch)):
        lo, hi = int(flat.mask_indptr[b]), int(flat.mask_indptr[b + 1])
        block = flat.mask[lo:hi].reshape(n[b], kv[b])
        assert torch.equal(block, dense[b, : n[b], : kv[b]])
        assert block[:, : prefix[b]].all()  # every new token sees the whole prefix
        assert torch.equal(block[:, prefix[b] :], local[b])


@settings(max_examples=60, deadline=None)
@given(ragged_batches)
def test_dense_batch_mask_layout_and_padding(batch):
    local = [m for m, _ in batch]
    prefix = [L for _, L in batch]
    dense = dense_batch_mask(local, prefix)
    n_max = max(m.shape[0] for m in local)
    kv_max = max(L + m.shape[0] for m, L in batch)
    assert dense.dtype == torch.bool and dense.shape == (len(batch), n_max, kv_max)
    for b, (m, L) in enumerate(batch):
        n = m.shape[0]
        assert dense[b, :n, :L].all()
        assert torch.equal(dense[b, :n, L : L + n], m)
        assert not dense[b, n:].any()  # padding rows
        assert not dense[b, :, L + n :].any()  # padding columns


def test_dense_batch_mask_literal():
    # Request 0: a chain of 2 after 1 prefix token; request 1: root with two children, no prefix.
    dense = dense_batch_mask([causal_mask(2), Tree([-1, 0, 0]).attention_mask()], [1, 0])
    assert dense.int().tolist() == [
        [[1, 1, 0], [1, 1, 1], [0, 0, 0]],
        [[1, 0, 0], [1, 1, 0], [1, 0, 1]],
    ]
    flat = flat_batch_mask([causal_mask(2), Tree([-1, 0, 0]).attention_mask()], [1, 0])
    assert flat.mask.int().tolist() == [1, 1, 0, 1, 1, 1] + [1, 0, 0, 1, 1, 0, 1, 0, 1]
    assert flat.qo_indptr.tolist() == [0, 2, 5] and flat.mask_indptr.tolist() == [0, 6, 15]


@settings(max_examples=30, deadline=None)
@given(ragged_batches)
def test_flat_mask_packs_per_request(batch):
    # What FlashInfer's packed_custom_mask wants: each request's block packed on its own.
    flat = flat_batch_mask([m for m, _ in batch], [L for _, L in batch])
    packed, packed_indptr = pack_mask(flat.mask, flat.mask_indptr)
    lens = flat.mask_indptr.diff()
    assert torch.equal(unpack_mask(packed, lens), flat.mask)
    assert packed_indptr.tolist() == [0] + ((lens + 7) // 8).cumsum(0).tolist()


def test_chain_local_mask_equals_causal():
    for n in range(1, 8):
        assert torch.equal(Tree.chain(n - 1).attention_mask(), causal_mask(n))
        assert torch.equal(causal_mask(n), torch.tril(torch.ones(n, n)).bool())


def test_batch_mask_rejects_bad_input():
    with pytest.raises(ValueError, match="2 prefix lengths for 1 local masks"):
        dense_batch_mask([causal_mask(2)], [0, 1])
    with pytest.raises(ValueError, match="prefix lengths must be >= 0"):
        flat_batch_mask([causal_mask(2)], [-1])
    with pytest.raises(ValueError, match="square bool"):
        dense_batch_mask([torch.ones(2, 3, dtype=torch.bool)], [0])
    with pytest.raises(ValueError, match="square bool"):
        flat_batch_mask([torch.ones(2, 2)], [0])
