"""Cost-aware trees (``tree_cfg="auto"``): each step verifies the tree that maximises the
expected tokens committed per second, from a measured cost curve and calibrated scores.

The rule. The builder drafts up to the config's maximum (depth D, top-k K, N_max nodes).
Node i has a cumulative draft score s_i; the calibration gives p_i = P(i is accepted).
Order the drafted nodes by (score descending, depth ascending, index ascending): a child
never scores above its parent and is deeper, so every prefix of this order is
ancestor-closed, i.e. a tree. Verifying the first n of them commits in expectation

    E(n) = 1 + p_(1) + ... + p_(n)          (the bonus token, plus the accepted drafts)

tokens and costs t_draft + t_verify(n + 1) seconds (the root is verified too), so the step
verifies the n in 0..N that maximises

    J(n) = E(n) / (t_draft + t_verify(n + 1)),

n = 0 (the root alone: no speculation) included.

Two drafters in one tree (prompt lookup grafted onto a head's tree, ``Tree.source``): each
source's scores go through its own calibration, and each node's p is capped at its
parent's (it is accepted only with its parent); the order is then by p descending, depth
ascending, index ascending, and every prefix is still a tree.

Early stop. After each draft level, with J* the best rate so far, n* its size and p_f the
calibrated probability of the best frontier score (no deeper node can beat it), m more
nodes each worth at most p_f raise the rate only if

    m * p_f > J* * (t_level + t_verify(n* + 1 + m) - t_verify(n* + 1))

for some m >= 1 (t_level: one more level's draft time, measured online as the time between
two consecutive early-stop decisions, so the root's step and the tree's assembly are not
counted as levels). When n* is the
whole budget, deeper nodes can only replace chosen ones, gaining at most p_f - p_min each.
When no request can gain, drafting stops.

Batches: one forward verifies every request's tree (their tokens packed into one row), so
the batch chooses jointly: the best prefix of the merged order of all requests' nodes by p,
with B roots, maximising (B + sum of chosen p) / (t_draft + t_verify(B + chosen nodes)); the
early stop asks the same of the batch (p_f: the best frontier of any request). For B = 1
both are the rule above.

Letters: B requests, N drafted nodes, P pool candidates, k top-k.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence, Union

import numpy as np
import torch

from .calibration import Calibration
from .costs import CostCurve, cached_cost_curve, cost_key, drop_cached_cost_curve
from .tree import Tree
from .warn import warn

__all__ = ["HEAD_PROFILE", "AutoProfile", "AutoController", "choice_order", "node_probs", "best_sizes",
           "keep_drafting", "choose_tree", "choose_trees"]

log = logging.getLogger(__name__)

LEVEL_EMA = 0.2  # weight of the newest measurement of one level's draft time
OVERHEAD_EMA = 0.1  # weight of the newest step's measured overhead
RATE_EMA = 0.05  # least weight of the newest step in the achieved rate ("rate" objective)
# A step that verifies no drafted node keeps this share of every calibration count: idle
# evidence fades (half-life about 35 idle steps), so trees come back after text the draft could
# not predict (from "useless" to trying again in about a hundred idle steps). The learned step
# slope and level time fade likewise on the steps that cannot renew them.
IDLE_KEEP = 0.98
# A step holds its verify forward, so steps that take less than half of what the curve says
# that forward costs (the median of the first JUDGE_STEPS) contradict the curve: it was measured
# while other work slowed the machine (2.28 s a forward that takes 40 ms, issue 31).
JUDGE_STEPS = 5
CONTRADICTED = 0.5
#: A head directory's ``auto`` profile (written by ``treespec tune --out``): its calibrations
#: are where ``auto`` starts for that head when no profile is given; its cost curve, measured
#: on some other machine, is not used.
HEAD_PROFILE = "auto-profile.json"


# ---- the rule, as pure functions ------------------------------------------------------------


def choice_order(tree: Tree, probs: np.ndarray | None = None) -> np.ndarray:
    """Drafted node indices (1..N) by score (or ``probs``, one per node) descending, depth
    ascending, index ascending."""
    idx = np.arange(1, tree.num_nodes)
    key = tree.scores[1:].numpy().astype(np.float64) if probs is None else np.asarray(probs, np.float64)[1:]
    depth = tree.depth[1:].numpy()
    return idx[np.lexsort((idx, depth, -key))]


Calibrations = Union[Calibration, Mapping[int, Calibration]]


def node_probs(tree: Tree, calibration: Calibrations) -> np.ndarray:
    """Every node's acceptance probability (root 1): its score through its source's
    calibration (``calibration[tree.source[i]]``; one Calibration serves a tree without
    sources), capped by its parent's, since a node is accepted only with its parent.

    A single source keeps the cap idle (a child scores at most its parent, the fit is
    monotone); with several (a lookup chain under a head's node) it keeps every prefix of
    the choice order a tree."""
    scores = tree.scores.numpy().astype(np.float64)
    mixed = tree.source is not None and not isinstance(calibration, Calibration)
    if mixed:
        p = np.empty_like(scores)
        src = tree.source.numpy()
        for s in np.unique(src):
            p[src == s] = calibration[int(s)](scores[src == s])
    else:
        if tree.source is not None and bool((tree.source[1:] != 0).any()):
            raise ValueError("this tree's nodes come from several drafters: give one calibration per source")
        p = (calibration if isinstance(calibration, Calibration) else calibration[0])(scores)
    p[0] = 1.0  # the root is committed whatever happens
    if mixed:
        parents = tree.parents.numpy()
        for i in range(1, p.size):  # topological order: a parent's cap is final first
            p[i] = min(p[i], p[parents[i]])
    return p


def best_sizes(probs: np.ndarray, costs: CostCurve, draft_seconds, roots: int = 1,
               rate: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The n maximising ``J(n) = (roots + p_1 + ... + p_n) / (t_draft + t_verify(roots + n))``,
    or, given the generation's achieved ``rate``, ``E(n) - rate * t_verify(roots + n)``.

    Args:
        probs:         float ``[R, N]``: per row, acceptance probabilities in choice order
                       (0-padded); rows are independent problems.
        costs:         the verify cost curve.
        draft_seconds: scalar or ``[R]``: this step's draft time.
        roots:         roots verified with the nodes (1 per request of the forward).
        rate:          tokens per second achieved so far (the ``"rate"`` objective), or None.
    Returns:
        ``(n [R] int, J(n) [R])``; ties go to the smaller tree.
    """
    probs = np.atleast_2d(probs)
    R, N = probs.shape
    E = roots + np.concatenate([np.zeros((R, 1)), np.cumsum(probs, axis=1)], axis=1)  # [R, N+1]
    T = np.asarray(draft_seconds, dtype=np.float64).reshape(-1, 1) + costs(roots + np.arange(N + 1))[None]
    J = E / T
    n = J.argmax(axis=1) if rate is None else (E - rate * T).argmax(axis=1)
    return n, J[np.arange(R), n]


def keep_drafting(probs: np.ndarray, frontier_probs: np.ndarray, costs: CostCurve, draft_seconds: float,
                  level_seconds: float, max_nodes: int, width: int, rate: float | None = None) -> bool:
    """Whether one more draft level could raise the batch's best rate (or, given the
    generation's ``rate``, add more expected tokens than ``rate`` times its cost).

    Args:
        probs:          float ``[B, P]``: each request's pool probabilities, descending.
        frontier_probs: float ``[B]``: each request's best frontier probability; p_f is
                        their maximum.
        draft_seconds:  draft time spent so far this step.
        level_seconds:  estimated time of one more level (t_level).
        max_nodes:      N_max, the most nodes a request's tree may verify.
        width:          top-k: one level adds at most k*k candidates per request.
        rate:           the ``"rate"`` objective's bar, or None (the step's best rate).
    """
    probs = np.atleast_2d(probs)[:, :max_nodes]
    B = probs.shape[0]
    flat = -np.sort(-probs.ravel())  # the batch's candidates, best first
    n, J = (x[0] for x in best_sizes(flat[None], costs, draft_seconds, roots=B, rate=rate))
    J = J if rate is None else rate
    p_f = float(np.max(frontier_probs))
    room = min(B * max_nodes - int(n), B * width * width)
    if room >= 1:
        m = np.arange(1, room + 1)
        extra = (level_seconds + costs(B + n + m) - costs(B + n)) / m
        return bool(p_f > J * extra.min())
    # A full budget: deeper nodes can only replace the weakest chosen ones.
    swaps = B * min(width * width, max_nodes)
    return bool(swaps * (p_f - flat[n - 1]) > J * level_seconds)


def choose_trees(trees: Sequence[Tree], calibration: Calibrations, costs: CostCurve,
                 draft_seconds: float, rate: float | None = None) -> list[Tree]:
    """Each tree cut to a prefix of its choice order, the prefixes chosen jointly: the step's
    forward verifies every request's tokens at once, so the batch maximises
    ``(B + sum of chosen p) / (t_draft + t_verify(B + chosen nodes))``. For one request
    this is the rule above. Trees without scores are verified whole. ``calibration``: one,
    or one per ``Tree.source`` code when trees mix drafters; ``rate``: the ``"rate"``
    objective's bar (see :func:`best_sizes`)."""
    fixed = sum(t.num_drafted for t in trees if t.scores is None)
    orders, probs, owner = [], [], []
    for b, t in enumerate(trees):
        if t.scores is None:
            order, p = np.zeros(0, dtype=np.int64), np.zeros(0)
        else:
            p_all = node_probs(t, calibration)
            order = choice_order(t, p_all)
            p = p_all[order]
        orders.append(order)
        probs.append(p)
        owner.append(np.full(order.size, b))
    p, owner = np.concatenate(probs), np.concatenate(owner)
    # Within a request p never increases along its order, and the sort is stable: every
    # prefix of the merged order is a prefix of each request's order.
    merged = np.argsort(-p, kind="stable")
    n = int(best_sizes(p[merged][None], costs, draft_seconds, roots=len(trees) + fixed, rate=rate)[0][0])
    counts = np.bincount(owner[merged[:n]], minlength=len(trees))
    out = []
    for t, order, k in zip(trees, orders, counts.tolist()):
        keep = t.scores is None or k == t.num_drafted
        out.append(t if keep else t.subtree(np.sort(order[:k]).tolist()))
    return out


def choose_tree(tree: Tree, calibration: Calibrations, costs: CostCurve, draft_seconds: float,
                rate: float | None = None) -> Tree:
    """One request's tree: the best prefix of its choice order."""
    return choose_trees([tree], calibration, costs, draft_seconds, rate)[0]


# ---- the profile: what is measured and learned ----------------------------------------------


@dataclass
class AutoProfile:
    """The cost curve and calibrations an ``auto`` tree decides from; JSON-serialisable.

    One profile can serve many ``generate`` calls: it keeps learning (calibration counts,
    the draft's time per level) from every call it is given to.

    Attributes:
        costs:         verify seconds by tree size; None: taken from the disk cache (or
                       measured) on first use.
        greedy:        calibration under greedy decoding.
        sampling:      calibration under sampling (its own: acceptance differs).
        sources:       the calibrations of the other sources of a tree that mixes drafters
                       (``Tree.source`` code -> {"greedy": ..., "sampling": ...}; e.g. prompt
                       lookup grafted onto a head's tree); ``greedy``/``sampling`` are source 0.
        level_seconds: draft time of one tree level (EMA), None until measured.
        step_overhead: what a step costs beyond its draft and the curve's forward (EMA of the
                       measured remainder: verification, cache compaction, the draft's commit,
                       a context longer than the curve's), None until measured; with
                       ``step_slope``, the remainder's intercept at one verified token.
        step_slope:    seconds each verified token costs beyond the curve's (the remainder's
                       slope over the tokens verified, >= 0: attention over a context longer
                       than the curve's 128-token prefix grows with the tree).
        step_moments:  the EMAs behind both (tokens - 1, its square, the remainder, their
                       product), None until measured.
        keys:          what the profile was measured on (model, machine, draft, ...).
    """

    costs: CostCurve | None = None
    greedy: Calibration = field(default_factory=Calibration)
    sampling: Calibration = field(default_factory=Calibration)
    level_seconds: float | None = None
    step_overhead: float | None = None
    keys: dict = field(default_factory=dict)
    sources: dict[int, dict[str, Calibration]] = field(default_factory=dict)
    step_slope: float = 0.0
    step_moments: list[float] | None = None

    def calibration(self, greedy: bool, source: int = 0) -> Calibration:
        """The calibration of ``source``'s scores (0: the draft's own; others start from
        the prior on first use)."""
        if source == 0:
            return self.greedy if greedy else self.sampling
        pair = self.sources.setdefault(int(source), {"greedy": Calibration(), "sampling": Calibration()})
        return pair["greedy" if greedy else "sampling"]

    def relax(self, greedy: bool, keep: float) -> None:
        """:meth:`Calibration.relax` on every source's calibration of one mode."""
        for source in self.calibrations(greedy):
            self.calibration(greedy, source).relax(keep)

    def calibrations(self, greedy: bool) -> "_BySource":
        """Every source's calibration for one mode, indexed by ``Tree.source`` code."""
        return _BySource(self, greedy)

    @classmethod
    def starting(cls, drafter=None) -> "AutoProfile":
        """A fresh profile for ``drafter``: copies of the calibrations it carries
        (``Drafter.auto_calibration``, e.g. its head directory's ``auto-profile.json``), else
        the prior; no cost curve yet."""
        carried = getattr(drafter, "auto_calibration", None)
        if carried is None:
            return cls()
        profile = carried.calibrations_only()
        profile.keys = {"calibration": "the draft's own"}
        return profile

    def calibrations_only(self) -> "AutoProfile":
        """A copy with what describes the pair (every calibration) and nothing that describes
        a machine (cost curve, draft and step timings)."""
        return AutoProfile(greedy=self.greedy.copy(), sampling=self.sampling.copy(),
                           sources={k: {m: c.copy() for m, c in v.items()} for k, v in self.sources.items()},
                           keys={k: v for k, v in self.keys.items() if k != "costs"})

    @classmethod
    def head_calibration(cls, directory) -> "AutoProfile | None":
        """The calibrations of ``directory/auto-profile.json`` (``calibrations_only``), or
        None without one."""
        path = Path(directory) / HEAD_PROFILE
        if not path.exists():
            return None
        try:
            profile = cls.load(path)
        except (ValueError, KeyError) as e:
            raise ValueError(f"bad auto profile {path}: {e}; rewrite it with treespec tune --out, "
                             "or delete it") from None
        return profile.calibrations_only()

    def prepare(self, runner, max_tokens: int, refresh: bool = False, fixed=None) -> None:
        """Make sure the cost curve covers ``max_tokens`` (from the disk cache, else
        measured); the model must be attached to ``runner``. ``fixed``: the loop's compiled
        fixed-shape verify, whose buckets' times make the curve."""
        key = cost_key(runner, fixed)
        other = self.keys.get("costs") not in (None, key)
        if other:
            # A curve from another dtype, thread count or machine would mislead every choice;
            # the calibration describes the pair and still applies.
            warn(f"this auto profile's cost curve was measured for another setting ({_diff(self.keys['costs'], key)}): "
                 "using this setting's curve instead (disk cache, else measured)")
        # An earlier generation's steps contradicted the curve (AutoController): measure again.
        refresh = self.keys.pop("costs_contradicted", False) or refresh
        if fixed is not None:  # its curve stops at the largest bucket (larger trees run today's forward)
            max_tokens = min(max_tokens, fixed.buckets[-1])
        if self.costs is None or refresh or other or self.costs.max_tokens < max_tokens:
            self.costs = cached_cost_curve(runner, max_tokens, refresh=refresh, fixed=fixed)
            self.keys["costs"] = key

    # ---- JSON ---------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": "treespec-auto-profile/1",
            "keys": self.keys,
            "costs": None if self.costs is None else self.costs.to_json(),
            "level_seconds": self.level_seconds,
            "step_overhead": self.step_overhead,
            "step_slope": self.step_slope,
            "step_moments": self.step_moments,
            "greedy": self.greedy.to_json(),
            "sampling": self.sampling.to_json(),
            "sources": {str(k): {m: c.to_json() for m, c in v.items()} for k, v in sorted(self.sources.items())},
        }

    @classmethod
    def from_json(cls, data: dict) -> "AutoProfile":
        if data.get("format") != "treespec-auto-profile/1":
            raise ValueError("not a treespec auto profile (its 'format' is not treespec-auto-profile/1)")
        return cls(
            costs=None if data.get("costs") is None else CostCurve.from_json(data["costs"]),
            greedy=Calibration.from_json(data["greedy"]),
            sampling=Calibration.from_json(data["sampling"]),
            level_seconds=data.get("level_seconds"),
            step_overhead=data.get("step_overhead"),
            step_slope=float(data.get("step_slope") or 0.0),
            step_moments=data.get("step_moments"),
            keys=dict(data.get("keys") or {}),
            sources={int(k): {m: Calibration.from_json(c) for m, c in v.items()}
                     for k, v in (data.get("sources") or {}).items()},
        )

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> "AutoProfile":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_json(data)

    def copy(self) -> "AutoProfile":
        return AutoProfile.from_json(json.loads(json.dumps(self.to_json())))


