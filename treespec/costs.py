"""What a verify forward of q tokens costs here: measured once, cached on disk.

The cost of a target forward grows with the tokens it runs in a way no formula predicts: on
one 2-core CPU 4 tokens cost 1.4x one token and 32 tokens 2.4x (fp32), on another bf16 CPU
32 tokens cost 1.6x, on a GPU 60 tokens cost about one. So the curve is measured on the
model, dtype, attention backend, thread count and machine it will run on: a handful of
timed forwards through :class:`~treespec.runner.ModelRunner` on a scratch cache (one
request, a 128-token prefix, q tree tokens under a causal mask), the sizes timed in turn up
to 5 times within a budget of seconds (``BUDGET_SECONDS``), the median per q made
non-decreasing by isotonic regression, linear interpolation between the measured q.

The curve is cached as JSON in ``treespec.models.cache_dir() / "costs"``, one file per key
(model identity, dtype, backend, threads, device name, packed weights); ``refresh=True``
measures again. (The plain-against-packed timings of :mod:`treespec.pack_choice` live there
too, as ``packing-*.json``, timed with :func:`prefixed_forward` and kept by the same rule.)
Another process on the cores distorts the measurement, so a curve is written to the disk only
when its samples agree: one whose samples of a size spread by more than ``MAX_SPREAD`` of
their median (or that had time for one round only) serves the process that measured it and
is measured again by the next process. Either way a curve is measured at most once per
process: every generation of a chat, a bench or a Python session reads this process's copy.
``auto`` drops a cached curve that its live steps contradict (:func:`drop_cached_cost_curve`).
What is measured is logged at INFO (the command line shows it), since a first run pays for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch

__all__ = ["CostCurve", "GRID", "cost_key", "measure_cost_curve", "measure_fixed_cost_curve", "cached_cost_curve", "drop_cached_cost_curve",
           "device_name", "model_identity", "prefixed_forward", "time_alternating", "sample_spread", "cache_file"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: tree sizes (root included) timed at start-up; the grid stops at the largest tree needed.
GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PREFIX = 128  # cached tokens behind the timed forwards: a typical prompt's length
REPEATS = 5
# Seconds of timed rounds before the measurement stops (after its first round): an idle 2-core
# CPU does five rounds of SmolLM2's sizes in about 3 s; a busy one would take minutes (148 s,
# issue 31) for a curve that is noise anyway.
BUDGET_SECONDS = 8.0
# The largest spread of one size's samples, (p75 - p25) / median, typical over the sizes, that a
# curve may have and still be cached: an idle machine's is a few percent; cores that other
# processes keep busy give tens of percent (a forward waits whole time slices).
MAX_SPREAD = 0.25
# This process's curves, by their disk cache file (so a process that changes TREESPEC_CACHE
# reads another set): the noisy ones the disk does not keep included. A chat measured its
# noisy curve again on every turn, 17-23 s each (issue 50).
_MEASURED: dict[Path, CostCurve] = {}


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one verify forward of ``q`` tokens, measured at ``tokens`` (ascending).

    ``curve(q)`` interpolates linearly; past the last point it extends the last segment's
    slope (never below the last value).
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    # How much the samples behind a curve measured in this process disagree (typical relative
    # spread of one size's samples; inf: one round, nothing to compare); None: read or given.
    spread: float | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        t, s = tuple(int(x) for x in self.tokens), tuple(float(x) for x in self.seconds)
        if not t or len(t) != len(s):
            raise ValueError("a cost curve needs as many times as token counts, at least one")
        if any(b <= a for a, b in zip(t, t[1:])) or t[0] < 1:
            raise ValueError("cost curve token counts must be ascending and >= 1")
        if any(not np.isfinite(x) or x <= 0 for x in s):
            raise ValueError("cost curve times must be positive")
        object.__setattr__(self, "tokens", t)
        object.__setattr__(self, "seconds", s)
        # As arrays once, with the slope past the last point: ``auto`` asks several times a level.
        slope = max((s[-1] - s[-2]) / (t[-1] - t[-2]), 0.0) if len(t) > 1 else None
        object.__setattr__(self, "_arrays", (np.array(t, dtype=np.float64), np.array(s), slope))

    def __call__(self, q) -> np.ndarray:
        q = np.asarray(q, dtype=np.float64)
        t, s, slope = self._arrays
        out = np.interp(q, t, s)
        if slope is not None:
            out = np.where(q > t[-1], s[-1] + slope * (q - t[-1]), out)
        return out

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    def to_json(self) -> dict:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds)}

    @classmethod
    def from_json(cls, data: dict) -> "CostCurve":
        return cls(tuple(data["tokens"]), tuple(data["seconds"]))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def model_identity(model) -> dict:
    """Which model this is, wherever it was loaded from: its name, a hash of its config and its
    parameter count (a config alone does not tell a truncated copy from its source)."""
    cfg = model.config.to_dict()
    cfg.pop("_name_or_path", None)
    cfg.pop("_attn_implementation_autoset", None)
    cfg.pop("_attn_implementation", None)
    cfg_hash = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "model_config": cfg_hash,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def cost_key(runner, fixed=None) -> dict:
    """What the cost of a forward depends on: the model, how it runs, and where; ``fixed``: the
    loop's compiled :class:`~treespec.fixed_shape.FixedShapeVerify`, whose forwards cost what their
    bucket costs."""
    from .models.quant import weights_format
    from .packing import PackedLinear

    model = runner.model
    compiled = {} if fixed is None else {"verify": "captured" if fixed.graphs else "compiled",
                                         "rows": fixed.attention.rows, "kernels": fixed.kernels,
                                         "accept": fixed.accepts}  # with acceptance inside, or not
    if fixed is not None and not fixed.narrow:  # every forward attends over the whole row
        compiled["row"] = fixed.capacity
    return {
        **compiled,
        **model_identity(model),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "backend": runner.backend.name,
        "threads": torch.get_num_threads(),
        "device": device_name(runner.device),
        "packed": any(isinstance(m, PackedLinear) for m in model.modules()),
        "weights": weights_format(model),  # int4 and Q4_1 blocks share shapes, not costs, with dense weights
    }


def cache_file(key: dict, prefix: str = "") -> Path:
    """The cache file of ``key``'s measurement; ``prefix`` names another kind than a cost curve
    (``packing-``: :mod:`treespec.pack_choice`)."""
    from .models import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "costs" / f"{prefix}{digest}.json"


def measure_cost_curve(runner, max_tokens: int, repeats: int = REPEATS, budget: float = BUDGET_SECONDS,
                       clock: Callable[[], float] = time.perf_counter) -> CostCurve:
    """Time forwards of q = 1 .. ``max_tokens`` tokens (the grid up to it, and it) through
    ``runner``; the model must be attached (``with runner.attached():``). Rounds over every
    size, up to ``repeats``, stop once ``budget`` seconds have gone (the first round always
    completes); the curve's ``spread`` says how far each size's samples disagree. ``clock``:
    the timer (tests pass a fake one)."""
    qs = sorted({q for q in GRID if q < max_tokens} | {max(int(max_tokens), 1)})
    once = prefixed_forward(runner, qs[-1], clock)
    once(qs[-1])  # warm-up: first calls allocate and pick kernels
    samples = _rounds(once, qs, repeats, budget, clock)
    seconds = monotone_fit([statistics.median(samples[q]) for q in qs]).tolist()
    return CostCurve(tuple(qs), tuple(seconds), spread=sample_spread(samples.values()))


def _rounds(once: Callable[[int], float], sizes, repeats: int, budget: float,
            clock: Callable[[], float]) -> dict[int, list[float]]:
    """Samples of ``once(q)`` for each of ``sizes``: rounds over every size, up to ``repeats``,
    stopping once ``budget`` seconds have gone (the first round always completes). Round-robin,
    so that a burst of noise (another process, a frequency change) spreads over several sizes'
    samples rather than owning all of one size's."""
    samples = {q: [] for q in sizes}
    start = clock()
    for _ in range(repeats):
        for q in sizes:
            samples[q].append(once(q))
        if clock() - start > budget:
            break
    return samples


