"""The sampling arguments of ``treespec.generate`` (temperature, top-k, top-p, min-p), checked.

Nothing samples here. The arguments become transformers' own warpers, in transformers' order,
through a GenerationConfig (``treespec.processing``), so that "the distribution of
``model.generate``" means exactly that, and the target's sample at each node is drawn in
``treespec.accept``. :meth:`SamplingParams.probs` gives the processed distribution for tests
and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__all__ = ["SamplingParams", "check_sampling_args"]


def check_sampling_args(temperature, top_k, top_p, min_p) -> None:
    """ValueError, saying what to change, unless the four make a valid sampling (or greedy) setting."""
    t = temperature
    if not isinstance(t, (int, float)) or t != t or t < 0 or t == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int, got {top_k!r}: leave it unset (None; on the "
                         "command line, no --top-k) to sample from the whole vocabulary")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if min_p is not None and not (0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if t == 0 and any(v is not None for v in (top_k, top_p, min_p)):
        raise ValueError(
            "top_k, top_p and min_p apply to sampling: with temperature=0 (greedy) they "
            "would be ignored; set temperature > 0 or leave them unset"
        )


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy decoding; the other fields then must be unset."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self):
        check_sampling_args(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warpers(self) -> LogitsProcessorList:
        out = LogitsProcessorList()
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_k is not None:
            out.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            out.append(TopPLogitsWarper(self.top_p))
        if self.min_p is not None:
            out.append(MinPLogitsWarper(self.min_p))
        return out

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., V]``: the processed distribution of each row of ``logits``."""
        if self.greedy:
            raise ValueError("greedy decoding has no sampling distribution")
        shape = logits.shape
        scores = logits.reshape(-1, shape[-1]).float()
        scores = self.warpers()(None, scores)
        return torch.softmax(scores, dim=-1).reshape(shape)
