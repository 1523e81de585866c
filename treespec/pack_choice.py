"""Packed or plain weights: whichever runs the target's forward faster here, measured once.

oneDNN-packed linear weights (:mod:`treespec.packing`) do not pay on every CPU. On the AMD
EPYC (Zen 4) of docs/benchmarks.md they made a forward of 16 tree tokens cost little more
than one token; on an Intel Xeon (Sapphire Rapids) in fp32 an earlier session measured HF
generate 1.33x slower on packed weights than on plain ones, and treespec on them slower than
not speculating on MT-bench writing. So :func:`choose_packing` times the target both ways, on
the machine, dtype and thread count it will run with::

    choice, packed = choose_packing(model, *draft.modules())   # packed: None where plain is faster
    with packed or contextlib.nullcontext():
        treespec.generate(model, draft, tree, ids)

What is timed (:func:`measure_packing`): forwards of 1 token (a decode step, every forward plain
HF generate runs) and of 16 tokens (a typical verify tree) behind a 128-token prompt, through
treespec's runner (:func:`treespec.costs.prefixed_forward`), plain and packed in alternation
(which goes first swaps each round), up to ``REPEATS`` rounds within ``BUDGET_SECONDS``; the
medians decide. treespec runs packed when its tree forward is faster packed; the choice also
says which weights run a one-token decode faster, for a benchmark's baseline (the faster of
plain and packed HF generate is the one to beat).

The timings are cached beside the cost curves, as ``cache_dir() / "costs" / "packing-*.json"``,
one file per key (:func:`packing_key`: model, dtype, thread count, CPU, torch version), under the
cost curves' rule: timings whose samples spread by more than ``costs.MAX_SPREAD`` of their median
(another process on the cores) decide the run that measured them and are measured again next
time. The choice is logged at INFO with its timings (the command line shows it).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import costs
from .costs import device_name, model_identity, prefixed_forward, sample_spread, time_alternating
from .models.quant import weights_format
from .packing import PackedLinears, packing_supported

__all__ = ["PackingTimes", "PackingChoice", "packing_key", "measure_packing", "choose_packing", "SIZES"]

log = logging.getLogger(__name__)

#: tokens per timed forward: one (a decode step; all plain HF generate runs) and a typical verify tree
SIZES = (1, 16)
REPEATS = 7  # rounds of (plain, packed) per size; medians of these decide
# An idle 2-core CPU runs the rounds of SmolLM2-135M in about a second; a busy one stops here
# with fewer samples, which then spread too far to be cached.
BUDGET_SECONDS = 4.0
SOURCES = ("measured", "cached", "given", "unsupported")


@dataclass(frozen=True)
class PackingTimes:
    """Median seconds of one target forward of ``tokens[i]`` tokens on ``plain`` and on
    ``packed`` weights; ``spread``: how far the samples behind them disagree (as
    :func:`treespec.costs.sample_spread`; None: read from the cache)."""

    tokens: tuple[int, ...]
    plain: tuple[float, ...]
    packed: tuple[float, ...]
    spread: float | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        t = tuple(int(q) for q in self.tokens)
        plain, packed = tuple(float(s) for s in self.plain), tuple(float(s) for s in self.packed)
        if not t or not len(t) == len(plain) == len(packed) or any(b <= a for a, b in zip(t, t[1:])) or t[0] < 1:
            raise ValueError("packing times need ascending token counts >= 1, a plain and a packed time each")
        if any(not s > 0 for s in plain + packed):
            raise ValueError("packing times must be positive")
        object.__setattr__(self, "tokens", t)
        object.__setattr__(self, "plain", plain)
        object.__setattr__(self, "packed", packed)

    def faster_packed(self, q: int) -> bool:
        """Whether a forward of ``q`` tokens (one of ``tokens``) ran faster on packed weights."""
        i = self.tokens.index(q)
        return self.packed[i] < self.plain[i]

    def to_json(self) -> dict:
        return {"tokens": list(self.tokens), "plain": list(self.plain), "packed": list(self.packed)}

    @classmethod
    def from_json(cls, data: dict) -> "PackingTimes":
        return cls(tuple(data["tokens"]), tuple(data["plain"]), tuple(data["packed"]))


@dataclass(frozen=True)
class PackingChoice:
    """Whether treespec runs on packed weights, and why.

    pack:   treespec's forwards (the target's, and the drafters' packed along) run packed.
    source: ``"measured"`` now, ``"cached"`` (measured by an earlier run), ``"given"`` (the
            caller decided: ``--pack`` or ``--no-pack``) or ``"unsupported"`` (oneDNN cannot
            pack this model here).
    times:  what a measured or cached choice rests on.
    """

    pack: bool
    source: str
    times: PackingTimes | None = None

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"unknown packing choice source {self.source!r}: one of {', '.join(SOURCES)}")
        if (self.times is not None) != (self.source in ("measured", "cached")):
            raise ValueError("a measured or cached packing choice has its times, and only it")

    @classmethod
    def from_times(cls, times: PackingTimes, source: str = "measured") -> "PackingChoice":
        """Packed if the largest timed forward (the verify tree's) ran faster packed."""
        return cls(times.faster_packed(times.tokens[-1]), source, times)

    @property
    def decode_packed(self) -> bool | None:
        """Whether a one-token forward (plain HF generate's decode step) ran faster packed;
        None when not measured."""
        return None if self.times is None else self.times.faster_packed(self.times.tokens[0])

    def describe(self) -> str:
        """One line: the choice and the timings behind it."""
        weights = "packed" if self.pack else "plain"
        if self.source == "given":
            return f"treespec on {weights} weights, as asked (not measured)"
        if self.source == "unsupported":
            return "treespec on plain weights: oneDNN cannot pack this model's weights here"
        t = self.times

        def took(i):
            return f"{1e3 * t.packed[i]:.1f} ms packed, {1e3 * t.plain[i]:.1f} ms plain"

        when = "measured now" if self.source == "measured" else "measured by an earlier run, cached"
        return (f"treespec on {weights} weights: a {t.tokens[-1]}-token forward (a verify tree) took {took(-1)}; "
                f"a {t.tokens[0]}-token forward (a decode step, as in HF generate) {took(0)}, faster "
                f"{'packed' if self.decode_packed else 'plain'} ({when})")

    def to_json(self) -> dict:
        d = {"treespec": "packed" if self.pack else "plain", "source": self.source}
        if self.times is not None:
            d.update(one_token="packed" if self.decode_packed else "plain", seconds=self.times.to_json())
            if self.times.spread is not None:
                d["spread"] = self.times.spread
        return d


def packing_key(model) -> dict:
    """What the choice depends on: the model, its dtype, its linears' format (on 4-bit weights only
    the output head is left to pack), the thread count, the CPU and torch (whose oneDNN and MKL
    do the work)."""
    p = next(model.parameters())
    return {**model_identity(model), "dtype": str(p.dtype).removeprefix("torch."), "weights": weights_format(model),
            "threads": torch.get_num_threads(), "device": device_name(p.device), "torch": torch.__version__,
            "sizes": list(SIZES)}


def measure_packing(runner, packed: PackedLinears, sizes=SIZES, repeats: int = REPEATS,
                    budget: float = BUDGET_SECONDS, clock: Callable[[], float] = time.perf_counter) -> PackingTimes:
    """Time forwards of each of ``sizes`` tokens through ``runner`` on plain weights and inside
    ``packed``, alternating; rounds stop once ``budget`` seconds have gone (the first always
    completes). The model must be attached (``with runner.attached():``) and outside ``packed``'s
    ``with`` block. ``clock``: the timer (tests pass a fake one)."""
    sizes = tuple(sorted(sizes))
    once = prefixed_forward(runner, sizes[-1], clock)
    ways = {False: contextlib.nullcontext(), True: packed}  # packed weights or not (a swap of modules)
    samples = time_alternating(once, ways, sizes, repeats, budget, clock)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return PackingTimes(sizes, tuple(med[(False, q)] for q in sizes), tuple(med[(True, q)] for q in sizes),
                        spread=sample_spread(samples.values()))


def choose_packing(model, *more, keep: bool = False,
                   refresh: bool = False) -> tuple[PackingChoice, PackedLinears | None]:
    """Packed or plain weights for ``model`` (with ``more`` modules packed along, e.g. a drafter's
    :meth:`~treespec.drafters.base.Drafter.modules`): the disk-cached timings for this
    :func:`packing_key`, else measured now (and cached when steady). ``refresh``: measure again.

    Returns the choice and the packed copies to enter with ``with``: None where treespec runs
    plain, unless ``keep`` (a benchmark that also runs HF generate on packed weights, whichever
    way treespec runs). Where oneDNN cannot pack the model: ``(PackingChoice(False,
    "unsupported"), None)``. Raises ValueError where one of ``more`` cannot be packed.
    """
    if not packing_supported(model):
        return PackingChoice(False, "unsupported"), None
    key = packing_key(model)
    times = None if refresh else _cached_times(key)
    if times is not None and not keep and not PackingChoice.from_times(times).pack:
        choice = PackingChoice.from_times(times, "cached")  # nothing to pack: the copies are never made
        log.debug("%s", choice.describe())
        return choice, None
    packed = PackedLinears(model, *more)
    choice = PackingChoice.from_times(times, "cached") if times is not None else _measure(model, packed, key)
    (log.info if choice.source == "measured" else log.debug)("%s", choice.describe())  # news only when measured
    return choice, packed if choice.pack or keep else None


def _measure(model, packed: PackedLinears, key: dict) -> PackingChoice:
    """Timings now: saved under ``key`` when they agree (``costs.MAX_SPREAD``), else used once."""
    from .runner import ModelRunner

    log.info("timing the target's forward on plain and on packed weights (%s, %s, %d thread(s)): at most %.0f s, "
             "once per model, dtype and thread count", key["device"], key["dtype"], key["threads"], BUDGET_SECONDS)
    runner = ModelRunner(model)
    with runner.attached():
        times = measure_packing(runner, packed)
    if times.spread is not None and not times.spread <= costs.MAX_SPREAD:
        log.warning("the plain-against-packed timing is mostly noise (%s): other processes on the cores? It decides "
                    "this run and is not cached; it is measured again next run", "one round in the time allowed"
                    if times.spread == float("inf") else f"samples spread by {times.spread:.0%}")
        return PackingChoice.from_times(times, "measured")
    costs.write_cached(costs.cache_file(key, "packing-"), key, "times", times.to_json())
    return PackingChoice.from_times(times, "measured")


def _cached_times(key: dict) -> PackingTimes | None:
    return costs.read_cached(costs.cache_file(key, "packing-"), key, "times", PackingTimes.from_json,
                             "packing timings")
