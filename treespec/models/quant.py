"""Linear layers on 4-bit and 8-bit weights, run by torch's CPU kernels.

A forward of a small model on a CPU reads every weight once: in bf16, 270 MB a forward for
SmolLM2-135M, against about 80 MB for the 4-bit blocks of the GGUF it ships as. torch has CPU
kernels for both formats (``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``);
this module puts ``nn.Linear`` layers on them::

    summary = quantize_linears(model, "int4")        # in place; the output head stays dense
    model, tok = treespec.models.load("smollm2-135m-instruct", dtype=torch.bfloat16, weights="gguf")

The formats, exactly as the kernels compute them (``W`` is ``[N out, K in]``):

- int4 (:class:`Int4Linear`): ``W[n, k] = (q - 8) * scale[n, k // G] + zero[n, k // G]``, ``q`` in
  0..15, groups of ``G`` = 32, 64, 128 or 256 inputs. llama.cpp's Q4_0 and Q4_1 blocks are this
  form exactly (:mod:`.gguf_blocks`); quantized on load, each group maps its min..max onto 0..15.
- int8 (:class:`Int8Linear`): ``W[n, k] = q * scale[n]``, ``q`` in -128..127, one scale a row
  (the kernel takes no groups), quantized on load symmetric about 0. K must be a multiple of 16:
  torch 2.13's bf16 kernel reads past the end of other rows (a segmentation fault, found here).

The kernels take scales in the activations' dtype: in bf16 the scales and zeros are rounded to
bf16 (the weights a dense bf16 model holds are rounded the same way), in fp32 they are exact. The
fp32 int4 kernel has no vectorised path (tens of times slower than bf16): fp32 is for checking.

What a quantized model outputs is its own: treespec's guarantee (the output of the target alone)
then holds with respect to the quantized target, which is the model the user runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import compiled

__all__ = ["WEIGHTS", "GROUP_SIZES", "Int4Linear", "Int8Linear", "WidthSplitLinear", "Quantized", "check_kernels",
           "quantize_linears", "keep_dense", "set_split_rows", "weights_format"]

log = logging.getLogger(__name__)

#: what ``load(..., weights=...)`` and ``--weights`` take: dense (the model's own dtype, as before),
#: the GGUF file's own 4-bit/8-bit blocks, or quantized on load; ``+dense``: the dense weights kept
#: beside them for wide forwards (:class:`WidthSplitLinear`)
WEIGHTS = ("dense", "gguf", "int4", "int8", "gguf+dense", "int4+dense", "int8+dense")
#: a split layer's quantized rows before the width is measured (:func:`treespec.split_choice.choose_split_rows`)
DEFAULT_SPLIT_ROWS = 4
#: the int4 kernel's group sizes
GROUP_SIZES = (32, 64, 128, 256)
_ROWS = 16  # the int4 kernel packs rows in blocks of 16: other counts are padded with zero rows
_INT8_K = 16  # the bf16 int8 kernel crashes on other in_features (torch 2.13, M > 1 rows)


def check_kernels(device: torch.device | str = "cpu") -> None:
    """Raise a ValueError saying what is missing where torch's 4-bit/8-bit CPU kernels cannot run."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"4-bit and 8-bit weights run on torch's CPU kernels; this model is on {device}: "
                         "load it on the CPU, or keep dense weights on a GPU")
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        raise ValueError(f"4-bit CPU weights need torch >= 2.6 (aten._weight_int4pack_mm_for_cpu); this is "
                         f"torch {torch.__version__}: upgrade torch, or keep dense weights")