def measure_fixed_cost_curve(fixed, max_tokens: int, repeats: int = REPEATS, budget: float = BUDGET_SECONDS,
                             clock: Callable[[], float] = time.perf_counter) -> CostCurve:
    """The curve of a compiled or captured fixed-shape verify (``fixed``, the loop's, not yet
    prefilled): each bucket up to the one of ``max_tokens`` timed as :func:`measure_cost_curve`
    times sizes, a chain in row 0 behind a ``PREFIX``-token committed prefix, and every tree size
    priced at its bucket's time (a step curve: the nodes that fill a bucket cost nothing more).
    The keys it attends over hold whatever the row holds (zeros, or a precompile's padding):
    their values do not change the time, and prefill and the trees write them again before
    anything reads them."""
    from .fixed_shape import bucket_for
    from .tree import Tree

    top = bucket_for(max_tokens, fixed.buckets) or fixed.buckets[-1]
    sizes = [b for b in fixed.buckets if b <= top]
    seq = next(iter(fixed.row_of))
    vocab = fixed.runner.vocab_size
    capture = bool(fixed.runner.feature_layers)  # the loop's forwards, as precompiled

    def once(q: int) -> float:
        tree = Tree.chain(q - 1, torch.arange(q) * 13 % vocab)
        t0 = clock()
        fixed.forward([seq], [tree], [PREFIX], capture=capture)
        if fixed.cache.device.type == "cuda":  # a forward that did not accept read nothing back
            torch.cuda.synchronize(fixed.cache.device)
        return clock() - t0

    for q in sizes:  # warm-up: a bucket the precompile did not reach compiles here, untimed
        once(q)
    samples = _rounds(once, sizes, repeats, budget, clock)
    fixed.cache.truncate(seq, 0)
    fixed.committed[fixed.row_of[seq]] = 0  # no narrowed forward of this call attends over the measurement's prefix
    seconds = monotone_fit([statistics.median(samples[q]) for q in sizes]).tolist()
    tokens, steps = [], []
    for i, (b, s) in enumerate(zip(sizes, seconds)):  # (previous bucket + 1, s) and (b, s): flat across the bucket
        low = sizes[i - 1] + 1 if i else 1
        tokens += [low] if low == b else [low, b]
        steps += [s] * (1 if low == b else 2)
    return CostCurve(tuple(tokens), tuple(steps), spread=sample_spread(samples.values()))


