"""Tree attention over treespec's paged KV cache, plugged into transformers.

One forward packs the new tokens of every request into a single sequence ``[1, T]``.
Request b has ``L_b`` cached tokens that all its new tokens see (its committed prefix),
then ``m_b`` tokens after the prefix of which the last ``n_b`` are this forward's new ones;
a local bool mask ``[n_b, m_b]`` says which of those each new token sees (``m_b > n_b`` when
a drafter extends its own tree level by level; ``m_b == n_b`` for verification and prefill).

Backends share one interface, ``plan`` once per forward and ``run`` per layer:
    TorchBackend       reference; dense bool mask and SDPA over gathered pages; CPU and GPU.
    FlashInferBackend  BatchPrefillWithPagedKVCacheWrapper with a custom mask (fa2); CUDA.

The attention function registered with transformers as ``"treespec"`` finds the batch in
the ``treespec_batch`` keyword that treespec passes to the model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .kv_cache import PagedKVCache, as_slice

__all__ = ["ForwardBatch", "TorchBackend", "FlashInferBackend", "get_backend", "ATTENTION_NAME", "kv_dtype"]

ATTENTION_NAME = "treespec"


def kv_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The dtype a KV cache for a model in ``dtype`` keeps. On a CPU the torch backend
    attends in fp32 (see :meth:`TorchBackend.run`), so a bf16/fp16 model's K/V are kept in
    fp32: the values are the model's own (every bf16/fp16 number is exact in fp32), and
    each layer reads its keys without converting the whole cache again at every step."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


@dataclass
class ForwardBatch:
    """Everything one forward's attention layers need, built once per forward.

    Attributes:
        cache:        the KV cache the layers read and write.
        seqs:         cache sequence of each request ``[B]``.
        prefix_lens:  int64 ``[B]`` fully visible cached tokens.
        local_masks:  B bool masks ``[n_b, m_b]``.
        kv_lens:      int64 ``[B]`` = prefix + m.
        write_slots:  int64 ``[T]`` flat cache slot of each packed new token, or the same
                      as a slice when consecutive.
        key_positions / query_positions: RoPE positions, for sliding windows (torch backend).
        plan:         the backend's per-forward data.
    """

    cache: PagedKVCache
    seqs: list[int]
    prefix_lens: torch.Tensor
    local_masks: list[torch.Tensor]
    kv_lens: torch.Tensor
    write_slots: torch.Tensor | slice
    key_positions: list[torch.Tensor]
    backend: "AttentionBackend"
    plan: object = None


def make_batch(
    cache: PagedKVCache,
    seqs: Sequence[int],
    prefix_lens: Sequence[int],
    local_masks: Sequence[torch.Tensor],
    key_positions: Sequence[torch.Tensor],
    backend: "AttentionBackend",
) -> ForwardBatch:
    """Reserve cache room and plan one forward. ``key_positions[b]`` are the RoPE positions
    of the ``m_b`` tokens after the prefix (the new ones last)."""
    writes = []
    kv_lens = []
    for seq, L, m in zip(seqs, prefix_lens, local_masks):
        n, mm = m.shape
        if n > mm:
            raise ValueError(f"local mask {tuple(m.shape)}: more new tokens than columns")
        cache.reserve(seq, L + mm)
        writes.append(cache.span(seq, L + mm - n, L + mm))
        kv_lens.append(L + mm)
    batch = ForwardBatch(
        cache=cache,
        seqs=list(seqs),
        prefix_lens=torch.as_tensor(list(prefix_lens), dtype=torch.int64),
        local_masks=list(local_masks),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int64),
        write_slots=as_slice(torch.cat(writes)) if cache.device.type == "cpu" else torch.cat(writes),
        key_positions=list(key_positions),
        backend=backend,
    )
    batch.plan = backend.plan(batch)
    return batch


class AttentionBackend:
    name = "base"

    def plan(self, batch: ForwardBatch):
        raise NotImplementedError

    def run(self, batch: ForwardBatch, layer: int, q, scaling: float, sliding_window=None):
        """``q`` ``[T, H, D]`` -> ``[T, H, D]``; the layer's new K/V are already cached."""
        raise NotImplementedError


@dataclass
class TorchPlan:
    gather_slots: torch.Tensor | slice | None  # int64 [B, kv_max], padded with slot 0; a slice when B = 1 and
    # consecutive; None when K/V are read as a view of the cache's block (``view``)
    mask: torch.Tensor  # bool [R, 1, n_max, kv_max]: R rows of attention, one per request (or block row)
    q_index: torch.Tensor  # int64 [T]: packed token -> row * n_max + i
    n_max: int
    query_pos: torch.Tensor  # int64 [R, n_max, 1]
    key_pos: torch.Tensor  # int64 [R, 1, kv_max]
    view: tuple[int, int] | None = None  # (flat slot of the first row, slots per row)


