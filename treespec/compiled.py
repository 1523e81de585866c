"""``torch.compile`` as treespec uses it on fixed shapes: the verify forward
(:mod:`treespec.fixed_shape`) and the draft head's passes (:mod:`treespec.drafters.graphs`).

:func:`compile_fixed` compiles with dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT`
(one compiled version per bucket and row length). On a CPU the verify forward compiles with
:func:`cpu_options`: inductor's ``freezing`` makes the weights constants of each graph, so that
its C++ GEMM templates (AMX or AVX-512 micro-kernels; 4-bit weights de-quantized inside the
product) can take the linears, about twice as fast as oneDNN's or ATen's 4-bit kernel at a
verify tree's width (docs/runtime.md, "Fixed-shape verify"). The price: each compiled bucket
holds the weights it packed for itself (memory a bucket, docs/runtime.md), and a graph keeps the
weights it was compiled with (treespec compiles per model and never changes weights after).
oneDNN-packed linears (:class:`~treespec.packing.PackedLinear`) are called through one opaque
operation (``treespec::packed_linear``) on the one packed copy the eager forward uses.
"""

from __future__ import annotations

import contextlib
import types
import warnings
import weakref
from typing import Callable

import torch

__all__ = ["compile_fixed", "compile_for_model", "own_code", "cpu_options", "templates_active", "GEMM_TEMPLATES",
           "SKIP_MODULE_GUARDS", "pow2_row", "RECOMPILE_LIMIT", "COMPILED_MIN_ROW", "COMPILED_VERIFY_ROW"]

#: compiled versions dynamo keeps of one function: one per bucket and cache shape for the
#: verify forward (its default of 8 would leave later shapes eager)
RECOMPILE_LIMIT = 64


#: the shortest cache row a compiled head pass takes: most chats and benchmark prompts with their
#: budget fit, so one compile serves them all (a short warm-up's included)
COMPILED_MIN_ROW = 512

#: the shortest cache row the compiled verify forward takes. It attends over the keys in use
#: only (:data:`treespec.fixed_shape.KEY_STEP`), so a long row costs memory, not time (SmolLM2-135M
#: in bf16: 23 KB a position, 47 MB a row), while every other row length compiles every bucket
#: again (a minute or more): every Spec-Bench prompt with 128 new tokens fits one.
COMPILED_VERIFY_ROW = 2048


def pow2_row(tokens: int, at_least: int = 0) -> int:
    """A row length that holds ``tokens`` positions: a power of two (a row a little longer than
    the last fits it), ``at_least`` long (:data:`COMPILED_MIN_ROW` for a compiled forward, every
    row length being a new shape to compile)."""
    return max(1 << max(tokens - 1, 1).bit_length(), at_least)


#: compile the CPU verify forward with inductor's own GEMM kernels (see :func:`cpu_options`)
GEMM_TEMPLATES = True


def cpu_options() -> dict:
    """Inductor's options for a CPU forward on fixed shapes: the weights frozen into the graph
    (``freezing``) so that inductor's C++ GEMM templates (AMX/AVX-512 micro-kernels, 4-bit
    weights de-quantized inside the product) can take every linear, chosen against ATen's by
    timing each shape once when it compiles (``max_autotune``; inductor's on-disk caches keep
    the choice). Empty with :data:`GEMM_TEMPLATES` off."""
    if not GEMM_TEMPLATES:
        return {}
    return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "max_autotune_report_choices_stats": False}


def templates_active() -> bool:
    """Whether the compile now running is one with :func:`cpu_options` (inductor's GEMM templates
    on frozen weights): what a module traced by it may choose its path by."""
    import torch._inductor.config as inductor

    return GEMM_TEMPLATES and inductor.freezing and inductor.max_autotune


@contextlib.contextmanager
def _quiet_autotune():
    """Inductor writes each autotuning's timings to stderr (``select_algorithm.PRINT_AUTOTUNE``, a
    module flag, no option) and warns about a deprecated storage call while it tunes: library
    code does not print, so both are off while a compiled call runs (the flag restored after)."""
    from torch._inductor import select_algorithm

    before = getattr(select_algorithm, "PRINT_AUTOTUNE", None)
    select_algorithm.PRINT_AUTOTUNE = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            yield
    finally:
        select_algorithm.PRINT_AUTOTUNE = before


def compile_fixed(fn: Callable, inductor: dict | None = None, **compile_kwargs) -> Callable:
    """``fn`` through ``torch.compile(**compile_kwargs)``, each call made with dynamo's recompile
    limit at :data:`RECOMPILE_LIMIT` and, given ``inductor`` options (:func:`cpu_options`),
    inductor's config patched with them (``torch.compile(options=)`` does not reach
    ``freezing``, read outside its patch) and its autotuning quiet."""
    import torch._inductor.config  # noqa: F401  (torch.compile imports it anyway)

    compiled = torch.compile(fn, **compile_kwargs)
    patch = torch._inductor.config.patch(**inductor) if inductor else contextlib.nullcontext()
    quiet = _quiet_autotune if inductor else contextlib.nullcontext

    def run(*args):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), patch, quiet():
            return compiled(*args)

    return run


#: :func:`compile_for_model` drops dynamo's guards on the model's modules (False: keeps them,
#: as ``torch.compile`` does; set it before the first compile)
SKIP_MODULE_GUARDS = True

# model -> {key: its compiled function}: :func:`compile_for_model`'s
_PER_MODEL: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def own_code(fn: Callable) -> types.FunctionType:
    """``fn`` on a copy of its code object: dynamo keeps compiled graphs (and guards) per code
    object, so a copy compiles and is reset apart from every other use of ``fn``."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_for_model(fn: Callable, model: torch.nn.Module, key, inductor: dict | None = None,
                      **compile_kwargs) -> Callable:
    """:func:`compile_fixed` of ``fn``, once per ``model`` and ``key``, on a code object of its own
    per model, with dynamo's guards on the model's modules dropped.

    Why: dynamo checks a compiled function's guards at every call, and a forward through a
    transformers model carries thousands of them (every submodule's type, attributes, hooks,
    config, partly in Python): 0.72 ms a call for the verify forward with its six buckets
    compiled, against 0.13 ms without the module guards (docs/runtime.md, "Fixed-shape verify").
    What they guard is that the modules do not change, which a compiled verify
    forward already assumes of the model: frozen, its weights are constants of the graph. Tensor,
    argument and global guards stay, so buckets, cache shapes and ``capture`` still pick their
    graph. Dynamo keeps compiled graphs per code object, and without the module guards nothing
    would tell two models of one shape apart: each model compiles a copy of ``fn`` with a code
    object of its own (inductor's on-disk cache still serves the graphs, which do not name it)."""
    per_model = _PER_MODEL.setdefault(model, {})
    if key not in per_model:
        own = own_code(fn)
        if SKIP_MODULE_GUARDS:
            skip = torch.compiler.skip_guard_on_all_nn_modules_unsafe
            compile_kwargs = {**compile_kwargs, "options": {"guard_filter_fn": skip}}
        per_model[key] = compile_fixed(own, inductor, **compile_kwargs)
    return per_model[key]
