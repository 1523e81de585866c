"""oneDNN-packed linear weights: the CPU fast path for a verify forward.

A transformer's forward on a CPU at batch 1 is its ``nn.Linear`` layers: for
SmolLM2-135M, 211 weight matrices read once per forward. PyTorch's eager ``F.linear``
hands fp32 to MKL's ``sgemm``, whose small-M (2-16 rows) kernels are several times
slower than one row on some CPUs (AMD Zen 4 measured, see docs/benchmarks.md), and bf16
to oneDNN, which reorders the weight into its blocked layout again at every call. Packing
each weight once into oneDNN's layout (``torch.ops.mkldnn._reorder_linear_weight``, what
inductor's weight prepacking does) and calling ``_linear_pointwise`` removes both: the
forward of 16 tree tokens then costs little more than the forward of one.

    packed = PackedLinears(model)     # start-up: packs every nn.Linear once (docs/runtime.md)
    with packed:                      # the model's Linear layers run on the packed copies
        treespec.generate(model, ...)
        model.generate(...)           # the same advantage for the baseline

The output is the same computation (bf16: bit-identical logits measured; fp32: within
1e-4, oneDNN and MKL sum in different orders). The packed copies double the memory of
the linear weights while they exist. CPU only, fp32 and bf16 (bf16 where oneDNN can pack it:
:func:`onednn_packs`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Optional

import torch
from torch import nn

__all__ = ["PackedLinear", "PackedLinears", "packing_supported", "onednn_packs", "native_bf16", "default_dtype"]

log = logging.getLogger(__name__)

#: rows a verify forward typically runs; oneDNN chooses its blocked layout for this M.
DEFAULT_BATCH_HINT = 16

# Set by :func:`dense_in_compiled_graphs`: a graph traced meanwhile reads a PackedLinear's dense
# weight. A plain global, which dynamo guards on: a graph traced in another thread while it is set
# traces the dense product too, and compiles again on its next call.
_DENSE_IN_GRAPHS = False


@contextlib.contextmanager
def dense_in_compiled_graphs():
    """While a function is compiled inside this, a :class:`PackedLinear` it traces is the plain
    product on the layer's dense weight, not the opaque call on the packed one: with the weights
    frozen (:func:`treespec.compiled.cpu_options`) inductor then generates the product itself
    (its C++ GEMM templates), which for the draft head's small products is faster than oneDNN's
    call (docs/runtime.md, "Fixed-shape verify")."""
    global _DENSE_IN_GRAPHS
    previous, _DENSE_IN_GRAPHS = _DENSE_IN_GRAPHS, True
    try:
        yield
    finally:
        _DENSE_IN_GRAPHS = previous


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies ``dtype`` weights on this CPU.

    fp32 packs wherever oneDNN is built in; bf16 needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT
    (AMD Zen 3, for one, has neither). Asked of oneDNN itself, with a tiny weight, once.
    """
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            w = torch.zeros(8, 8, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as e:
        log.info("oneDNN cannot pack %s weights on this CPU: %s", dtype, e)
        return False
    return True


def packing_supported(model) -> bool:
    """Whether ``model``'s linear layers can run on oneDNN-packed weights here."""
    p = next(model.parameters())
    return p.device.type == "cpu" and onednn_packs(p.dtype)


@torch.library.custom_op("treespec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """oneDNN's product with a weight it packed, as one operation a compiled graph calls: inductor
    lowers ``mkldnn._linear_pointwise`` only on weights it packed itself (as constants, each graph
    its own copy), so a compiled forward reaches :class:`PackedLinear`'s packed weight through
    this, one copy shared by every graph and by the eager forward."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose forward runs on a oneDNN-packed copy of its weight.

    ``weight`` and ``bias`` are the original parameters (shared, not copied), so a state
    dict or a tied embedding is unchanged; ``packed`` is oneDNN's opaque layout.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = DEFAULT_BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        if torch.compiler.is_compiling():  # an opaque call for inductor, the packed weight an input
            if _DENSE_IN_GRAPHS:
                return nn.functional.linear(x, self.weight, self.bias)
            return packed_linear(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


class PackedLinears:
    """Packed copies of every ``nn.Linear`` of ``model`` (and of ``more`` modules, e.g. a
    draft head: :meth:`~treespec.drafters.base.Drafter.modules`), swapped in by ``with``.

    Packing happens once, here; entering and leaving the ``with`` block only swaps module
    references (microseconds), so a benchmark can run the plain model and the packed one
    side by side. On leaving, the model holds exactly its original modules again, also
    after an exception.

    Args:
        model:      a CPU model in float32 or bfloat16.
        batch_hint: the number of rows oneDNN optimises the layout for (any count runs).
    """

    description = "oneDNN-packed linear weights"

    def __init__(self, model: nn.Module, *more: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT):
        bad = next((m for m in (model, *more) if not packing_supported(m)), None)
        if bad is not None:
            p = next(bad.parameters())
            if p.device.type == "cpu" and p.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
                raise ValueError(
                    "oneDNN cannot pack bfloat16 weights on this CPU (it needs AVX512 BW/VL/DQ or "
                    "AVX-NE-CONVERT): load the model in float32 (--dtype float32 or auto on the command "
                    "line; treespec.packing.default_dtype() from Python picks bf16 only where the CPU computes "
                    "it natively) or run it without packing (--no-pack)"
                )
            raise ValueError(
                f"packed weights need a CPU model in float32 or bfloat16 with oneDNN available; "
                f"this one is {p.dtype} on {p.device} (mkldnn available: "
                f"{torch.backends.mkldnn.is_available()}): run it without packing"
            )
        t0 = time.perf_counter()
        self.model = model
        # (parent module, attribute name, original Linear, packed replacement)
        self._swaps: list[tuple[nn.Module, str, nn.Linear, PackedLinear]] = []
        seen: set[tuple[int, str]] = set()  # (parent, attribute) already swapped
        packed: dict[int, PackedLinear] = {}  # a Linear shared by two modules is packed once
        with torch.inference_mode():
            for root in (model, *more):
                for parent in root.modules():
                    for name, child in parent.named_children():
                        if type(child) is nn.Linear and (id(parent), name) not in seen:
                            seen.add((id(parent), name))
                            if id(child) not in packed:
                                packed[id(child)] = PackedLinear(child, batch_hint)
                            self._swaps.append((parent, name, child, packed[id(child)]))
        self._depth = 0
        self.pack_seconds = time.perf_counter() - t0
        log.info("packed %d linear layers for oneDNN in %.2f s", len(self._swaps), self.pack_seconds)

    def __len__(self) -> int:
        return len(self._swaps)

    def __enter__(self) -> "PackedLinears":
        if self._depth == 0:
            for parent, name, _, packed in self._swaps:
                setattr(parent, name, packed)
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            for parent, name, linear, _ in self._swaps:
                setattr(parent, name, linear)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products in hardware (AVX512-BF16 or AMX).

    Without it oneDNN emulates bf16 with fp32 arithmetic plus conversions, slower than fp32.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype(device: str = "cpu") -> torch.dtype:
    """bf16 on a GPU and on a CPU with native bf16 (there a forward is faster in bf16 than in
    fp32: docs/benchmarks.md), else fp32."""
    if torch.device(device).type == "cuda" or native_bf16():
        return torch.bfloat16
    return torch.float32
