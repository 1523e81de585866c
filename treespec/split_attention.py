"""Split tree attention: the prefix without a mask, the tree block masked, merged by log-sum-exp.

Every new token of request b sees the whole of its committed prefix (``L_b`` cached keys) and,
of the ``m_b`` keys after it, those its local mask ``[n_b, m_b]`` allows. So attention over the
``L_b + m_b`` keys splits into two parts over disjoint keys, each a softmax of its own:

    prefix  every query over the L keys, no mask: a fused kernel that returns its log-sum-exp
            (FlashAttention-style; on CUDA the kernel a causal forward runs, not a masked one)
    tree    every query over the m keys with the local mask: written out, ``q @ k^T``, -inf where
            masked, softmax, ``@ v`` (m is the tree's size: a few dozen keys); on a CPU the
            prefix's fused kernel with the mask as an additive one, faster there

and the two are merged exactly with their log-sum-exps (:func:`merge_attention`):
``out = (e^(lse1-M) o1 + e^(lse2-M) o2) / (e^(lse1-M) + e^(lse2-M))``, ``M = max(lse1, lse2)``,
that is ``o2 + sigmoid(lse1 - lse2) (o1 - o2)``.
FlashInfer runs a custom mask on its FA2 kernel only, about twice a causal forward's cost;
SGLang's FA3 backend splits tree verification this way instead.

GQA: query head h reads KV head ``h // g`` (``g = H / Hkv``, transformers' ``repeat_kv``), so the
``g`` query heads of a KV head are folded into its query rows (``[Hkv, g * n, D]``): the prefix
part has no mask, any rows may share a KV head, and no key is copied per query head.

The fused kernel: ``aten._scaled_dot_product_flash_attention_for_cpu`` on a CPU,
``aten._scaled_dot_product_flash_attention`` for fp16/bf16 on CUDA, the memory-efficient kernel
with ``compute_log_sumexp`` for fp32 there. Each returns the natural log-sum-exp of the scaled
scores, ``[1, heads, rows]`` (the efficient kernel's padded to a multiple of 32 rows). Private
operators move between torch versions, so each (device, dtype, head dim) is checked once
against the written-out attention (:func:`fused_works`); where the kernel raises or disagrees,
the prefix is attended written out too (logged once). On CUDA this path has not been run yet
(no GPU test of it so far): the check is what guards it.

Letters as in :mod:`treespec.attention`: T packed new tokens, n a request's new tokens, m its
keys after the prefix, L its prefix, H / Hkv query / key-value heads, D the head dim.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .kv_cache import PagedKVCache

if TYPE_CHECKING:
    from .attention import ForwardBatch

__all__ = ["SplitBackend", "SplitPlan", "SplitRequest", "merge_attention", "masked_attention", "prefix_attention",
           "fused_works", "fused_or_written", "additive"]

log = logging.getLogger(__name__)

_TINY = torch.finfo(torch.float32).tiny


def masked_attention(q, k, v, scaling: float, mask: torch.Tensor | None = None):
    """Attention written out, with its log-sum-exp, in fp32.

    ``q`` ``[Hkv, g, n, D]`` (the ``g`` query heads of each KV head), ``k``/``v`` ``[Hkv, m, D]``
    (m >= 1), ``mask`` bool broadcastable to ``[Hkv, g, n, m]`` (True = attend; None: every key)
    -> ``(out [Hkv, g, n, D], lse [Hkv, g, n])``, fp32. A row that sees no key gets out 0 and
    lse -inf: a part :func:`merge_attention` gives no weight, not a NaN.
    """
    q, k, v = q.float(), k.float(), v.float()
    s = torch.matmul(q, k.transpose(-1, -2)[:, None]) * scaling  # [Hkv, g, n, m]
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    top = s.amax(-1, keepdim=True)
    top = top.masked_fill(top == -math.inf, 0.0)  # a row with no key: every exp below is 0
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v[:, None]) / total.clamp_min(_TINY)
    return out, (top + total.log()).squeeze(-1)


def merge_attention(o1, lse1, o2, lse2):
    """Attention over the union of two disjoint sets of keys, from each set's own.

    ``o1``/``o2`` ``[..., D]`` and ``lse1``/``lse2`` ``[...]`` (fp32): each part's output and
    log-sum-exp -> ``(out [..., D], lse [...])``. Part 1's weight is its share of the union's
    softmax denominator, ``w = e^lse1 / (e^lse1 + e^lse2) = sigmoid(lse1 - lse2)``, and
    ``out = o2 + w (o1 - o2)`` (``torch.lerp``, which returns an end exactly at weight 0 or 1): a
    part of lse -inf (no key) weighs 0, so the other comes back exactly. Both -inf: their mean
    (zeros from :func:`masked_attention`), lse -inf.
    """
    w = torch.sigmoid((lse1 - lse2).nan_to_num(0.0))  # both -inf: inf - inf is NaN, weigh them alike
    return torch.lerp(o2, o1, w[..., None]), torch.logaddexp(lse1, lse2)


def _fused(q, k, v, scaling: float, bias=None):
    """The device's fused kernel: ``q`` ``[1, Hkv, R, D]``, ``k``/``v`` ``[1, Hkv, L, D]`` (L >= 1:
    the CPU kernel fails on no keys), ``bias`` an additive float mask ``[R, L]`` of q's dtype (CPU
    only; None: none) -> ``(out [1, Hkv, R, D]`` in q's dtype, ``lse [1, Hkv, R]``). A row the
    bias masks whole gets lse 0 on the CPU, not -inf: callers pass no such row."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scaling)
    elif bias is not None:
        raise ValueError("a masked fused kernel is used on a CPU only")
    elif q.dtype in (torch.float16, torch.bfloat16):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, scale=scaling)[:2]
    else:  # fp32 on CUDA: the flash kernel takes half precision only
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scaling)[:2]
    return out, lse[..., : q.shape[-2]]