class Int4Linear(nn.Module):
    """``y = x W^T + b`` on 4-bit weights in groups: ``W[n, k] = (q - 8) * scale + zero``.

    Parameters
    ----------
    q : Tensor [N, K * copies], integers in 0..15
    scale, zero : Tensor [N, K * copies / group], float
        Per group of ``group`` inputs; stored in ``dtype`` (the activations' dtype: the kernel's rule).
    group : int
        One of :data:`GROUP_SIZES`; divides ``K * copies``.
    bias : Tensor [N] or None
    copies : int
        How many times the input is read along K (each copy against its own columns of ``q``):
        1, or 2 for weights split into two 4-bit halves (GGUF Q8_0, :mod:`.gguf_blocks`).
    dtype : torch.dtype
        The activations' dtype.

    The packed codes and the scales are frozen parameters (as bitsandbytes and torchao hold
    theirs): parameter counts, which key the cached cost curves (``costs.model_identity``), tell
    a dense model and each format apart.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None, copies: int = 1, dtype: torch.dtype = torch.float32):
        super().__init__()
        check_kernels()
        n, k = q.shape
        if group not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group}")
        if k % (group * copies) or scale.shape != (n, k // group) or zero.shape != scale.shape:
            raise ValueError(f"int4 codes [{n}, {k}] need K a multiple of group {group} x copies {copies} and "
                             f"scales and zeros [{n}, {k // group}]; got {tuple(scale.shape)}, {tuple(zero.shape)}")
        self.in_features, self.out_features, self.group, self.copies = k // copies, n, group, copies
        pad = -n % _ROWS  # padded rows: code 8, zero 0 -> weight 0, sliced off the output
        q = F.pad(q.to(torch.int32), (0, 0, 0, pad), value=8)
        scale, zero = (F.pad(t.float(), (0, 0, 0, pad)) for t in (scale, zero))
        with torch.no_grad():
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)  # [N + pad, K / 2] uint8
            scales_and_zeros = torch.stack([scale.t(), zero.t()], -1).to(dtype).contiguous()  # [K / G, N + pad, 2]
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.scales_and_zeros = nn.Parameter(scales_and_zeros, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = 32) -> "Int4Linear":
        """``linear`` quantized: each group of ``group`` inputs maps its min..max onto codes 0..15
        (scale and zero rounded to the weight's dtype first, and the codes fitted to them)."""
        w, dtype = linear.weight.detach(), linear.weight.dtype
        n, k = w.shape
        if k % group:
            raise ValueError(f"int4 groups of {group} need in_features a multiple of {group}, got {k}")
        g = w.float().view(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).to(dtype).float()
        zero = (lo + 8 * scale).to(dtype).float()
        step = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
        q = (torch.round((g - zero[..., None]) / step) + 8).clamp(0, 15).view(n, k)
        return cls(q, scale, zero, group, linear.bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(self.scales_and_zeros.dtype)  # [M, K]: the kernel's 2-D, its dtype
        x2 = x2.repeat(1, self.copies) if self.copies > 1 else x2.contiguous()  # [M, K * copies]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_and_zeros)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features].contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype).view(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """``W`` [N, K] as the kernel multiplies by it, in the scales' dtype: the kernel run over an
        identity matrix (for checks; seconds for a vocabulary-sized head)."""
        k = self.in_features * self.copies
        eye = torch.eye(k, dtype=self.scales_and_zeros.dtype)
        with torch.no_grad():
            wt = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales_and_zeros)
        w = wt[:, : self.out_features].t()  # [N, K * copies]
        if self.copies == 1:
            return w
        return w.float().reshape(self.out_features, self.copies, self.in_features).sum(1).to(w.dtype)  # rounded once

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (:meth:`dequantize`), for code that reads a Linear's weight; the
        forward never reads it."""
        return self.dequantize()

    def extra_repr(self) -> str:
        split = f", copies={self.copies}" if self.copies > 1 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}{split}, "
                f"bias={self.bias is not None}, int4")


