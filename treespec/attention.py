"""Tree attention over treespec's paged KV cache, plugged into transformers.

One forward packs the new tokens of every request into a single sequence ``[1, T]``.
Request b has ``L_b`` cached tokens that all its new tokens see (its committed prefix),
then ``m_b`` tokens after the prefix of which the last ``n_b`` are this forward's new ones;
a local bool mask ``[n_b, m_b]`` says which of those each new token sees (``m_b > n_b`` when
a drafter extends its own tree level by level; ``m_b == n_b`` for verification and prefill).

Backends share one interface, ``plan`` once per forward and ``run`` per layer, and are built
once per model and device (:func:`backend_for`):
    TorchBackend       reference; dense bool mask and SDPA over gathered pages; CPU and GPU.
    SplitBackend       each request's prefix through a fused kernel without a mask, its tree block
                       under the mask, merged by log-sum-exp (:mod:`treespec.split_attention`).
    FlexBackend        the torch backend's K/V and mask, attended by PyTorch's flex_attention
                       with the mask as a BlockMask (compiled through triton on CUDA); CPU and
                       GPU, no package beyond torch.
    FlashInferBackend  BatchPrefillWithPagedKVCacheWrapper with a custom mask (fa2); CUDA.

The attention function registered with transformers as ``"treespec"`` finds the batch in
the ``treespec_batch`` keyword that treespec passes to the model's forward.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .kv_cache import PagedKVCache, as_slice
from .split_attention import SplitBackend

__all__ = ["ForwardBatch", "TorchBackend", "SplitBackend", "FlexBackend", "FlashInferBackend", "FlashInferPlan",
           "get_backend", "backend_for", "ATTENTION_NAME", "kv_dtype", "flex_block_mask", "flashinfer_problem"]

ATTENTION_NAME = "treespec"

log = logging.getLogger(__name__)


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
        # On a CPU, SDPA in fp32 is faster than in bf16/fp16 (docs/benchmarks.md) and rounds
        # less; the inputs are small to cast. The cache keeps fp32 there (``kv_dtype``).
        dtype = torch.float32 if q.device.type == "cpu" else q.dtype
        qp = self._queries(batch, q, dtype)  # [R, H, n_max, D]
        k, v = self._keys_values(batch, layer, dtype)  # [R, Hkv, kv_max, D]
        out = self._attend(batch, qp, k, v, scaling, sliding_window).to(q.dtype)  # [R, H, n_max, D]
        if len(batch.seqs) == 1:
            return out[0].transpose(0, 1)  # [T, H, D]
        p: TorchPlan = batch.plan
        return out.transpose(1, 2).reshape(-1, *q.shape[1:])[p.q_index]

    def _queries(self, batch, q, dtype):
        """``q`` ``[T, H, D]`` -> ``[R, H, n_max, D]`` in ``dtype``, each request in its row."""
        p: TorchPlan = batch.plan
        if len(batch.seqs) == 1:  # one request: its tokens are already the padded batch
            return q.to(dtype).transpose(0, 1)[None]  # [1, H, T, D]
        R, (T, H, D) = p.mask.shape[0], q.shape
        qp = q.new_zeros(R * p.n_max, H, D, dtype=dtype)
        qp[p.q_index] = q.to(dtype)
        return qp.view(R, p.n_max, H, D).transpose(1, 2)

    def _keys_values(self, batch, layer, dtype):
        """Each row's K and V ``[R, Hkv, kv_max, D]`` in ``dtype``: a view of the cache's block
        of rows, else gathered page by page."""
        p: TorchPlan = batch.plan
        if p.view is not None:
            first, stride = p.view
            R, kv_max = p.mask.shape[0], p.mask.shape[-1]
            fk, fv = batch.cache.flat(layer)
            rows = slice(first, first + R * stride)
            k = fk[rows].view(R, stride, *fk.shape[1:])[:, :kv_max]  # [R, kv_max, Hkv, D], a view
            v = fv[rows].view(R, stride, *fv.shape[1:])[:, :kv_max]
        else:
            k, v = batch.cache.gather(layer, p.gather_slots)  # [B, kv_max, Hkv, D]
            if isinstance(p.gather_slots, slice):
                k, v = k[None], v[None]
        return k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)

    def _attend(self, batch, q, k, v, scaling, sliding_window):
        """``q`` ``[R, H, n_max, D]``, ``k``/``v`` ``[R, Hkv, kv_max, D]`` -> ``[R, H, n_max, D]``."""
        mask = layer_mask(batch.plan, sliding_window)
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def layer_mask(p: TorchPlan, sliding_window: int | None) -> torch.Tensor:
    """The plan's mask ``[R, 1, n_max, kv_max]``, narrowed to a layer's sliding window."""
    if sliding_window is None:
        return p.mask
    # Same convention as transformers' sliding-window masks: a query at position p sees
    # keys at positions > p - window.
    mask = p.mask & (p.query_pos - p.key_pos < sliding_window)[:, None]
    mask[..., 0] |= ~mask.any(-1)  # rows left empty are padding-only
    return mask


# ---- flex_attention ---------------------------------------------------------------------------

FLEX_BLOCK = 128  # flex_attention's default sparse block: its kernels' tiles divide it


def flex_block_mask(mask: torch.Tensor, block: int = FLEX_BLOCK):
    """A ``flex_attention`` BlockMask for a dense bool ``mask`` ``[R, n, kv]`` (True = attend),
    one for every head: tiles of ``block x block`` that no query of the tile sees are skipped,
    tiles that every query sees whole run without the mask, the rest read ``mask`` through the
    mask_mod. The tables are what ``create_block_mask`` builds from the same mask, computed with
    a few tensor operations instead of evaluating the mask_mod at every (query, key)."""
    from torch.nn.attention.flex_attention import BlockMask

    R, n, kv = mask.shape
    nq, nk = -(-n // block), -(-kv // block)
    padded = F.pad(mask, (0, nk * block - kv, 0, nq * block - n))
    seen = padded.view(R, nq, block, nk, block).sum((2, 4), dtype=torch.int32)[:, None]  # [R, 1, nq, nk]
    full = seen == block * block
    partial = (seen > 0) & ~full

    def ordered(tiles):  # per tile row: how many tiles, and their indices first
        tiles = tiles.to(torch.int32)
        order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
        return tiles.sum(-1, dtype=torch.int32), order.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, q_idx, kv_idx]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(n, kv))


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (triton on CUDA, C++ on a CPU). Shapes vary
    by forward; torch.compile's automatic dynamic shapes recompile a few times, not per shape
    (``dynamic=True`` from the start fails to build on a CPU in torch 2.13)."""
    from torch.nn.attention.flex_attention import flex_attention

    log.info("flex backend: flex_attention is compiled on the first forwards (seconds each)")
    return torch.compile(flex_attention)