class _BySource(Mapping):
    """One mode's calibrations of a profile by source code (created on first use)."""

    def __init__(self, profile: AutoProfile, greedy: bool):
        self.profile, self.greedy = profile, greedy

    def __getitem__(self, source: int) -> Calibration:
        return self.profile.calibration(self.greedy, source)

    def __iter__(self):
        return iter([0, *sorted(self.profile.sources)])

    def __len__(self) -> int:
        return 1 + len(self.profile.sources)


def _diff(a: dict, b: dict) -> str:
    return ", ".join(f"{k} {a.get(k)!r} here {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


# ---- per-generation controller --------------------------------------------------------------


class AutoController:
    """Applies the rule inside one generation: the builder's ``stop`` callback, the choice
    of each request's tree after drafting, and learning from each verification.

    Per step: ``begin_step()`` before ``propose``; ``choose(trees, propose_seconds)``
    after it; ``learn(trees, verdicts)`` after verification; ``end_step(tokens, seconds)``
    with the time from the verify forward's start to the step's end.

    Every step also pays what the cost curve does not hold (verification, cache compaction,
    the draft's commit, attention over a context longer than the curve's): the profile's
    ``step_overhead``, learned here, joins each step's draft time in the rule's denominator.
    Leaving it out would price every token as if a step had no fixed cost, and so choose
    trees smaller than pay.

    ``objective="rate"``: the bar a node must clear is the generation's achieved rate R (the
    tokens committed per modelled step second, t_draft + t_step + t_verify, averaged with
    weight ``max(1/steps, RATE_EMA)``; the step's own best rate until a step has ended).
    By the renewal-reward argument a generation's rate is highest when every step maximises
    E(n) - R * T(n): the step's own ratio asks too much of nodes on confident steps and too
    little on doubtful ones, which matters where steps differ a lot.

    A drafter that adds nodes beside the builder's (prompt lookup in a
    :class:`~treespec.drafters.hybrid.HybridDrafter`) hands them to :meth:`candidates`
    before drafting, so the early stop weighs them too.
    """

    def __init__(self, profile: AutoProfile, max_nodes: int, top_k: int, greedy: bool, objective: str = "step"):
        if profile.costs is None:
            raise ValueError("the auto profile has no cost curve yet: call profile.prepare(runner, ...)")
        if objective not in ("step", "rate"):
            raise ValueError(f"objective must be 'step' or 'rate', got {objective!r}")
        self.profile, self.max_nodes, self.top_k, self.objective = profile, max_nodes, top_k, objective
        self.greedy = greedy
        self.calibration = profile.calibration(greedy)  # the draft's own: the builder's early stop
        self.by_source = profile.calibrations(greedy)
        self._t0 = time.perf_counter()
        self._last_stop: float | None = None  # when this step's last "keep drafting" was said
        self._level_measured = False  # whether this step measured a level's time
        self._extra: np.ndarray | None = None  # [B, E] probabilities of this step's other nodes
        self._modelled: float | None = None  # this step's t_draft + t_step, once chosen
        self._steps, self._tokens, self._seconds = 0, 0.0, 0.0
        self._committed = 0  # tokens this step committed, once learned
        self._costs: tuple[float, CostCurve] | None = None  # (slope, curve with it)
        # A measured curve (keyed by prepare) is judged against the first steps' times.
        self._judged: list[float] | None = [] if profile.keys.get("costs") is not None else None

    @property
    def rate(self) -> float | None:
        """The ``"rate"`` objective's bar (tokens per modelled second), None for ``"step"``
        or before the first step has ended."""
        if self.objective != "rate" or self._steps == 0:
            return None
        return self._tokens / self._seconds

    def begin_step(self) -> None:
        self._t0 = time.perf_counter()
        self._last_stop = None
        self._level_measured = False
        self._extra = None
        self._modelled = None
        self._committed = 0

    def candidates(self, trees: Sequence[Tree]) -> None:
        """This step's nodes from another drafter (one tree per request, in the order the
        builder drafts them, ``Tree.source`` set): the early stop counts them as drafted."""
        rows = [node_probs(t, self.by_source)[1:] for t in trees]
        width = max((r.size for r in rows), default=0)
        self._extra = np.stack([np.pad(r, (0, width - r.size)) for r in rows]) if width else None

    def stop(self, depth: int, frontier_scores: torch.Tensor, pool_scores: torch.Tensor) -> bool:
        """Builder callback after level ``depth``: True ends drafting for the whole batch.

        frontier_scores: float ``[B, k]``; pool_scores: float ``[B, P]`` (every candidate so far).

        The time between two consecutive calls is one level's draft time (the head's step over
        the frontier, its expansion, and this decision): t_level is learned from those gaps
        only, never from the root's step or the tree's assembly after the last level.
        """
        now = time.perf_counter()
        if self._last_stop is not None:
            self._level_measured = True
            gap, old = now - self._last_stop, self.profile.level_seconds
            self.profile.level_seconds = gap if old is None else (1 - LEVEL_EMA) * old + LEVEL_EMA * gap
        pool = pool_scores.detach().float().cpu().numpy().astype(np.float64)
        probs = self.calibration(-np.sort(-pool, axis=1))
        max_nodes = self.max_nodes
        if self._extra is not None:  # one row per request, as the builder's pool
            probs = -np.sort(-np.concatenate([probs, self._extra], axis=1), axis=1)
            max_nodes += self._extra.shape[1]
        p_f = self.calibration(frontier_scores.detach().float().cpu().numpy().max(axis=1))
        # Unmeasured yet: assume a level is free, so the next step drafts one and measures it.
        go = keep_drafting(probs, p_f, self.costs, now - self._t0 + self.overhead,
                           self.profile.level_seconds or 0.0, max_nodes, self.top_k, self.rate)
        self._last_stop = now if go else None
        return not go

    @property
    def overhead(self) -> float:
        """The step's fixed cost beyond draft and curve (0 until measured); never below
        minus half a one-token forward, so that no denominator can reach zero."""
        return max(self.profile.step_overhead or 0.0, -0.5 * float(self.profile.costs(1)))

    def choose(self, trees: Sequence[Tree], propose_seconds: float) -> list[Tree]:
        self._modelled = propose_seconds + self.overhead
        return choose_trees(trees, self.by_source, self.costs, self._modelled, self.rate)

    @property
    def costs(self) -> CostCurve:
        """The verify curve the rule prices trees with: the measured one plus the learned
        ``step_slope`` per token beyond the first."""
        c, b = self.profile.costs, self.profile.step_slope
        if b <= 0:
            return c
        if self._costs is None or self._costs[0] != b:
            shifted = CostCurve(c.tokens, tuple(sec + b * (q - 1) for q, sec in zip(c.tokens, c.seconds)))
            self._costs = (b, shifted)
        return self._costs[1]

    def end_step(self, tokens: int, seconds: float) -> None:
        """A step verified ``tokens`` tokens (roots included) in one forward and spent
        ``seconds`` from that forward's start to the step's end: learn the remainder, as a
        line over the tokens verified (EMAs of its moments; the slope once sizes vary)."""
        p = self.profile
        x, r = float(tokens - 1), seconds - float(p.costs(tokens))
        new = [x, x * x, r, x * r]
        if p.step_moments is None:  # start from what the profile knew, at this size
            old = r if p.step_overhead is None else p.step_overhead
            p.step_moments = [x, x * x, old, x * old]
        m = [(1 - OVERHEAD_EMA) * a + OVERHEAD_EMA * b for a, b in zip(p.step_moments, new)]
        p.step_moments = m
        var = m[1] - m[0] ** 2
        if var > 1.0:  # tree sizes varied by more than a token: the slope is identified
            p.step_slope = max((m[3] - m[0] * m[2]) / var, 0.0)
        else:  # unrenewed, it fades (IDLE_KEEP): a slope learned while the machine was slowed
            p.step_slope *= IDLE_KEEP  # must not keep every tree at the root alone for good
        if not self._level_measured and p.level_seconds is not None:
            p.level_seconds *= IDLE_KEEP  # likewise a level's time, measured only between two levels
        p.step_overhead = m[2] - p.step_slope * m[0]
        self._judge(seconds / float(p.costs(tokens)))
        if self._modelled is not None and self._committed:
            self._steps += 1
            w = max(1.0 / self._steps, RATE_EMA)
            self._tokens = (1 - w) * self._tokens + w * self._committed
            self._seconds = (1 - w) * self._seconds + w * (self._modelled + float(self.costs(tokens)))

    def _judge(self, ratio: float) -> None:
        """Once JUDGE_STEPS steps have taken, as a median, less than CONTRADICTED of their
        forward's cost by the curve, the curve is wrong for this machine: it leaves the disk
        cache, and the profile measures again when next prepared."""
        if self._judged is None:
            return
        self._judged.append(ratio)
        if len(self._judged) < JUDGE_STEPS:
            return
        median, self._judged = float(np.median(self._judged)), None
        if median >= CONTRADICTED:
            return
        p = self.profile
        dropped = drop_cached_cost_curve(p.keys["costs"], p.costs)
        p.keys["costs_contradicted"] = True
        log.warning("the verify cost curve (%.0f ms a one-token forward) is %.1fx what whole steps take here, their "
                    "forward included: it was measured while other work slowed the machine; %s, and it is measured "
                    "again on the next run", float(p.costs(1)) * 1e3, 1 / median,
                    "dropped from the disk cache" if dropped else "not used again")

    def learn(self, trees: Sequence[Tree], paths: Sequence[Sequence[int]]) -> None:
        """Each verified drafted node is accepted iff it lies on its request's committed
        path; each source's nodes teach that source's calibration."""
        scores, accepted, sources = [], [], []
        self._committed = sum(len(path) for path in paths)  # roots and accepted nodes: tokens committed
        for t, path in zip(trees, paths):
            if t.num_drafted == 0 or t.scores is None:
                continue
            hit = np.zeros(t.num_nodes, dtype=bool)
            hit[list(path)] = True
            scores.append(t.scores[1:].numpy())
            accepted.append(hit[1:])
            sources.append(np.zeros(t.num_drafted, dtype=np.int8) if t.source is None else t.source[1:].numpy())
        if not scores:  # an idle step: nothing learned, so old evidence fades (IDLE_KEEP)
            self.profile.relax(self.greedy, IDLE_KEEP)
            return
        scores, accepted, sources = np.concatenate(scores), np.concatenate(accepted), np.concatenate(sources)
        for s in np.unique(sources):
            self.by_source[int(s)].observe(scores[sources == s], accepted[sources == s])
