"""A GGUF's own 4-bit and 8-bit blocks run by torch's int4 CPU kernel, exactly as the file stores them.

    summary = gguf_linears(model, "SmolLM2-135M-Instruct.Q4_1.gguf")   # in place: 210 Q4_1 linears

Each block holds 32 weights of one row (Q4_K: 256; llama.cpp's ``ggml-common.h``; ``d``, ``m``
float16):

====  ======================================  =================================================
type  block                                   as the int4 kernel's ``(c - 8) * scale + zero``
====  ======================================  =================================================
Q4_0  d, 16 bytes of nibbles: ``(q - 8) d``   c = q, scale d, zero 0
Q4_1  d, m, 16 bytes: ``q d + m``             c = q, scale d, zero m + 8d
Q4_K  256 weights: d, dmin, eight 6-bit       c = q, scale d sc_j, zero 8 d sc_j - dmin m_j
      scales sc_j and mins m_j, 128 bytes:    for each group j of 32
      ``d sc_j q - dmin m_j``
Q8_0  d, 32 int8: ``q d``                     q = 16 h + l (h in -8..7, l in 0..15): two groups,
                                              c = h + 8 with scale 16d, zero 0, and c = l with
                                              scale d, zero 8d; the input is read twice
====  ======================================  =================================================

All four are exact in the kernel's arithmetic: in fp32 the weights equal the file's
dequantized ones (``gguf.quants.dequantize``) up to one rounding of the zero; in bf16 the
scales and zeros are rounded to bf16, as a dense bf16 model rounds each weight. (Q8_0 cannot go
through the int8 kernel exactly: that takes one scale a row, where Q8_0 has one per 32 weights.)
Nibbles: byte ``j`` of a 4-bit block holds weight ``j`` in its low half and ``j + 16`` in its high
(Q4_K: of each 32 bytes, weights ``j`` and ``j + 32`` of a 64-weight chunk). Other types (Q5,
Q6_K with its groups of 16, ...) stay dense. A Q4_K_M file stores some tensors as Q6_K: those
layers stay dense.

The rows of ``attn_q`` and ``attn_k`` are in llama.cpp's interleaved rotary order
(:func:`.gguf_reader.unpermute_qk`): codes, scales and zeros are reordered alike, row for row.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .gguf_reader import _BLOCK_TENSORS, _GLOBAL_TENSORS, _field, _reader, unpermute_qk
from .quant import Int4Linear, Quantized, check_kernels, linear_slots

__all__ = ["BLOCK_TYPES", "decode_blocks", "gguf_linears"]

log = logging.getLogger(__name__)

BLOCK = 32  # weights a block, every type here
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")


def _halves(raw: np.ndarray, rows: int) -> tuple[np.ndarray, ...]:
    return tuple(np.ascontiguousarray(raw[..., i:j]).view(np.float16).astype(np.float32).reshape(rows, -1)
                 for i, j in ((0, 2), (2, 4)))


def _nibbles(qs: np.ndarray, rows: int) -> np.ndarray:
    """[rows, blocks, 16] bytes -> [rows, blocks * 32] codes 0..15 (low halves first, as ggml)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [N, S, 144] -> codes [N, S * 256], scale and zero [N, S * 8]: eight groups of
    32 a super-block, ``w = d * sc_j * q - dmin * m_j`` (``sc_j``, ``m_j`` 6-bit, packed in 12 bytes
    as ``gguf.quants.Q4_K.get_scale_min`` reads them); ``d * sc_j`` is exact in fp32."""
    from gguf.quants import Q4_K

    rows, supers = blocks.shape[:2]
    d, dmin = (np.ascontiguousarray(blocks[..., i:i + 2]).view(np.float16).astype(np.float32) for i in (0, 2))
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(rows * supers, 12))
    scale = d * sc.reshape(rows, supers, 8).astype(np.float32)  # [N, S, 8]
    zero = 8 * scale - dmin * m.reshape(rows, supers, 8).astype(np.float32)
    qs = blocks[..., 16:].reshape(rows, supers, 4, 1, 32)  # 64 weights a chunk: low halves, then high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1)
    return codes, scale.reshape(rows, -1), zero.reshape(rows, -1)


def decode_blocks(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A tensor's blocks as the int4 kernel's operands.

    Parameters
    ----------
    raw : ndarray [N, bytes a row], uint8
        The GGUF tensor's data as ``gguf.GGUFReader`` gives it (rows in the file's order).
    kind : str
        One of :data:`BLOCK_TYPES`.

    Returns ``(codes [N, K * copies] uint8 in 0..15, scale [N, K * copies / 32] float32, zero like
    scale, copies)``.
    """
    rows = raw.shape[0]
    if kind == "Q8_0":
        blocks = raw.reshape(rows, -1, 34)
        d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32).reshape(rows, -1)
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1).astype(np.int16)
        high, low = q >> 4, q & 0x0F  # q = 16 * high + low: arithmetic shift, high in -8..7
        codes = np.concatenate([high + 8, low], axis=1)
        scale = np.concatenate([16 * d, d], axis=1)
        zero = np.concatenate([np.zeros_like(d), 8 * d], axis=1)
        copies = 2
    elif kind == "Q4_K":
        codes, scale, zero = _q4_k(raw.reshape(rows, -1, 144))
        copies = 1
    elif kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(rows, -1, size)
        d, m = _halves(blocks, rows)
        codes = _nibbles(blocks[..., size - 16:], rows)
        scale, zero, copies = d, (np.zeros_like(d) if kind == "Q4_0" else m + 8 * d), 1
    else:
        raise ValueError(f"GGUF blocks of type {kind} are not read here: {', '.join(BLOCK_TYPES)}")
    return (torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(scale.astype(np.float32)),
            torch.from_numpy(zero.astype(np.float32)), copies)