def _flex_eager(q, k, v, **kw):
    """flex_attention unfused: the scores materialised, as SDPA does; on purpose, so unwarned."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, **kw)


@dataclass
class FlexPlan(TorchPlan):
    block_masks: dict = field(default_factory=dict)  # sliding window (None: none) -> BlockMask, built on first use


class FlexBackend(TorchBackend):
    """PyTorch's ``flex_attention`` with the tree as a block mask; needs nothing beyond torch.

    Each request's K/V are read exactly as :class:`TorchBackend` reads them (a view of the
    cache's block of rows, else a gather of its pages, padded to ``[R, kv_max]``) and its
    dense mask (prefix fully visible, then the local tree mask) becomes a BlockMask whose
    mask_mod reads it (:func:`flex_block_mask`): the two backends differ only in the kernel,
    so the reference tests everything else. A mask over the whole paged cache instead (no
    gather, the mask_mod mapping each slot to its request and position) would save the
    gather but make every forward's block mask span the whole cache, with pages of other
    requests interleaved in each tile; the gather is ``kv_max`` rows of K/V per layer.

    ``compile``: run the compiled kernel (default on CUDA: triton, compiled once per process
    and again for a few new shape families, seconds each), else the unfused path (default on
    a CPU: compiling there needs a C++ compiler and about 10 s per shape family, and in torch
    2.13 a decoding loop's shapes, once torch.compile makes them dynamic, fail to build: a
    ``CppCompileError`` in inductor's CPU flex template).
    """

    name = "flex"

    def __init__(self, device="cpu", compile: bool | None = None):
        self.compile = torch.device(device).type == "cuda" if compile is None else compile

    def plan(self, batch: ForwardBatch) -> FlexPlan:
        return FlexPlan(**vars(super().plan(batch)))

    def _attend(self, batch, q, k, v, scaling, sliding_window):
        p: FlexPlan = batch.plan
        block_mask = p.block_masks.get(sliding_window)
        if block_mask is None:  # once per forward (and window): every layer reuses it
            block_mask = p.block_masks[sliding_window] = flex_block_mask(layer_mask(p, sliding_window)[:, 0])
        if self.compile and q.device.type == "cuda" and q.shape[-1] < 16:
            raise ValueError(f"flex_attention's CUDA kernel needs a head dim of at least 16, this model's is "
                             f"{q.shape[-1]}: use attention_backend='torch'")
        attend = _compiled_flex() if self.compile else _flex_eager
        return attend(q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])


def flex_problem(device) -> str | None:
    """Why ``attention_backend='flex'`` cannot run on ``device`` here, or None."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return f"runs on CPU and CUDA devices, not {device.type}"
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return f"needs torch.nn.attention.flex_attention (PyTorch 2.5 or later); this is torch {torch.__version__}"
    import torch._dynamo as dynamo

    if not dynamo.is_dynamo_supported():
        return f"needs torch.compile (dynamo), which torch {torch.__version__} does not support on this Python"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "compiles its CUDA kernel with triton, which is not installed"
    return None


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


@dataclass
class FlashInferPlan:
    """One forward's FlashInfer plan: its index data, and whether the wrapper holds it yet."""

    args: FlashInferPlanArgs  # on the cache's device
    # The softmax scale the wrapper was planned with for this forward; None until the first
    # layer plans it (the scale comes with the layer's call). Each forward's plan starts at
    # None, so a wrapper shared by successive forwards is planned again for each.
    planned_scale: float | None = None


class FlashInferBackend(AttentionBackend):
    """FlashInfer's paged prefill kernel with the tree as a custom mask (fa2 backend).

    The wrapper's ``plan()`` runs once per forward (at the first layer, when the softmax scale
    is known) and is reused by every layer. Custom masks run only on fa2 and are passed
    unpacked: the packed form has an open offset bug for batches (FlashInfer PR 2201). One
    backend (its 128 MiB workspace and wrapper) serves every forward of its model
    (:func:`backend_for`): forwards run one after another, each planning the wrapper anew.
    """

    name = "flashinfer"

    def __init__(self, device):
        import flashinfer  # noqa: F401  (CUDA only; imported on demand)

        self._fi = flashinfer
        self.workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")

    def plan(self, batch) -> FlashInferPlan:
        args = flashinfer_plan_args(batch)
        dev = batch.cache.device
        return FlashInferPlan(FlashInferPlanArgs(*(t.to(dev) for t in vars(args).values())))

    def run(self, batch, layer, q, scaling, sliding_window=None):
        if sliding_window is not None:
            raise NotImplementedError(
                "sliding-window attention with tree masks is implemented in the torch backend "
                "only: use attention_backend='torch'"
            )
        p: FlashInferPlan = batch.plan
        k_cache = batch.cache.k[layer]  # [pages, page_size, Hkv, D] (NHD)
        if p.planned_scale != scaling:
            a = p.args
            self.wrapper.plan(
                a.qo_indptr, a.kv_indptr, a.kv_indices, a.kv_last_page_len,
                q.shape[1], k_cache.shape[2], q.shape[2], batch.cache.page_size,
                custom_mask=a.custom_mask, causal=False, pos_encoding_mode="NONE",
                sm_scale=scaling, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
            )
            p.planned_scale = scaling
        return self.wrapper.run(q, (k_cache, batch.cache.v[layer]))


#: what FlashInfer's FA2 prefill kernels are built for: the activations' dtype and the head size
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def flashinfer_problem(dtype: torch.dtype | None, head_dim: int | None) -> str | None:
    """Why FlashInfer's kernels cannot attend for a model of ``dtype`` and ``head_dim`` (None:
    not known, not checked), or None."""
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        return f"runs float16 and bfloat16 models (its FA2 kernels); this one is {str(dtype).removeprefix('torch.')}"
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        return (f"takes head sizes {', '.join(map(str, FLASHINFER_HEAD_DIMS))} (its FA2 kernels); this model's "
                f"is {head_dim}")
    return None


def attention_shape(owner: torch.nn.Module) -> tuple[torch.dtype | None, int | None]:
    """``(dtype, head size)`` of a module that attends through a backend (a transformers model,
    an EAGLE head), each None where it cannot be read."""
    p = next(owner.parameters(), None)
    cfg = getattr(owner, "config", None)
    head = getattr(cfg, "head_dim", None)
    if head is None and getattr(cfg, "num_attention_heads", None):
        head = cfg.hidden_size // cfg.num_attention_heads
    return (None if p is None else p.dtype), (int(head) if head else None)


def flashinfer_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


def backend_name(name: str, device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """The backend ``name`` stands for on ``device``: ``auto`` is FlashInfer on CUDA when it is
    installed and takes a model of ``dtype`` and ``head_dim``, else torch (never flex); other
    names stand for themselves."""
    if name == "auto":
        fits = flashinfer_problem(dtype, head_dim) is None
        return "flashinfer" if torch.device(device).type == "cuda" and fits and flashinfer_available() else "torch"
    return name


# owner module -> (backend name, device) -> the backend built for it; an entry goes when its
# module is collected (nothing a backend holds refers back to the module).
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def backend_for(owner: torch.nn.Module, name: str, device) -> AttentionBackend:
    """The attention backend ``name`` for the module ``owner`` (a target model, a draft model,
    an EAGLE head) on ``device``: built on the first call, the same object on every later one
    while ``owner`` lives, so ``generate`` calls and draft sessions share one (FlashInfer's
    holds a 128 MiB workspace). A backend serves one forward at a time: the one model attends
    through it layer after layer, as its attention implementation is switched for the run. So
    two threads must not generate on one model at once (FlashInfer's plan is the backend's
    state; the model's attention switch was already one per model). Raises ValueError as
    :func:`get_backend` does."""
    device = torch.device(device)
    shape = attention_shape(owner)
    key = (backend_name(name, device, *shape), str(device), shape)  # a model cast since is asked again
    kept = _BUILT.setdefault(owner, {})
    if key not in kept:
        kept[key] = get_backend(key[0], device, *shape)
    return kept[key]


def get_backend(name: str, device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> AttentionBackend:
    """A new attention backend ``name`` (``auto``, ``torch``, ``split``, ``flex``, ``flashinfer``) for
    ``device`` and a model of ``dtype`` and ``head_dim`` (None: not checked); :func:`backend_for`
    keeps one per model instead."""
    device = torch.device(device)
    name = backend_name(name, device, dtype, head_dim)
    if name == "torch":
        return TorchBackend()
    if name == "split":
        return SplitBackend()
    if name == "flex":
        problem = flex_problem(device)
        if problem:
            raise ValueError(f"attention_backend='flex' {problem}: use 'torch'")
        return FlexBackend(device)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA model, this one is on {device}")
        problem = flashinfer_problem(dtype, head_dim)
        if problem:
            raise ValueError(f"attention_backend='flashinfer' {problem}: use 'torch' or 'flex'")
        if not flashinfer_available():
            raise ValueError(
                "attention_backend='flashinfer' needs the flashinfer package: "
                "pip install 'treespec[cuda]' (or use 'torch')"
            )
        return FlashInferBackend(device)
    raise ValueError(f"unknown attention_backend {name!r}: choose 'auto', 'torch', 'split', 'flex' or 'flashinfer'")


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