def prefixed_forward(runner, max_tokens: int, clock: Callable[[], float] = time.perf_counter) -> Callable[[int], float]:
    """``once(q)``: the seconds of one forward of q <= ``max_tokens`` tokens under a causal mask
    behind a ``PREFIX``-token prompt, in a scratch cache of one request (prefilled here, before
    it returns); the q tokens' K/V are dropped after each call. The model must be attached."""
    from .mask import causal_mask

    cache = runner.new_cache([PREFIX + max_tokens])
    seq = cache.add_sequence()
    vocab = runner.vocab_size
    prefix = torch.arange(PREFIX) * 7 % vocab
    runner.forward(cache, [seq], [prefix], [torch.arange(PREFIX)], [causal_mask(PREFIX)], logits_rows=[[PREFIX - 1]])
    cache.commit(seq, torch.arange(PREFIX))

    def once(q: int) -> float:
        toks = torch.arange(q) * 13 % vocab
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        t0 = clock()
        runner.forward(cache, [seq], [toks], [PREFIX + torch.arange(q)], [causal_mask(q)])
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        dt = clock() - t0
        cache.truncate(seq, PREFIX)
        return dt

    return once


def time_alternating(once: Callable[[int], float], ways: dict, sizes, repeats: int, budget: float,
                     clock: Callable[[], float]) -> dict[tuple, list[float]]:
    """Seconds of ``once(q)`` (:func:`prefixed_forward`'s) for each of ``sizes`` (ascending)
    inside each of ``ways`` (a name -> a context manager that can be entered again and again),
    keyed ``(name, q)``: after one untimed warm-up of each way on the largest size (first calls
    allocate and pick kernels), rounds of every size and way, the ways' order reversed every other
    round (a slow start favours none), until ``repeats`` rounds or, after a round, ``budget``
    seconds have gone (the first round always completes). Entering a way happens outside the
    timed forward."""
    def timed(way, q: int) -> float:
        with ways[way]:
            return once(q)

    order = list(ways)
    for way in order:
        timed(way, sizes[-1])
    samples: dict[tuple, list[float]] = {(way, q): [] for way in order for q in sizes}
    start = clock()
    for r in range(repeats):
        for q in sizes:
            for way in order if r % 2 == 0 else order[::-1]:
                samples[(way, q)].append(timed(way, q))
        if clock() - start > budget:
            break
    return samples


