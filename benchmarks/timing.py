"""Timing shared by the benchmark scripts: the wall time of a block, the median of repeated
calls after a warm-up, the line that says where a figure was measured, and the command
that a result file records.

A script imports it after putting the repository root first on ``sys.path`` (so that
``python benchmarks/micro/forward_cost.py`` runs from a checkout, installed or not, on the
checkout's ``treespec``)::

    ROOT = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

    from benchmarks.timing import Timer, median_ms  # noqa: E402

Medians, not means: one preempted call on a busy core would move a mean and not a median.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]


class Timer:
    """Wall time of a ``with`` block, in ``seconds`` and ``ms`` once the block has run.

    ``sync`` (e.g. ``torch.cuda.synchronize``) is called on entry and on exit, so that GPU
    work queued before the block is not counted in it and the block's own work is.
    """

    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync or (lambda: None)
        self.seconds = 0.0

    def __enter__(self) -> Timer:
        self.sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        self.sync()
        self.seconds = time.perf_counter() - self._start
        return False

    @property
    def ms(self) -> float:
        return 1000 * self.seconds


def call_times(fn: Callable[[], object], repeats: int, warmup: int = 0,
               sync: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after ``warmup`` untimed calls (the
    first calls of a shape pay for allocation, oneDNN primitive creation and the like)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with Timer(sync) as t:
            fn()
        times.append(t.seconds)
    return times


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 0,
              sync: Callable[[], None] | None = None) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    return 1000 * statistics.median(call_times(fn, repeats, warmup, sync))


def round_robin_ms(variants: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median milliseconds a call of each variant, timed in turns: ``rounds`` rounds in which each
    variant runs ``calls`` timed calls, so that a slow minute of the machine falls on all alike."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name] += call_times(fn, calls)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def machine_line(*what: object, threads: bool = True) -> str:
    """``what``, then the torch version, the thread count (unless ``threads`` is False: a
    script that varies it prints it per row) and the CPU: the first line of a printed table."""
    import torch

    from treespec.machine import machine_info

    parts = [*map(str, what), f"torch {torch.__version__}"]
    if threads:
        parts.append(f"{torch.get_num_threads()} threads")
    return ", ".join([*parts, machine_info()["cpu"]])


def command(script: str, argv: Sequence[str] | None) -> str:
    """The command line a result file records: ``python benchmarks/<sub>/<script>.py ARGS``,
    ``argv`` as passed to the script's ``main`` (``None``: ``sys.argv[1:]``)."""
    path = Path(script).resolve()
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    return " ".join(["python", rel, *(sys.argv[1:] if argv is None else argv)])
