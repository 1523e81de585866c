"""Pearson's chi-square test of observed outcomes against exact probabilities, the one test of
a distribution the sampling tests share (the engine's output, the rejection-sampling reference,
Gumbel-max draws).

Outcomes are any hashable values (a token id, a tuple of tokens); ``counts`` maps each observed
outcome to how often it occurred, ``probs`` each possible outcome to its probability.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping

import torch

CHI2_999 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588]  # df = 1..10


def chi2_threshold(df: int) -> float:
    """The chi-square quantile at 1 - 0.001 for ``df`` degrees of freedom (the table, then
    Wilson-Hilferty)."""
    if df <= len(CHI2_999):
        return CHI2_999[df - 1]
    z = 3.0902  # the standard normal's quantile at 1 - 0.001
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: Mapping[Hashable, int], probs: Mapping[Hashable, float]) -> tuple[float, float]:
    """``(statistic, threshold at p = 0.001)`` of ``counts`` against ``probs``. An outcome of
    probability 0 that occurs gives an infinite statistic; outcomes expected fewer than 5 times
    are pooled into one bin."""
    n = sum(counts.values())
    if any(probs.get(k, 0.0) == 0.0 for k in counts):
        return math.inf, 0.0
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for k, p in probs.items():
        if p == 0:
            continue
        if n * p >= 5:
            obs.append(counts.get(k, 0))
            exp.append(n * p)
        else:
            pool_o += counts.get(k, 0)
            pool_e += n * p
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, chi2_threshold(max(len(obs) - 1, 1))


def token_counts(samples: torch.Tensor) -> dict[int, int]:
    """How often each token id occurs in ``samples`` (int64 ``[N]``)."""
    return dict(Counter(samples.tolist()))


def token_probs(p: torch.Tensor) -> dict[int, float]:
    """Token id -> probability, from weights ``p`` (``[V]``, normalised here in float64)."""
    return dict(enumerate((p.double() / p.sum()).tolist()))
