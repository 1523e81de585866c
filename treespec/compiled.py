"""``torch.compile`` as treespec uses it on fixed shapes: the verify forward
(:mod:`treespec.fixed_shape`) and the draft head's passes (:mod:`treespec.drafters.graphs`).

:func:`compile_fixed` compiles with dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT`
(one compiled version per bucket and row length). The weights stay inputs of the graph, not
constants: oneDNN-packed linears (:class:`~treespec.packing.PackedLinear`) are called through
one opaque operation (``treespec::packed_linear``) on the one packed copy the eager forward uses.
Inductor's ``freezing`` would pack every linear again as a constant of each graph: about 300 MB
more a compiled bucket for SmolLM2-135M in bf16, measured here, and a graph that keeps the
weights it was compiled with.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["compile_fixed", "pow2_row", "RECOMPILE_LIMIT", "COMPILED_MIN_ROW", "COMPILED_VERIFY_ROW"]

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


def compile_fixed(fn: Callable, **compile_kwargs) -> Callable:
    """``fn`` through ``torch.compile(**compile_kwargs)``, each call made with dynamo's recompile
    limit at :data:`RECOMPILE_LIMIT`."""
    compiled = torch.compile(fn, **compile_kwargs)

    def run(*args):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args)

    return run