class TorchBackend(AttentionBackend):
    """Reference backend: read each request's K/V, mask densely, call SDPA.

    K/V are read as a view where the layout allows it (one request in consecutive slots, or a
    batch of requests in rows of :meth:`~treespec.kv_cache.PagedKVCache.add_sequences`'s
    block), else gathered page by page. In the block case the attention runs over every row
    between the batch's first and last (rows of finished requests attend to one stale key
    and are dropped): SDPA over a row costs far less than gathering one.
    """

    name = "torch"

    def plan(self, batch: ForwardBatch) -> TorchPlan:
        cache = batch.cache
        B = len(batch.seqs)
        n = [m.shape[0] for m in batch.local_masks]
        n_max, kv_max = max(n), int(batch.kv_lens.max())
        block = cache.block_rows(batch.seqs, kv_max) if B > 1 else None
        if block is not None:
            first, stride, rows = block
            lo = min(rows)
            rows = [r - lo for r in rows]
            R, gather, view = max(rows) + 1, None, (first + lo * stride, stride)
        else:
            rows, R, view = list(range(B)), B, None
            gather = torch.zeros(B, kv_max, dtype=torch.int64, device=cache.device)
        mask = torch.zeros(R, n_max, kv_max, dtype=torch.bool)
        qpos = torch.zeros(R, n_max, dtype=torch.int64)
        kpos = torch.zeros(R, kv_max, dtype=torch.int64)
        q_index = []
        for b, (seq, L, m) in enumerate(zip(batch.seqs, batch.prefix_lens.tolist(), batch.local_masks)):
            kv, r = int(batch.kv_lens[b]), rows[b]
            if gather is not None:
                gather[b, :kv] = cache.span(seq, 0, kv)
            mask[r, : n[b], :L] = True
            mask[r, : n[b], L:kv] = m
            kp = batch.key_positions[b].to(torch.int64)
            kpos[r, :L] = torch.arange(L)
            kpos[r, L:kv] = kp
            qpos[r, : n[b]] = kp[kp.numel() - n[b] :]
            q_index.append(r * n_max + torch.arange(n[b]))
        mask[..., 0] |= ~mask.any(-1)  # padding rows (and rows of no request): avoid an all-masked softmax
        dev = cache.device
        if B == 1 and dev.type == "cpu":
            span = as_slice(gather[0])
            gather = span if isinstance(span, slice) else gather
        return TorchPlan(
            gather_slots=gather,
            mask=mask[:, None].to(dev),
            q_index=torch.cat(q_index).to(dev),
            n_max=n_max,
            query_pos=qpos[:, :, None].to(dev),
            key_pos=kpos[:, None, :].to(dev),
            view=view,
        )

    def run(self, batch, layer, q, scaling, sliding_window=None):
        p: TorchPlan = batch.plan
        B, R = len(batch.seqs), p.mask.shape[0]
        T, H, D = q.shape
        # On a CPU, SDPA in fp32 is faster than in bf16/fp16 (docs/benchmarks.md) and rounds
        # less; the inputs are small to cast.
        dtype = torch.float32 if q.device.type == "cpu" else q.dtype
        if B == 1:  # one request: its tokens are already the padded batch
            qp = q.to(dtype).transpose(0, 1)[None]  # [1, H, T, D]
        else:
            qp = q.new_zeros(R * p.n_max, H, D, dtype=dtype)
            qp[p.q_index] = q.to(dtype)
            qp = qp.view(R, p.n_max, H, D).transpose(1, 2)  # [R, H, n_max, D]
        if p.view is not None:
            first, stride = p.view
            fk, fv = batch.cache.flat(layer)
            rows = slice(first, first + R * stride)
            kv_max = p.mask.shape[-1]
            k = fk[rows].view(R, stride, *fk.shape[1:])[:, :kv_max]  # [R, kv_max, Hkv, D], a view
            v = fv[rows].view(R, stride, *fv.shape[1:])[:, :kv_max]
        else:
            k, v = batch.cache.gather(layer, p.gather_slots)  # [B, kv_max, Hkv, D]
            if isinstance(p.gather_slots, slice):
                k, v = k[None], v[None]
        k, v = k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)
        mask = p.mask
        if sliding_window is not None:
            # Same convention as transformers' sliding-window masks: a query at position p
            # sees keys at positions > p - window.
            window = (p.query_pos - p.key_pos < sliding_window)[:, None]
            mask = mask & window
            mask[..., 0] |= ~mask.any(-1)  # rows left empty are padding-only
        out = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != H
        ).to(q.dtype)  # [R, H, n_max, D]
        if B == 1:
            return out[0].transpose(0, 1)  # [T, H, D]
        out = out.transpose(1, 2).reshape(R * p.n_max, H, D)
        return out[p.q_index]


