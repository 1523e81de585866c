"""Calibrated draft scores: P(a drafted node is accepted) as a function of its score.

A node's *score* is the draft's cumulative log-probability along its path (``Tree.scores``;
prompt lookup: the log of the share of matched continuations through the node). Drafts are
over- or under-confident in ways that depend on the pair, the data and the sampling, so the
map from score to acceptance is learned from what verification actually accepted:

* bins over the score (log-probability edges, finer near 0 where most accepted nodes sit);
* each bin starts from a prior, acceptance = ``exp(score)`` at the bin's centre, worth
  ``prior_weight`` pseudo-observations, so an empty bin says what the draft says;
* every verified node adds one observation to its bin: accepted iff it lies on the
  committed path;
* pool-adjacent-violators over the bins (weights = observations + pseudo-counts) makes the
  fit monotone non-decreasing in the score, which keeps a child's probability at most its
  parent's (its score is at most its parent's) and the chosen node sets ancestor-closed;
* between bin centres the fit is interpolated linearly (still monotone);
* a bin remembers at most ``memory`` observations: past that, its counts are scaled back
  to ``memory`` after each update (older observations fade geometrically), so a
  calibration learned on one kind of text gives way within a few hundred steps to what
  verification says on another (a profile tuned on maths, then code).

Everything is plain floats and lists: ``to_json`` / ``from_json`` round-trip exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Calibration", "DEFAULT_EDGES", "pav"]

# Upper bin edges over the score (log-probability); the last bin ends at 0. Scores below
# the first edge share one bin (nodes that unlikely are rarely verified).
DEFAULT_EDGES = (-12.0, -9.0, -7.0, -5.5, -4.5, -3.75, -3.0, -2.5, -2.0, -1.6, -1.3, -1.0,
                 -0.8, -0.6, -0.45, -0.3, -0.2, -0.1, -0.04, 0.0)


def pav(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) regression by pool-adjacent-violators."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return np.array([b[0] for b in blocks for _ in range(b[2])], dtype=np.float64)


@dataclass
class Calibration:
    """Monotone binned map from draft score to acceptance probability, learned online.

    Attributes:
        edges:        upper score edge of each bin (ascending, last 0.0).
        prior_weight: pseudo-observations of the prior ``exp(centre)`` per bin.
        memory:       most observations a bin keeps (older ones fade); None keeps all.
        seen:         verified nodes per bin.
        accepted:     of those, accepted ones.
    """

    edges: list[float] = field(default_factory=lambda: list(DEFAULT_EDGES))
    prior_weight: float = 4.0
    memory: float | None = 400.0
    seen: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self):
        e = [float(x) for x in self.edges]
        if len(e) < 2 or any(b <= a for a, b in zip(e, e[1:])):
            raise ValueError("calibration edges must be at least two ascending values")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if self.memory is not None and not self.memory >= 1:
            raise ValueError(f"memory must be >= 1 observation (or None: keep all), got {self.memory}")
        self.edges = e
        self.seen = [float(x) for x in self.seen] or [0.0] * len(e)
        self.accepted = [float(x) for x in self.accepted] or [0.0] * len(e)
        if len(self.seen) != len(e) or len(self.accepted) != len(e):
            raise ValueError("calibration counts must have one entry per bin")
        self._fit: np.ndarray | None = None

    # ---- the bins -----------------------------------------------------------------------

    @property
    def centres(self) -> np.ndarray:
        """Score at each bin's centre (the lowest bin: one bin width below its edge)."""
        e = np.array(self.edges)
        lower = np.concatenate([[e[0] - (e[1] - e[0])], e[:-1]])
        return (lower + e) / 2

    @property
    def prior(self) -> np.ndarray:
        return np.exp(self.centres)

    def bin_of(self, scores: np.ndarray) -> np.ndarray:
        """Bin index of each score (above 0 counts as the last bin)."""
        return np.minimum(np.searchsorted(np.array(self.edges), scores, side="left"), len(self.edges) - 1)

    # ---- fitting and prediction ---------------------------------------------------------

    def fitted(self) -> np.ndarray:
        """Per-bin acceptance, monotone non-decreasing in the score."""
        if self._fit is None:
            seen, acc = np.array(self.seen), np.array(self.accepted)
            w = seen + self.prior_weight
            raw = (acc + self.prior_weight * self.prior) / w
            self._fit = np.clip(pav(raw, w), 0.0, 1.0)
        return self._fit

    def __call__(self, scores) -> np.ndarray:
        """P(accepted) for each score (any array shape; ``-inf`` gives 0)."""
        s = np.asarray(scores, dtype=np.float64)
        p = np.interp(s, self.centres, self.fitted())
        return np.where(np.isfinite(s), p, 0.0)

    def observe(self, scores, accepted) -> None:
        """Record verified nodes: ``scores`` and bool ``accepted`` of equal length."""
        s = np.asarray(scores, dtype=np.float64).reshape(-1)
        a = np.asarray(accepted, dtype=np.float64).reshape(-1)
        ok = np.isfinite(s)
        if not ok.any():
            return
        b = self.bin_of(s[ok])
        n = len(self.edges)
        seen = np.array(self.seen) + np.bincount(b, minlength=n)
        acc = np.array(self.accepted) + np.bincount(b, weights=a[ok], minlength=n)
        if self.memory is not None:
            # A bin past its memory is scaled back to ``memory`` observations after each
            # update: the newest keep their full weight, older ones fade geometrically.
            scale = np.minimum(1.0, self.memory / np.maximum(seen, 1e-12))
            seen, acc = seen * scale, acc * scale
        self.seen, self.accepted = seen.tolist(), acc.tolist()
        self._fit = None

    def relax(self, keep: float) -> None:
        """Scale every bin's counts by ``keep`` (0 < keep <= 1): evidence no step renews fades,
        and the fit moves back towards the prior, the draft's own scores. Called for steps that
        verify no drafted node, which teach nothing: a calibration that learned "useless" would
        otherwise keep every later tree empty, and so never see the draft succeed again."""
        if not 0 < keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {keep}")
        self.seen = [x * keep for x in self.seen]
        self.accepted = [x * keep for x in self.accepted]
        self._fit = None

    @property
    def num_observed(self) -> int:
        return int(sum(self.seen))

    # ---- JSON ---------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"edges": list(self.edges), "prior_weight": self.prior_weight, "memory": self.memory,
                "seen": list(self.seen),
                "accepted": list(self.accepted), "fitted": [round(float(x), 6) for x in self.fitted()]}

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        return cls(data["edges"], data.get("prior_weight", 4.0), data.get("memory", 400.0), data.get("seen", []),
                   data.get("accepted", []))

    def copy(self) -> "Calibration":
        return Calibration.from_json(self.to_json())

    def __repr__(self) -> str:
        return f"Calibration({len(self.edges)} bins, {self.num_observed} observations)"