def _module_names(reader) -> dict[str, str]:
    """GGUF tensor name -> the transformers Llama module it is the weight of."""
    names = {gguf: hf.removesuffix(".weight") for gguf, hf in _GLOBAL_TENSORS.items()}
    blocks = _field(reader, "llama.block_count", 0)
    for i in range(blocks):
        for gguf, hf in _BLOCK_TENSORS.items():
            names[f"blk.{i}.{gguf}"] = f"model.layers.{i}.{hf.removesuffix('.weight')}"
    if all(t.name != "output.weight" for t in reader.tensors):  # tied: the head is the embedding's blocks
        names["token_embd.weight"] = "lm_head"
    else:
        del names["token_embd.weight"]
    return names


def _int4_linear(tensor, kind: str, linear: nn.Linear, heads: int | None, dtype: torch.dtype) -> Int4Linear:
    """One GGUF tensor's blocks as an :class:`Int4Linear` standing in for ``linear``; ``heads``:
    undo the rotary row order for that many heads (q_proj, k_proj)."""
    codes, scale, zero, copies = decode_blocks(np.asarray(tensor.data), kind)
    if (codes.shape[0], codes.shape[1] // copies) != tuple(linear.weight.shape):
        raise ValueError(f"GGUF tensor {tensor.name} is [{codes.shape[0]}, {codes.shape[1] // copies}] but the "
                         f"model's layer is {list(linear.weight.shape)}: this file is not this model's")
    if heads is not None:
        codes, scale, zero = (unpermute_qk(t, heads) for t in (codes, scale, zero))
    return Int4Linear(codes, scale, zero, BLOCK, linear.bias, copies=copies, dtype=dtype)


def gguf_linears(model: nn.Module, path: str | os.PathLike, head: bool = False) -> Quantized:
    """Swap ``model``'s linear layers, in place, for :class:`~.quant.Int4Linear` layers on the
    GGUF file's own blocks wherever the file stores them as Q4_0, Q4_1, Q4_K or Q8_0; other layers
    (F32, F16, other block types) stay dense, as the model holds them. The output head is
    swapped only with ``head`` (see :func:`~.quant.quantize_linears`).

    ``model`` is the file's model (a transformers Llama, as :func:`~treespec.models.load` gives
    it), on the CPU; shapes are checked against the file. Raises ValueError for a file that is no
    Llama GGUF or holds none of these block types.
    """
    check_kernels(next(model.parameters()).device)
    dtype = next(model.parameters()).dtype
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"weights='gguf' reads Llama GGUFs (llama.cpp's tensor names and rotary order); {path} "
                         f"is {arch!r}: use weights='int4' or 'int8' to quantize it on load")
    heads = {"attn_q.weight": _field(reader, "llama.attention.head_count")}
    heads["attn_k.weight"] = _field(reader, "llama.attention.head_count_kv", heads["attn_q.weight"])
    names = _module_names(reader)
    slots, skipped = linear_slots(model, head)
    by_name = {name: (parent, attr, linear) for name, parent, attr, linear in slots}
    swapped, dense = [], [(name, "output head") for name in skipped]
    with torch.no_grad():
        for tensor in reader.tensors:
            name = names.get(tensor.name)
            if name not in by_name:
                continue
            parent, attr, linear = by_name.pop(name)
            kind = tensor.tensor_type.name
            if kind not in BLOCK_TYPES:
                dense.append((name, f"{kind} in the file"))
                continue
            setattr(parent, attr, _int4_linear(tensor, kind, linear, heads.get(tensor.name.split(".", 2)[-1]), dtype))
            swapped.append(name)
    dense += [(name, "not in the file") for name in by_name]
    if not swapped:
        raise ValueError(f"{Path(path).name} holds no linear weights in {', '.join(BLOCK_TYPES)} blocks (its "
                         f"linears: {', '.join(sorted({why for _, why in dense}))}): use weights='int4' or 'int8' "
                         "to quantize on load, or 'dense'")
    summary = Quantized("gguf", tuple(swapped), tuple(dense))
    log.info("%s: %s", Path(path).name, summary.describe())
    return summary
