"""Sampled acceptance on the device: the target's choice at every token of a fixed-shape bucket
for requests that sample, inside the compiled or captured verify forward, with no read back.

The host's rule (:class:`~treespec.accept.RequestDecoding`) runs transformers' processors on the
nodes verification reaches, one after another, then adds the Gumbel noise of each node's
position and takes the argmax. A CUDA graph can hold neither the walk nor a processor's Python.
But the warpers sampling adds, temperature, top-k, top-p and min-p, read the scores alone and
act on each row by itself. So for requests whose processors are only those, in the order
transformers builds them (:data:`WARPERS`), each is written here once more over every token of the
bucket (:func:`warp`), each row with its own parameters, held in buffers, so one graph serves any
values and any mix of requests. Each rule runs the warper's own operations in its own order, and
the processed scores are transformers' bit for bit (``tests/unit/test_device_sampling.py`` holds
each against the warper, and the engine's seeded tokens against the host's rule). The noise stays
the host's (:func:`~treespec.accept.gumbel_noise` of each position, written into a buffer before
the forward: a copy to the device, not a read back), so a seed gives the tokens it gives today.

Greedy requests in the batch keep the argmax: their parameters leave the scores as they are, and
their noise is zero. A request with any other processor (a repetition penalty, a minimum length, a
user's own: functions of a node's history) keeps the host's rule for the whole batch.

On CUDA one thing can differ by an ulp: top-p's cumulative sum, whose scan ATen lays out by the
number of rows (the host sums one row, or the rows whose cut is not clear; here the whole bucket),
and compiled, inductor's own softmax and scan. A token at top-p's cut can then be kept by one and
dropped by the other, and a seeded token differ where that token also wins the noise's argmax:
both are exact top-p samplers, and the CPU's sums are the same row by row.

On a CPU the host's rule is cheaper: it processes the three or four nodes a step reaches, where
the device processes all N, sorting the vocabulary at each for top-k and again for top-p
(``benchmarks/micro/sampled_rule_cpu.py``); the loop takes this path for captured forwards
(``fixed_shapes="graphs"``) and compiled ones on CUDA.

Letters: R rows (requests), N tokens of a bucket, D the depths noise is kept for, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from .accept import RequestDecoding, gumbel_noise
from .tree import Tree

__all__ = ["WARPERS", "RowWarp", "row_warp", "SamplingRows", "warp", "sampled_choices"]

WARPERS = ("temperature", "top_k", "top_p", "min_p")  # the order transformers' _get_logits_processor adds them
_KIND = {TemperatureLogitsWarper: "temperature", TopKLogitsWarper: "top_k", TopPLogitsWarper: "top_p",
         MinPLogitsWarper: "min_p"}


@dataclass(frozen=True)
class RowWarp:
    """One request's warpers as parameters (each at the value that leaves the scores as they are
    when the request has no such warper) and its seed (None: greedy)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: none
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def uses(self) -> frozenset[str]:
        """The warpers this request applies."""
        off = RowWarp()
        return frozenset(w for w in WARPERS if getattr(self, w) != getattr(off, w))


def row_warp(decoding: RequestDecoding) -> RowWarp | None:
    """``decoding``'s processors as a :class:`RowWarp`; None when the device cannot apply them as
    transformers does: a processor that is not one of :data:`WARPERS` (by its exact type; top-p's
    sort-free form counts as top-p), warpers out of transformers' order or repeated, a filter
    value other than -inf, or top-p or min-p keeping more than one token."""
    params, last = {}, -1
    for p in decoding.processor.processors:
        kind = _KIND.get(type(p)) or ("top_p" if isinstance(p, TopPLogitsWarper) else None)
        if kind is None or WARPERS.index(kind) <= last:
            return None
        last = WARPERS.index(kind)
        if kind != "temperature" and p.filter_value != -math.inf:
            return None
        if kind in ("top_p", "min_p") and p.min_tokens_to_keep != 1:
            return None
        params[kind] = getattr(p, kind)
    return RowWarp(**params, seed=decoding.seed)


