"""Up to which width 4-bit (or 8-bit) weights pay, measured once a run: the threshold of the
model's :class:`~treespec.models.quant.WidthSplitLinear` layers (``--weights gguf+dense``).

A forward at a decode step's width reads every weight once, and the quantized kernel reads a
quarter of the bytes; at a verify tree's width torch's 4-bit kernel falls behind the dense
product (issue 48). :func:`choose_split_rows` times the target's forward at widths of 1, 2, 4,
8 and 16 tokens behind a 128-token prompt with every split layer on its quantized copy and on
its dense one, in alternation, for up to ``BUDGET_SECONDS``, and keeps the quantized copy up to
the widest width from 1 at which it was faster at every width so far::

    model, tok = load("smollm2-135m-instruct", dtype=torch.bfloat16, weights="gguf+dense")
    rows, times = choose_split_rows(model)     # e.g. 4: 4-bit up to 4 rows, dense above

Measured under the packed weights where the caller runs on them (the dense copies are then
packed): call it inside their ``with`` block. Not cached: a few seconds a run.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

import torch

from .costs import prefixed_forward, time_alternating
from .models.quant import WidthSplitLinear, set_split_rows

__all__ = ["choose_split_rows", "SIZES", "BUDGET_SECONDS"]

log = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16)
BUDGET_SECONDS = 5.0
REPEATS = 5
_ALL = 1 << 30  # max_rows: every width on the quantized copy


def choose_split_rows(model, sizes=SIZES, repeats: int = REPEATS, budget: float = BUDGET_SECONDS,
                      clock: Callable[[], float] = time.perf_counter) -> tuple[int, dict[int, tuple[float, float]]]:
    """Measure and set the split layers' width (see the module). Returns ``(max_rows, times)``:
    ``times[q]`` the median seconds of a ``q``-token forward ``(quantized, dense)``. A model
    without split layers is left as it is: ``(0, {})``."""
    from .runner import ModelRunner

    if not any(isinstance(m, WidthSplitLinear) for m in model.modules()):
        return 0, {}
    sizes = tuple(sorted(sizes))
    runner = ModelRunner(model, "torch")
    before = next(m.max_rows for m in model.modules() if isinstance(m, WidthSplitLinear))
    try:
        samples = _time_both(model, runner, sizes, repeats, budget, clock)
    except BaseException:
        set_split_rows(model, before)  # as it was: a failed measurement chooses nothing
        raise
    times = {q: (statistics.median(samples[_ALL, q]), statistics.median(samples[0, q])) for q in sizes}
    rows = 0
    for q in sizes:
        if times[q][0] >= times[q][1]:
            break
        rows = q
    set_split_rows(model, rows)
    log.info("quantized weights up to %d row(s), dense above: %s", rows,
             ", ".join(f"{q} token(s) {1e3 * a:.1f} ms quantized, {1e3 * b:.1f} dense" for q, (a, b) in times.items()))
    return rows, times


def _time_both(model, runner, sizes, repeats, budget, clock) -> dict[tuple[int, int], list[float]]:
    """Seconds of each forward, by (max_rows, tokens): every split layer on its quantized copy
    (:data:`_ALL`) or its dense one (0), in alternation (:func:`treespec.costs.time_alternating`)."""
    with runner.attached(), torch.inference_mode():
        once = prefixed_forward(runner, sizes[-1], clock)
        return time_alternating(once, {way: _Rows(model, way) for way in (_ALL, 0)}, sizes, repeats, budget, clock)


class _Rows:
    """A way to time: every split layer at ``max_rows`` (set on entering; the caller sets the
    width chosen at the end)."""

    def __init__(self, model, max_rows: int):
        self.model, self.max_rows = model, max_rows

    def __enter__(self):
        set_split_rows(self.model, self.max_rows)

    def __exit__(self, *exc):
        return False