@functools.cache
def fused_works(device: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`_fused` gives :func:`masked_attention`'s output and log-sum-exp on
    ``device`` for ``dtype`` and ``head_dim``: tried once on a small random problem (5 query
    rows over 37 keys, and on a CPU the same under a random mask that leaves each row a key)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, rows, head_dim, generator=g).to(device, dtype) for rows in (5, 37, 37))
    mask = torch.rand(5, 37, generator=g) < 0.5
    mask[:, 0] = True
    masks = [None] + ([mask.to(device)] if device == "cpu" else [])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for m in masks:
        try:
            out, lse = _fused(q, k, v, head_dim**-0.5, None if m is None else additive(m, dtype))
        except Exception as err:  # noqa: BLE001  (a missing operator, or one that refuses this shape)
            log.info("split backend: no fused kernel with log-sum-exp for %s %s, head dim %d (%s: %s); "
                     "attention is written out", device, dtype, head_dim, type(err).__name__, err)
            return False
        want, want_lse = masked_attention(q[0, :, None], k[0], v[0], head_dim**-0.5, m)
        if not (tuple(lse.shape) == (1, 2, 5) and torch.allclose(out[0, :, None].float(), want, rtol=tol, atol=tol)
                and torch.allclose(lse[0, :, None].float(), want_lse, rtol=tol, atol=tol)):
            log.warning("split backend: the fused kernel for %s %s, head dim %d disagrees with the written-out "
                        "attention; attention is written out", device, dtype, head_dim)
            return False
    return True


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as an additive one of ``dtype``: 0 where seen, -inf where not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def prefix_attention(q, k, v, scaling: float):
    """Every query over every key, no mask: ``q`` ``[Hkv, g, n, D]``, ``k``/``v`` ``[Hkv, L, D]``
    (L >= 1) -> ``(out [Hkv, g, n, D], lse [Hkv, g, n])`` in fp32, through the fused kernel
    where :func:`fused_works`, else written out."""
    Hkv, g, n, D = q.shape
    if not fused_works(str(q.device), q.dtype, D):
        return masked_attention(q, k, v, scaling)
    out, lse = _fused(q.reshape(1, Hkv, g * n, D), k[None], v[None], scaling)
    return out.reshape(Hkv, g, n, D).float(), lse.reshape(Hkv, g, n).float()