class Int8Linear(nn.Module):
    """``y = x W^T + b`` on 8-bit weights, one scale a row: ``W[n, k] = q[n, k] * scale[n]``.

    Parameters
    ----------
    q : Tensor [N, K], int8
    scale : Tensor [N], float, stored in ``dtype`` (the activations' dtype: the kernel's rule)
    bias : Tensor [N] or None
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        check_kernels()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != q.shape[:1] or q.shape[1] % _INT8_K:
            raise ValueError(f"int8 weights need codes [N, K] int8 with K a multiple of {_INT8_K} and scales [N]; "
                             f"got {q.dtype} {tuple(q.shape)} and {tuple(scale.shape)}")
        self.out_features, self.in_features = q.shape
        self.qweight = nn.Parameter(q.contiguous(), requires_grad=False)
        self.scale = nn.Parameter(scale.detach().to(dtype), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """``linear`` quantized symmetric about 0, a scale a row (rounded to the weight's dtype
        first, and the codes fitted to it)."""
        w, dtype = linear.weight.detach().float(), linear.weight.dtype
        scale = (w.abs().amax(-1) / 127).to(dtype).float()
        step = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        q = torch.round(w / step).clamp(-128, 127).to(torch.int8)
        return cls(q, scale, linear.bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(self.scale.dtype).contiguous()  # [M, K]
        y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype).view(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """``W`` [N, K] in float32: the codes times their row's scale."""
        return self.qweight.float() * self.scale.float()[:, None]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, in the scales' dtype, for code that reads a Linear's weight."""
        return self.dequantize().to(self.scale.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class WidthSplitLinear(nn.Module):
    """One linear layer on two copies of its weight: ``quantized`` (an :class:`Int4Linear` or
    :class:`Int8Linear`) for forwards of up to ``max_rows`` rows, ``dense`` (an ``nn.Linear``,
    which :class:`~treespec.packing.PackedLinears` packs like any other) above.

    At decode widths a forward reads every weight once and the 4-bit kernel reads a quarter of
    the bytes; at a verify tree's width torch's 4-bit kernel falls behind the dense product
    (issue 48: 210 linears, one thread, 1 row 15.5 ms 4-bit against 40.0 dense, 16 rows 43.3
    against 40.3). Both copies hold the same weights up to the kernels' rounding (the dense one
    is what the quantized one de-quantizes to, rounded to the model's dtype), so a forward's
    output does not depend on which ran beyond that rounding. Compiled on a CPU with inductor's
    GEMM templates (:func:`treespec.compiled.cpu_options`), the quantized copy runs at every
    width: the template de-quantizes inside the product and keeps up with the dense one at a
    tree's width (docs/runtime.md, "Fixed-shape verify"), and a graph with no dense linear in it
    is one inductor can cache on disk (oneDNN-packed constants are not).
    """

    def __init__(self, quantized: nn.Module, dense: nn.Linear, max_rows: int = DEFAULT_SPLIT_ROWS):
        super().__init__()
        if (quantized.in_features, quantized.out_features) != (dense.in_features, dense.out_features):
            raise ValueError(f"a width split needs one layer's two copies: {quantized} and {dense} differ in shape")
        self.quantized, self.dense, self.max_rows = quantized, dense, max_rows
        self.in_features, self.out_features = dense.in_features, dense.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= self.max_rows or (torch.compiler.is_compiling() and compiled.templates_active()):
            return self.quantized(x)
        return self.dense(x)

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight

    def extra_repr(self) -> str:
        return f"quantized up to {self.max_rows} rows, dense above"


def keep_dense(model: nn.Module, max_rows: int = DEFAULT_SPLIT_ROWS) -> int:
    """Give each quantized layer of ``model`` a dense copy of its own weights (what it
    de-quantizes to, in its scales' dtype: :meth:`Int4Linear.dequantize`) and wrap the two in a
    :class:`WidthSplitLinear`, in place; returns how many. The copy is of the quantized weights,
    not of any weights the model had before: wide forwards run the same model as narrow ones."""
    count = 0
    with torch.no_grad():
        for parent_name, parent in list(model.named_modules()):
            for attr, child in list(parent.named_children()):
                if not isinstance(child, (Int4Linear, Int8Linear)) or isinstance(parent, WidthSplitLinear):
                    continue
                w = child.dequantize().to(child.scale.dtype if isinstance(child, Int8Linear)
                                          else child.scales_and_zeros.dtype)
                dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                  dtype=w.dtype, device=w.device)
                dense.weight.copy_(w)
                if child.bias is not None:
                    dense.bias.copy_(child.bias)
                dense.requires_grad_(False)
                setattr(parent, attr, WidthSplitLinear(child, dense, max_rows))
                count += 1
    return count


def set_split_rows(model: nn.Module, max_rows: int) -> int:
    """Set every :class:`WidthSplitLinear`'s ``max_rows``; returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, WidthSplitLinear)]
    for m in layers:
        m.max_rows = max_rows
    return len(layers)


@dataclass(frozen=True)
class Quantized:
    """What a swap did: ``swapped`` the module names now on 4-bit/8-bit weights, ``dense`` each
    module left dense with the reason."""

    weights: str
    swapped: tuple[str, ...]
    dense: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        """One line for the log."""
        kept = ""
        if self.dense:
            reasons: dict[str, int] = {}
            for _, why in self.dense:
                reasons[why] = reasons.get(why, 0) + 1
            kept = "; dense: " + ", ".join(f"{n} ({why})" for why, n in reasons.items())
        return f"{self.weights} weights: {len(self.swapped)} linear layers{kept}"


def linear_slots(model: nn.Module, head: bool):
    """``(qualified name, parent, attribute, nn.Linear)`` for each ``nn.Linear`` child of
    ``model``'s modules, and the names of the output head's slots when ``head`` is False (they
    stay dense). A Linear held in two places is listed at each."""
    out_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    slots, skipped = [], []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if type(child) is not nn.Linear:
                continue
            name = f"{parent_name}.{attr}" if parent_name else attr
            if child is out_head and not head:
                skipped.append(name)
            else:
                slots.append((name, parent, attr, child))
    return slots, skipped


def quantize_linears(model: nn.Module, weights: str, group: int = 32, head: bool = False) -> Quantized:
    """Swap ``model``'s ``nn.Linear`` layers, in place, for :class:`Int4Linear` (``weights="int4"``,
    groups of ``group``) or :class:`Int8Linear` (``"int8"``) quantized from their weights; the
    dense weights are dropped with them. The output head (``get_output_embeddings()``) stays
    dense unless ``head``: it sets every logit, and is often the input embedding too.

    A layer whose in_features ``group`` (int4) or 16 (int8) does not divide stays dense; the
    summary says which.
    The model must be on the CPU, in float32 or bfloat16 (the scales are stored in its dtype).
    """
    if weights not in ("int4", "int8"):
        raise ValueError(f"quantize_linears makes int4 or int8 weights, not {weights!r}")
    if group not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group}")
    p = next(model.parameters())
    check_kernels(p.device)
    slots, skipped = linear_slots(model, head)
    dense = [(name, "output head") for name in skipped]
    made: dict[int, nn.Module] = {}  # a Linear held in two places is quantized once
    swapped = []
    with torch.no_grad():
        for name, parent, attr, linear in slots:
            multiple = group if weights == "int4" else _INT8_K
            if linear.in_features % multiple:
                dense.append((name, f"in_features not a multiple of {multiple}"))
                continue
            if id(linear) not in made:
                made[id(linear)] = (Int4Linear.from_linear(linear, group) if weights == "int4"
                                    else Int8Linear.from_linear(linear))
            setattr(parent, attr, made[id(linear)])
            swapped.append(name)
    summary = Quantized(f"{weights}-g{group}" if weights == "int4" else weights, tuple(swapped), tuple(dense))
    log.info("%s", summary.describe())
    return summary


def weights_format(model: nn.Module) -> str:
    """What the model's linear layers run on: ``"dense"``, ``"int4-g32"``, ``"int8"``, or several
    joined by ``+`` (e.g. ``"dense+int4-g32"`` with a dense output head), sorted; ``splitN`` where
    quantized layers keep their dense copies above N rows (:class:`WidthSplitLinear`)."""
    kinds = set()
    for m in model.modules():
        if isinstance(m, WidthSplitLinear):
            kinds.add(f"split{m.max_rows}")
        elif isinstance(m, Int4Linear):
            kinds.add(f"int4-g{m.group}" + ("x2" if m.copies > 1 else ""))
        elif isinstance(m, Int8Linear):
            kinds.add("int8")
        elif isinstance(m, nn.Linear) or type(m).__name__ == "PackedLinear":
            kinds.add("dense")
    return "+".join(sorted(kinds)) or "dense"