@dataclass(eq=False)
class SamplingRows:
    """Per row of a fixed-shape verify's block: the warpers' parameters and the Gumbel noise of
    the positions a step's tree reaches (depth d of row r: position ``L_r + 1 + d``), on the
    device, with pinned host copies on CUDA. A captured graph reads them where they are, so they
    live as long as the rows' other buffers (:class:`~treespec.fixed_shape._Rows`).

    Attributes:
        temperature: float32 ``[R]``; top_k: int64 ``[R]`` (the vocabulary where off);
        top_p: float32 ``[R]``, the cut ``1 - top_p`` as transformers compares with it (-1 where
        off); min_p: float32 ``[R]``; noise: float32 ``[R, D, V]`` (zero in greedy rows).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    noise: torch.Tensor
    host_noise: torch.Tensor
    seeds: list = field(default_factory=list)  # each row's seed, None: greedy or idle
    copied: object = None  # the CUDA event of the last noise copy to the device

    @classmethod
    def empty(cls, rows: int, depths: int, vocab: int, device) -> "SamplingRows":
        device = torch.device(device)
        noise = torch.zeros(rows, depths, vocab, device=device)
        host = noise if device.type == "cpu" else torch.zeros(rows, depths, vocab).pin_memory()
        return cls(torch.ones(rows, device=device), torch.full((rows,), vocab, dtype=torch.int64, device=device),
                   torch.full((rows,), -1.0, device=device), torch.zeros(rows, device=device), noise, host,
                   [None] * rows)

    def set_rows(self, warps: Mapping[int, RowWarp]) -> None:
        """Each row's parameters (``warps``: row -> its request's); the others sample nothing."""
        R, V = self.top_k.shape[0], self.noise.shape[-1]
        temperature, top_k, top_p, min_p = [1.0] * R, [V] * R, [-1.0] * R, [0.0] * R
        self.seeds = [None] * R
        for r, w in warps.items():
            temperature[r], min_p[r], self.seeds[r] = w.temperature, w.min_p, w.seed
            top_k[r] = min(w.top_k, V) if w.top_k else V
            top_p[r] = 1 - w.top_p if w.top_p < 1 else -1.0  # as ``cum <= (1 - top_p)`` rounds it: to fp32
        temperature = torch.tensor(temperature, dtype=torch.float32)
        if self.noise.device.type == "cuda":  # there a scalar divides as a product with its fp32 reciprocal
            temperature = 1 / temperature
        for buf, values in ((self.temperature, temperature), (self.top_k, top_k), (self.top_p, top_p),
                            (self.min_p, min_p)):
            buf.copy_(torch.as_tensor(values, dtype=buf.dtype))
        self.wait()
        self.host_noise.zero_()
        self.noise.copy_(self.host_noise)

    def fill_noise(self, rows: Sequence[int], cached: Sequence[int], trees: Sequence[Tree]) -> None:
        """Write this step's noise: request i (row ``rows[i]``, ``cached[i]`` tokens in the cache,
        tree ``trees[i]``) gets its seed's noise of the positions after its committed tokens, one
        per depth of its tree; copied to the device without waiting."""
        self.wait()
        V, copied = self.noise.shape[-1], False
        for r, L, tree in zip(rows, cached, trees):
            seed = self.seeds[r]
            if seed is None:
                continue
            depths = int(tree.depth.max()) + 1
            if depths > self.noise.shape[1]:
                raise ValueError(f"a tree {depths - 1} deep: the noise is kept for {self.noise.shape[1]} depths")
            self.host_noise[r, :depths] = gumbel_noise(seed, range(L + 1, L + 1 + depths), V)
            if self.noise is not self.host_noise:  # the depths written, not the whole buffer
                self.noise[r, :depths].copy_(self.host_noise[r, :depths], non_blocking=True)
                copied = True
        if copied:
            self.copied = self.copied or torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(self.noise.device))  # the copies' stream

    def wait(self) -> None:
        """Until the last copy out of the host's noise is done (it is not written before)."""
        if self.copied is not None:
            self.copied.synchronize()


def warp(scores: torch.Tensor, s: SamplingRows, uses: frozenset[str]) -> torch.Tensor:
    """float32 ``[R, N, V]``: each row's scores through its request's warpers, in transformers'
    order, with each warper's own operations (a row whose parameter is off comes out as it went
    in). ``uses``: the warpers any row applies (the others are not run at all)."""
    R, N, V = scores.shape
    if "temperature" in uses:
        t = s.temperature[:, None, None]
        scores = scores * t if scores.device.type == "cuda" else scores / t
    if "top_k" in uses:  # below the k-th largest: the same value topk's last one is
        kth = scores.sort(-1, descending=True).values.gather(-1, (s.top_k - 1)[:, None, None].expand(R, N, 1))
        scores = scores.masked_fill(scores < kth, -math.inf)
    if "top_p" in uses:
        ascending, order = torch.sort(scores, descending=False)
        cut = ascending.softmax(dim=-1).cumsum(dim=-1) <= s.top_p[:, None, None]
        cut[..., -1:] = False  # the most probable token stays
        scores = scores.masked_fill(cut.scatter(-1, order, cut), -math.inf)
    if "min_p" in uses:
        probs = torch.softmax(scores, dim=-1)
        low = probs < s.min_p[:, None, None] * probs.amax(dim=-1, keepdim=True)
        low = low.scatter(-1, torch.topk(probs, 1, dim=-1).indices, False)
        scores = scores.masked_fill(low, -math.inf)
    return scores


def sampled_choices(logits: torch.Tensor, depth: torch.Tensor, s: SamplingRows, uses: frozenset[str],
                    argmax) -> torch.Tensor:
    """int64 ``[R, N]``: the target's choice at every bucket token: the argmax (``argmax``, as
    :func:`~treespec.accept.first_argmax` takes it) of its warped scores plus the noise of its
    depth (``depth`` int64 ``[R, N]``), what the host's rule chooses at a node it reaches."""
    R, N, V = logits.shape
    noise = s.noise.gather(1, depth[..., None].expand(R, N, V))
    return argmax(warp(logits.float(), s, uses) + noise)
