"""``torch.compile`` and CUDA graphs as treespec uses them on fixed shapes: the verify forward
(:mod:`treespec.fixed_shape`) and the draft head's passes (:mod:`treespec.drafters.graphs`).
A body is captured in a CUDA graph with :func:`capture_graph`, and replayed (captured on first
use) with :func:`replay`.

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
import logging
import types
import warnings
import weakref
from typing import Callable

import torch

log = logging.getLogger(__name__)

__all__ = ["compile_fixed", "capture_graph", "replay", "compile_for_model", "own_code", "cpu_options", "templates_active",
           "GEMM_TEMPLATES",
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


def cpu_options(dtype: torch.dtype = torch.float32) -> dict:
    """Inductor's options for a CPU forward on fixed shapes of a model in ``dtype``: the weights
    frozen into the graph (``freezing``) so that inductor's C++ GEMM templates (AMX/AVX-512
    micro-kernels, 4-bit weights de-quantized inside the product) can take every linear, chosen
    against ATen's by timing each shape once when it compiles (``max_autotune``; inductor's
    on-disk caches keep the choice). Empty with :data:`GEMM_TEMPLATES` off, and for a bf16 or
    fp16 model on a CPU without AVX-512 (:func:`templates_fit`)."""
    if not (GEMM_TEMPLATES and templates_fit(dtype)):
        return {}
    return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "max_autotune_report_choices_stats": False}


def templates_fit(dtype: torch.dtype) -> bool:
    """Whether inductor's GEMM templates may take a ``dtype`` model's products on this CPU. Not a
    bf16 or fp16 one below AVX-512: on an AVX2 AMD EPYC (Zen 3, torch 2.13) a bf16 tiny model
    compiled with them gave logits 31.7 off its eager ones (18 at most), where the test's bound is
    2% of that
    (``tests/model/test_fixed_shape.py::test_two_models_of_one_shape_each_run_their_own_compiled_graphs``
    failed there, and passes without them); the templates' speed was measured on AMX and AVX-512
    only."""
    if dtype not in (torch.bfloat16, torch.float16):
        return True
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


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


def capture_graph(body: Callable[[], None], pool) -> "torch.cuda.CUDAGraph":
    """``body`` captured in a CUDA graph (in the memory ``pool``), on the current device. Warmed
    up on a side stream first (lazy initialisation, kernel choice), as torch.cuda.graphs asks:
    the bodies treespec captures (the verify forward, the head's passes) only write K/V that
    they compute again, so running twice is safe."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA work (a second generate) does not break this capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        body()
    return graph


def replay(holder, body: Callable[[], None], pool, device: torch.device) -> None:
    """Replay ``holder.graph``, ``body`` captured into it (in ``pool``) on first use, on
    ``device`` (streams, captures and their pools belong to the current CUDA device: one on
    another device would be captured as an empty graph); ``holder.replays`` counts them."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if holder.graph is None:
            holder.graph = capture_graph(body, pool)
            log.debug("captured %s in a CUDA graph", holder)
        holder.graph.replay()
    holder.replays += 1