def fused_or_written(q, k, v, scaling: float, mask: torch.Tensor, biases: dict, key):
    """``q`` ``[Hkv, g, n, D]`` over ``k``/``v`` ``[Hkv, m, D]`` under a bool ``mask`` ``[n, m]`` ->
    ``(out, lse)`` as :func:`masked_attention` gives them. On a CPU through the fused kernel with the
    mask as an additive one (made once per forward under ``key`` in ``biases``: every layer reuses
    it) where every row sees a key; else (CUDA, whose flash kernel takes no mask; a row that sees
    nothing, where the CPU kernel's lse is 0, not -inf) written out: a tree's keys are few."""
    Hkv, g, n, D = q.shape
    if q.device.type != "cpu" or not fused_works("cpu", q.dtype, D):
        return masked_attention(q, k, v, scaling, mask)
    key = (key, g, q.dtype)
    if key not in biases:
        biases[key] = additive(mask, q.dtype).repeat(g, 1) if bool(mask.any(-1).all()) else None  # [g * n, m]
    if biases[key] is None:
        return masked_attention(q, k, v, scaling, mask)
    out, lse = _fused(q.reshape(1, Hkv, g * n, D), k[None], v[None], scaling, biases[key])
    return out.reshape(Hkv, g, n, D).float(), lse.reshape(Hkv, g, n).float()


@dataclass
class SplitRequest:
    """One request's part of a forward."""

    tokens: slice  # its rows of the packed queries [T]
    prefix_len: int  # L
    prefix: slice | torch.Tensor | None  # flat cache slots of its L committed keys; None when L = 0
    local: slice | torch.Tensor  # flat slots of the m keys after the prefix
    mask: torch.Tensor  # bool [n, m] on the cache's device: which of those keys each new token sees
    local_pos: torch.Tensor  # int64 [m]: RoPE positions of those keys (the new tokens last), for windows
    windows: dict = field(default_factory=dict)  # sliding window -> bool [n, L + m], built on first use
    biases: dict = field(default_factory=dict)  # additive masks of fused_or_written, built on first use


@dataclass
class SplitPlan:
    requests: list[SplitRequest]  # in the order their tokens are packed


