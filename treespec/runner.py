"""Running a Hugging Face causal LM on treespec's cache and attention.

The model is used as it is: for the duration of a ``with runner.attached():`` block its
attention implementation is switched to treespec's registered function and restored
afterwards, whatever happens. Each forward packs every request's new tokens into one
``[1, T]`` row with explicit positions and ``use_cache=False``; K/V go to treespec's
:class:`PagedKVCache`. Target features for EAGLE drafters are captured with forward hooks
that live only for the duration of one forward.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from .attention import ATTENTION_NAME, AttentionBackend, backend_for, kv_dtype, make_batch
from .kv_cache import PagedKVCache

__all__ = ["ModelRunner", "ForwardOutput", "FINAL_NORM", "check_supported", "SUPPORTED_MODEL_TYPES"]

FINAL_NORM = -1  # feature id: the decoder's final (post-norm) hidden state

# Families whose tree forward is tested against causal recomputation and HF generate.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def check_supported(model) -> None:
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {mt!r} is not supported: treespec's tree attention is tested on "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. Other families need a test that their "
            f"attention goes through transformers' AttentionInterface with rotary positions "
            f"from position_ids and no extra attention terms (softcapping, alibi, sinks)"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"{type(model).__name__} does not support transformers' AttentionInterface")
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers"):
        raise ValueError(f"{type(decoder).__name__} has no .layers: cannot size the KV cache")


@dataclass
class ForwardOutput:
    """Per request: ``logits`` ``[rows_b, V]`` and ``features`` ``[n_b, F]`` (or None)."""

    logits: list[torch.Tensor]
    features: list[torch.Tensor] | None


# model -> the largest storage of its released caches (ModelRunner.release_cache), CPU only
_SPARE_KV: "weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()


def drop_spare_storage(model) -> None:
    """Forget the cache storage :meth:`ModelRunner.release_cache` keeps for ``model``."""
    _SPARE_KV.pop(model, None)


def check_graphs_device(device: torch.device) -> None:
    """``fixed_shapes="graphs"`` captures the verify forward in CUDA graphs: ValueError off CUDA."""
    if device.type != "cuda":
        raise ValueError(f"fixed_shapes='graphs' captures the verify forward in CUDA graphs: it needs the model on a "
                         f"CUDA device, and it is on {device}; use fixed_shapes='compile' on a CPU")


class ModelRunner:
    """A model plus a backend; builds caches sized for it and runs packed forwards.

    Args:
        model:          a transformers causal LM (eval mode).
        backend:        ``"auto"``, ``"torch"``, ``"split"``, ``"flex"``, ``"flashinfer"`` (the model's
                        backend of that name, built on first use and shared by every runner
                        of the model: :func:`~treespec.attention.backend_for`) or a backend
                        object.
        feature_layers: target features to capture: layer indices (the hidden state
                        entering that decoder layer) and/or :data:`FINAL_NORM`; concatenated
                        in the order given.
        fixed_shapes:   how the decoding loop runs its verify forward: False, :meth:`forward`
                        on the tree's own shapes; True, on fixed shapes
                        (:class:`~treespec.fixed_shape.FixedShapeVerify`, eager); ``"compile"``,
                        the same through ``torch.compile``; ``"graphs"`` (CUDA), the same
                        captured in CUDA graphs, one a bucket, and replayed.
    """

    def __init__(self, model, backend="auto", feature_layers: Sequence[int] | None = None,
                 fixed_shapes: bool | str = False):
        check_supported(model)
        if not (fixed_shapes is False or fixed_shapes is True or fixed_shapes in ("compile", "graphs")):
            raise ValueError(f"fixed_shapes must be False (the verify forward on the tree's own shapes), True (on "
                             f"fixed shapes, eager), 'compile' (on fixed shapes, through torch.compile) or 'graphs' "
                             f"(on fixed shapes, captured in CUDA graphs), got {fixed_shapes!r}")
        self.fixed_shapes = fixed_shapes
        self.model = model
        self.device = next(model.parameters()).device
        if fixed_shapes == "graphs":
            check_graphs_device(self.device)
        self.dtype = next(model.parameters()).dtype
        self.backend: AttentionBackend = (
            backend_for(model, backend, self.device) if isinstance(backend, str) else backend
        )
        self.feature_layers = tuple(feature_layers) if feature_layers else ()
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    def new_cache(self, tokens_per_seq: Sequence[int], page_size: int = 16) -> PagedKVCache:
        pages = sum(-(-int(n) // page_size) for n in tokens_per_seq) + len(tokens_per_seq)
        return PagedKVCache(
            self.num_layers, self.num_kv_heads, self.head_dim, pages, page_size,
            kv_dtype(self.dtype, self.device), self.device,
        )

    def new_rows_cache(self, count: int, tokens: int, page_size: int = 16) -> tuple[PagedKVCache, list[int]]:
        """A cache for a batch: ``count`` sequences in equal rows of ``tokens`` positions, read
        as a view by the torch backend (:meth:`PagedKVCache.with_rows`); on the storage that
        :meth:`release_cache` kept when it is large enough (the part used zeroed again)."""
        spare = _SPARE_KV.pop(self.model, None) if self._keeps_storage else None
        return PagedKVCache.with_rows(self.num_layers, self.num_kv_heads, self.head_dim, count, tokens, page_size,
                                      kv_dtype(self.dtype, self.device), self.device, storage=spare)

    def release_cache(self, cache: PagedKVCache) -> None:
        """``cache`` is no longer used: on a CPU, keep its storage (one per model, the largest
        given back, while the model lives) for the next :meth:`new_rows_cache` it can hold. A
        fresh allocation pays for every page the first time it is written: zeroing a new
        2,048-position cache of SmolLM2-135M (95 MB in fp32) took 124 ms on a 2-core Intel
        Xeon, a tenth of a 128-token answer, where zeroing a reused one is a memory write; a
        bench's compiled calls, each after an eager call of a shorter row, spent 1.74 s of 10.18
        making theirs afresh (docs/benchmarks.md, "Compiled, round six"). On CUDA, whose caching
        allocator reuses memory already, only with ``fixed_shapes="graphs"``: the verify forward's
        graphs replay on the storage they were captured on, and the next call's cache is made on
        it (:class:`~treespec.fixed_shape.FixedShapeVerify`)."""
        if not self._keeps_storage:
            return
        kept = _SPARE_KV.get(self.model)
        if kept is None or kept.numel() <= cache.storage.numel():
            _SPARE_KV[self.model] = cache.storage

    @property
    def _keeps_storage(self) -> bool:
        return self.device.type == "cpu" or self.fixed_shapes == "graphs"

    def kv_layout(self) -> dict:
        """What K/V computed elsewhere must match to be reused here (prefix caching): shapes,
        the model's dtype, the cache's dtype and the device."""
        return dict(layers=self.num_layers, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    dtype=str(self.dtype), kv_dtype=str(kv_dtype(self.dtype, self.device)), device=str(self.device))

    @contextlib.contextmanager
    def attached(self):
        """Switch the model to treespec attention; restore its implementation on exit."""
        cfg = self.model.config
        previous = cfg._attn_implementation
        if previous == ATTENTION_NAME:
            yield self
            return
        self.model.set_attn_implementation(ATTENTION_NAME)
        try:
            yield self
        finally:
            self.model.set_attn_implementation(previous)

    @torch.inference_mode()
    def forward(
        self,
        cache: PagedKVCache,
        seqs: Sequence[int],
        tokens: Sequence[torch.Tensor],
        positions: Sequence[torch.Tensor],
        local_masks: Sequence[torch.Tensor],
        logits_rows: Sequence[torch.Tensor] | None = None,
        capture: bool = False,
        extra_keys: Sequence[torch.Tensor] | None = None,
    ) -> ForwardOutput:
        """One packed forward.

        Args:
            cache, seqs:  the KV cache and each request's sequence in it; request b sees all
                          ``cache.seq_lens[seq_b]`` committed tokens.
            tokens:       int64 ``[n_b]`` new tokens per request.
            positions:    int64 ``[n_b]`` their RoPE positions.
            local_masks:  bool ``[n_b, m_b]`` over the ``m_b`` tokens after the committed
                          prefix (new tokens last); ``m_b == n_b`` unless ``extra_keys``.
            logits_rows:  int64 per request: which of its new tokens need logits (None: all).
            capture:      also return the requested target features of every new token.
            extra_keys:   RoPE positions of the ``m_b - n_b`` uncommitted tokens already in
                          the cache before the new ones (a drafter's earlier tree levels).
        """
        prefix = [cache.seq_lens[s] for s in seqs]
        key_pos = []
        for b in range(len(seqs)):
            kp = positions[b].to(torch.int64).cpu()
            if extra_keys is not None:
                kp = torch.cat([extra_keys[b].to(torch.int64).cpu(), kp])
            key_pos.append(kp)
        batch = make_batch(cache, seqs, prefix, local_masks, key_pos, self.backend)
        n = [t.numel() for t in tokens]
        ids = torch.cat([t.reshape(-1) for t in tokens]).to(self.device)[None]
        pos = torch.cat([p.reshape(-1) for p in positions]).to(self.device)[None]
        keep = _kept_rows(n, logits_rows)
        captured: dict[int, torch.Tensor] = {}
        hooks = self._feature_hooks(captured) if capture else []
        try:
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=False,
                logits_to_keep=keep.to(self.device),
                treespec_batch=batch,
            )
        finally:
            for h in hooks:
                h.remove()
        logits = out.logits[0]  # [rows, V]
        counts = [len(r) for r in logits_rows] if logits_rows is not None else n
        per_req = list(torch.split(logits, counts))
        feats = None
        if capture and self.feature_layers:
            f = torch.cat([captured[fid] for fid in self.feature_layers], dim=-1)  # [T, F]
            feats = list(torch.split(f, n))
        return ForwardOutput(per_req, feats)

    def _feature_hooks(self, captured: dict[int, torch.Tensor]) -> list:
        """Forward hooks that put each requested feature ``[T, H]`` of the next forward into
        ``captured`` under its feature id; the caller removes them."""
        hooks = []
        decoder = self.model.get_decoder()
        for fid in self.feature_layers:
            if fid == FINAL_NORM:
                hooks.append(decoder.norm.register_forward_hook(
                    lambda mod, args, out, fid=fid: captured.__setitem__(fid, out[0])))
            else:
                hooks.append(decoder.layers[fid].register_forward_pre_hook(
                    lambda mod, args, kwargs, fid=fid: captured.__setitem__(
                        fid, (args[0] if args else kwargs["hidden_states"])[0]),
                    with_kwargs=True))
        return hooks


def _kept_rows(n: Sequence[int], logits_rows: Sequence[torch.Tensor] | None) -> torch.Tensor:
    """int64: the packed rows whose logits a forward keeps, given each request's ``n[b]`` new
    tokens and the rows ``logits_rows[b]`` among them (None: every row)."""
    offsets = [0]
    for x in n:
        offsets.append(offsets[-1] + x)
    if logits_rows is None:
        return torch.arange(offsets[-1])
    return torch.cat([offsets[b] + torch.as_tensor(r, dtype=torch.int64) for b, r in enumerate(logits_rows)])