def sample_spread(samples) -> float:
    """The typical (median over sizes) relative spread of each size's timings: the
    interquartile range over the median; inf with fewer than two samples a size."""
    spreads = []
    for xs in samples:
        if len(xs) < 2:
            return float("inf")
        lo, mid, hi = np.percentile(xs, [25, 50, 75])
        spreads.append((hi - lo) / mid)
    return float(statistics.median(spreads))


def monotone_fit(seconds) -> np.ndarray:
    """The non-decreasing curve closest to ``seconds`` (isotonic regression): noise can make a
    larger forward look cheaper, and a running maximum would let one slow sample raise every
    larger size to its level; pooling averages the violators instead."""
    from .calibration import pav

    seconds = np.asarray(seconds, dtype=np.float64)
    return pav(seconds, np.ones_like(seconds))


def read_cached(path: Path, key: dict, field: str, parse: Callable[[dict], T], what: str) -> T | None:
    """``parse(data[field])`` of the JSON file ``path`` written by :func:`write_cached` for
    ``key``; None when it is missing, written for another key, or unreadable (warned)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        value = parse(data[field])
    except (ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable %s %s: %s", what, path, e)
        return None
    return value if data.get("key") == key else None


def write_cached(path: Path, key: dict, field: str, value: dict) -> None:
    """Save ``{"key": key, field: value}`` at ``path`` atomically (readers never see half a
    file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, field: value}, indent=1) + "\n")
    tmp.replace(path)


def cached_cost_curve(runner, max_tokens: int, refresh: bool = False, fixed=None) -> CostCurve:
    """The curve for ``runner``'s key: this process's (:data:`_MEASURED`), else the disk
    cache's, measured when missing, too short for ``max_tokens`` or ``refresh``; saved to disk
    only if its samples agree (``MAX_SPREAD``), kept for the process in any case, so that every
    generation of a chat, a bench or a Python session reuses one measurement. The model must be
    attached. ``fixed``: the loop's compiled fixed-shape verify, timed instead of today's forward
    (:func:`measure_fixed_cost_curve`)."""
    key = cost_key(runner, fixed)
    if fixed is not None:  # trees past the largest bucket run today's forward: the curve stops there
        max_tokens = min(max_tokens, fixed.buckets[-1])
    path = cache_file(key)
    cached = None
    if not refresh:
        cached = _MEASURED.get(path) or read_cached(path, key, "curve", CostCurve.from_json, "cost curve")
    if cached is not None and cached.max_tokens >= max_tokens:
        _MEASURED[path] = cached
        return cached
    log.info("measuring what a verify forward of 1 to %d tokens costs here (%s, %s, %d thread(s)), for the auto "
             "tree: at most %.0f s, once per model, dtype and thread count", max_tokens, key["device"], key["dtype"],
             key["threads"], BUDGET_SECONDS)
    t0 = time.perf_counter()
    curve = measure_cost_curve(runner, max_tokens) if fixed is None else measure_fixed_cost_curve(fixed, max_tokens)
    took = time.perf_counter() - t0
    points = ", ".join(f"{q}: {s * 1e3:.1f} ms" for q, s in zip(curve.tokens, curve.seconds))
    _MEASURED[path] = curve
    if curve.spread is not None and not curve.spread <= MAX_SPREAD:
        log.warning("the verify cost measurement is mostly noise (%s): other processes on the cores? This process "
                    "keeps it; it is not written to the disk cache, so the next run measures again (%s)",
                    "one round in the time allowed" if curve.spread == float("inf")
                    else f"samples of one size spread by {curve.spread:.0%}", points)
        return curve
    log.info("measured the verify cost in %.1f s (spread %.0f%%): %s", took, 100 * (curve.spread or 0.0), points)
    write_cached(path, key, "curve", curve.to_json())
    return curve


def drop_cached_cost_curve(key: dict, curve: CostCurve) -> bool:
    """Forget ``curve`` for ``key``: this process's copy, and the disk cache's if it is
    ``curve`` (another process may have measured a new one meanwhile); True if removed from
    the disk."""
    path = cache_file(key)
    if _MEASURED.get(path) == curve:
        del _MEASURED[path]
    try:
        data = json.loads(path.read_text())
        if CostCurve.from_json(data["curve"]) != curve:
            return False
        path.unlink()
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True