def _slots(cache: PagedKVCache, seq: int, start: int, end: int) -> slice | torch.Tensor:
    """Flat slots of positions ``start .. end-1`` of ``seq``: a slice (read as a view) where its
    pages run in order, as in a block of rows or a request's pages out of a fresh pool; else
    int64 ``[end - start]`` on the cache's device (read by gathering)."""
    ps = cache.page_size
    pages = cache.page_tables[seq][start // ps: -(-end // ps)]
    if pages == list(range(pages[0], pages[0] + len(pages))):
        first = pages[0] * ps + start % ps
        return slice(first, first + end - start)
    return cache.span(seq, start, end)


class SplitBackend:
    """Tree attention split in two (module docstring): each request's prefix through a fused
    kernel without a mask, its tree block under the mask, merged by log-sum-exp.

    Exact: the outputs are :class:`~treespec.attention.TorchBackend`'s up to the order of fp32
    sums (tests/model/test_split_attention.py). On a CPU it attends in fp32, as the torch backend
    does (:func:`~treespec.attention.kv_dtype`), the tree block through the same fused kernel with
    the mask as an additive one (written out, 2.5 times slower there: ``[9, 64, 64]`` scores,
    0.52 ms against 0.20 ms, AMD EPYC, one thread); on CUDA the prefix in the model's dtype, the
    tree block written out and the merge in fp32. Requests are attended one after another (a loop
    over the batch: their prefixes differ in length and no mask pads them).

    Sliding windows: a windowed layer (``sliding_window``) is attended exactly in one part, each
    request over all its ``L + m`` keys with the window narrowing the mask (transformers'
    convention, as :func:`~treespec.attention.layer_mask`: a query at position p sees keys at
    positions > p - window), by :func:`fused_or_written`; a row left with no key gets zeros where
    the torch backend reads key 0, and no forward has such a row (each new token sees itself).

    It follows :class:`~treespec.attention.AttentionBackend`'s interface (``plan``, ``run``)
    without deriving from it: it sits below ``attention`` in the layers (tests/meta/layering.py)
    so that :func:`~treespec.attention.get_backend` can build it.
    """

    name = "split"

    def plan(self, batch: ForwardBatch) -> SplitPlan:
        cache, start, requests = batch.cache, 0, []
        for seq, L, m, pos in zip(batch.seqs, batch.prefix_lens.tolist(), batch.local_masks, batch.key_positions):
            n, width = m.shape
            requests.append(SplitRequest(
                tokens=slice(start, start + n),
                prefix_len=L,
                prefix=_slots(cache, seq, 0, L) if L else None,
                local=_slots(cache, seq, L, L + width),
                mask=m.to(cache.device, torch.bool),
                local_pos=pos.to(cache.device, torch.int64),
            ))
            start += n
        return SplitPlan(requests)

    def run(self, batch: ForwardBatch, layer: int, q, scaling: float, sliding_window=None):
        """``q`` ``[T, H, D]`` -> ``[T, H, D]``; the layer's new K/V are already cached."""
        p: SplitPlan = batch.plan
        fk, fv = batch.cache.flat(layer)  # [slots, Hkv, D]
        dtype = torch.float32 if q.device.type == "cpu" else q.dtype
        T, H, D = q.shape
        Hkv = fk.shape[1]
        outs = []
        for r in p.requests:
            qr = q[r.tokens].to(dtype).transpose(0, 1).reshape(Hkv, H // Hkv, -1, D)  # [Hkv, g, n, D]
            if sliding_window is None:
                out = self._split(r, fk, fv, qr, scaling)
            else:
                out = self._windowed(r, fk, fv, qr, scaling, sliding_window)
            outs.append(out.reshape(H, -1, D).transpose(0, 1))  # [n, H, D]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.to(q.dtype)

    @staticmethod
    def _split(r: SplitRequest, fk, fv, q, scaling):
        """One request, no window: its tree block, merged with its prefix when it has one."""
        dtype = q.dtype
        k, v = fk[r.local].to(dtype).transpose(0, 1), fv[r.local].to(dtype).transpose(0, 1)  # [Hkv, m, D]
        out, lse = fused_or_written(q, k, v, scaling, r.mask, r.biases, None)
        if r.prefix is None:
            return out
        k, v = fk[r.prefix].to(dtype).transpose(0, 1), fv[r.prefix].to(dtype).transpose(0, 1)  # [Hkv, L, D]
        return merge_attention(*prefix_attention(q, k, v, scaling), out, lse)[0]

    @staticmethod
    def _windowed(r: SplitRequest, fk, fv, q, scaling, window: int):
        """One request in a sliding-window layer: every key in one part, the window in the mask."""
        mask = r.windows.get(window)
        n, L = r.mask.shape[0], r.prefix_len
        if mask is None:  # once per forward and window: every layer of that window reuses it
            key_pos = torch.cat([torch.arange(L, device=r.mask.device), r.local_pos])
            seen = r.local_pos[-n:, None] - key_pos[None, :] < window  # [n, L + m]
            prefix = torch.ones(n, L, dtype=torch.bool, device=r.mask.device)
            mask = r.windows[window] = torch.cat([prefix, r.mask], 1) & seen
        slots = [s for s in (r.prefix, r.local) if s is not None]
        k = torch.cat([fk[s] for s in slots]).to(q.dtype).transpose(0, 1)  # [Hkv, L + m, D]
        v = torch.cat([fv[s] for s in slots]).to(q.dtype).transpose(0, 1)
        return fused_or_written(q, k, v, scaling, mask, r.biases, window)[0]