@dataclass
class FlashInferPlanArgs:
    """The index data handed to ``BatchPrefillWithPagedKVCacheWrapper.plan`` (int32)."""

    qo_indptr: torch.Tensor  # [B+1]
    kv_indptr: torch.Tensor  # [B+1] into kv_indices
    kv_indices: torch.Tensor  # page ids, request after request
    kv_last_page_len: torch.Tensor  # [B]
    custom_mask: torch.Tensor  # bool [sum_b n_b * kv_b]


def flashinfer_plan_args(batch: ForwardBatch) -> FlashInferPlanArgs:
    """Pure index arithmetic, testable without a GPU."""
    cache = batch.cache
    ps = cache.page_size
    qo, kv_ptr, idx, last, masks = [0], [0], [], [], []
    for b, (seq, L, m) in enumerate(zip(batch.seqs, batch.prefix_lens.tolist(), batch.local_masks)):
        kv = int(batch.kv_lens[b])
        pages = -(-kv // ps)
        idx.extend(cache.page_tables[seq][:pages])
        kv_ptr.append(kv_ptr[-1] + pages)
        last.append(kv - (pages - 1) * ps)
        qo.append(qo[-1] + m.shape[0])
        masks.append(torch.cat([torch.ones(m.shape[0], L, dtype=torch.bool), m], 1).reshape(-1))
    i32 = dict(dtype=torch.int32)
    return FlashInferPlanArgs(
        torch.tensor(qo, **i32), torch.tensor(kv_ptr, **i32), torch.tensor(idx, **i32),
        torch.tensor(last, **i32), torch.cat(masks),
    )


class FlashInferBackend(AttentionBackend):
    """FlashInfer's paged prefill kernel with the tree as a custom mask (fa2 backend).

    ``plan()`` runs once per forward (at the first layer, when the softmax scale is known)
    and is reused by every layer. Custom masks run only on fa2 and are passed unpacked: the
    packed form has an open offset bug for batches (facts.md section 4).
    """

    name = "flashinfer"

    def __init__(self, device):
        import flashinfer  # noqa: F401  (CUDA only; imported on demand)

        self._fi = flashinfer
        self.workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")

    def plan(self, batch):
        args = flashinfer_plan_args(batch)
        dev = batch.cache.device
        return {"args": FlashInferPlanArgs(*(t.to(dev) for t in vars(args).values())), "planned": None}

    def run(self, batch, layer, q, scaling, sliding_window=None):
        if sliding_window is not None:
            raise NotImplementedError(
                "sliding-window attention with tree masks is implemented in the torch backend "
                "only: use attention_backend='torch'"
            )
        state = batch.plan
        k_cache = batch.cache.k[layer]
        if state["planned"] != scaling:
            a = state["args"]
            self.wrapper.plan(
                a.qo_indptr, a.kv_indptr, a.kv_indices, a.kv_last_page_len,
                q.shape[1], k_cache.shape[2], q.shape[2], batch.cache.page_size,
                custom_mask=a.custom_mask, causal=False, pos_encoding_mode="NONE",
                sm_scale=scaling, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
            )
            state["planned"] = scaling
        return self.wrapper.run(q, (k_cache, batch.cache.v[layer]))


def flashinfer_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


def get_backend(name: str, device) -> AttentionBackend:
    device = torch.device(device)
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" and flashinfer_available() else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA model, this one is on {device}")
        if not flashinfer_available():
            raise ValueError(
                "attention_backend='flashinfer' needs the flashinfer package: "
                "pip install 'treespec[cuda]' (or use 'torch')"
            )
        return FlashInferBackend(device)
    raise ValueError(f"unknown attention_backend {name!r}: choose 'auto', 'torch' or 'flashinfer'")


def treespec_attention(
    module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
    sliding_window=None, treespec_batch: ForwardBatch | None = None, **kwargs,
):
    """transformers attention function: ``query`` ``[1, H, T, D]``, ``key``/``value``
    ``[1, Hkv, T, D]`` (RoPE applied) -> ``([1, T, H, D], None)``."""
    if treespec_batch is None:
        raise RuntimeError(
            "the 'treespec' attention implementation only runs inside treespec's forward "
            "(no treespec_batch was passed); restore the model's attention implementation"
        )
    if query.shape[0] != 1:
        raise RuntimeError("treespec packs every request into one row: expected batch dimension 1")
    batch = treespec_batch
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # [T, H, D]
    batch.cache.write(layer, batch.write_slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    out = batch.backend.run(batch, layer, q, scaling, sliding_window)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, treespec_attention)
