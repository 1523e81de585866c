"""``torch.compile`` as treespec uses it on fixed shapes: the verify forward
(:mod:`treespec.fixed_shape`) and the draft head's passes (:mod:`treespec.drafters.graphs`).

:func:`frozen_compile` compiles with inductor's ``freezing`` on, which inductor reads when it
compiles: the weights become constants of the graph, so on a CPU inductor packs the dense
linears for oneDNN itself (the layout :mod:`treespec.packing` gives the eager forward, which a
compile cannot take over) and folds what depends on the weights alone. A compiled function so
keeps the weights it was compiled with: they must not change in place afterwards (treespec runs
its forwards under ``inference_mode`` and never does; another model, or other parameters,
compile anew, as dynamo's guards on the modules see).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["frozen_compile", "row_capacity", "RECOMPILE_LIMIT", "COMPILED_MIN_ROW"]

#: compiled versions dynamo keeps of one function: one per bucket and cache shape for the
#: verify forward (its default of 8 would leave later shapes eager)
RECOMPILE_LIMIT = 64


#: the shortest cache row a compiled forward takes: most chats and benchmark prompts with their
#: budget fit, so one compile serves them all (a short warm-up's included)
COMPILED_MIN_ROW = 512


def row_capacity(tokens: int, compile: bool) -> int:
    """The row length a fixed-shape cache asks for to hold ``tokens`` positions: a power of two
    (a row a little longer than the last fits it), of at least :data:`COMPILED_MIN_ROW` when
    compiled, every row length being a new shape to compile."""
    pow2 = 1 << max(tokens - 1, 1).bit_length()
    return max(pow2, COMPILED_MIN_ROW) if compile else pow2


def frozen_compile(fn: Callable, **compile_kwargs) -> Callable:
    """``fn`` through ``torch.compile(**compile_kwargs)``, each call made with inductor's
    ``freezing`` on and dynamo's recompile limit at :data:`RECOMPILE_LIMIT`."""
    import torch._inductor.config as inductor_config

    compiled = torch.compile(fn, **compile_kwargs)

    def run(*args):
        with inductor_config.patch(freezing=True), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args)

    return run
