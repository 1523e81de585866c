"""Telling a rounding near-tie from a bug when greedy outputs differ.

In fp32, treespec's greedy output equals ``model.generate``'s token for token (the tests
demand it). In bf16 it need not: a forward over 1 token and one over 16 tokens sum in
different orders, and bf16 keeps 8 significant bits (a logit near 27 is a multiple of
0.125), so two tokens whose logits are that close can swap places. Both outputs are then
right to bf16 precision, and after the swap they continue differently.

:func:`classify_divergence` decides which case a difference is: it recomputes the
target's logits in fp32 over the common prefix and measures how far below the fp32
maximum the lower of the two chosen tokens lies. Within ``tolerance`` the difference is a
near-tie; beyond it, something other than rounding chose the token: *unexplained*, which
must stay zero. After the first difference the two texts answer different prefixes, so
:func:`worst_greedy_shortfall` judges the rest of the run's own output on its own prefixes:
every token must lie within ``tolerance`` of the fp32 maximum there too.

Tolerances (:data:`NEAR_TIE_TOLERANCE`, in logits) come from a measurement on
SmolLM2-135M-Instruct (6 GSM8K test conversations, 1201 positions, bf16 against fp32):
the error of the bf16 top-2 logit gap was 0.07 at the median, 0.47 at the 99.9th
percentile and 0.81 at most, and bf16 greedy picked another token than fp32 at 28
positions. A bf16 tolerance of 1.0 logit covers the largest error seen with margin; fp32
kernels (MKL vs oneDNN) differ by about 1e-4.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Divergence", "NEAR_TIE_TOLERANCE", "classify_divergence", "first_difference", "fp32_reference",
           "worst_greedy_shortfall"]

#: dtype of the run -> largest fp32 logit shortfall still counted as a rounding near-tie
NEAR_TIE_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 1.0, torch.float16: 0.5}


@dataclass(frozen=True)
class Divergence:
    """The first position where two greedy outputs differ, judged in fp32.

    Attributes:
        position:        index into the generated tokens.
        reference_token: what the reference (``model.generate``) chose there.
        token:           what the other run chose.
        fp32_shortfall:  fp32 max logit minus the lower fp32 logit of the two tokens
                         (0 when both are fp32 maxima); the top-2 gap when one is the max.
        tolerance:       the near-tie bound it was judged against.
        later_position:  the run's token after the first difference that lies furthest below
                         the fp32 maximum at its own prefix (None: not judged, or none).
        later_shortfall: how far below (0 when not judged).
    """

    position: int
    reference_token: int
    token: int
    fp32_shortfall: float
    tolerance: float
    later_position: int | None = None
    later_shortfall: float = 0.0

    @property
    def near_tie(self) -> bool:
        """A rounding near-tie at the first difference, and every later token a greedy choice
        up to rounding."""
        return self.fp32_shortfall <= self.tolerance and self.later_shortfall <= self.tolerance

    def describe(self) -> dict:
        return {"position": self.position, "reference_token": self.reference_token, "token": self.token,
                "fp32_shortfall": self.fp32_shortfall, "tolerance": self.tolerance,
                "later_position": self.later_position, "later_shortfall": self.later_shortfall,
                "kind": "near-tie" if self.near_tie else "unexplained"}


def first_difference(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """Index of the first differing token; a proper prefix differs at its end; None if equal."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def fp32_reference(model):
    """``model`` itself when it runs in fp32, else an fp32 copy (same weights, upcast)."""
    if next(model.parameters()).dtype == torch.float32:
        return model
    return copy.deepcopy(model).float().eval()


@torch.inference_mode()
def classify_divergence(
    model_fp32,
    prompt: Sequence[int],
    reference: Sequence[int],
    tokens: Sequence[int],
    tolerance: float,
    processor=None,
) -> Divergence | None:
    """Judge the first difference between two greedy continuations of ``prompt``.

    Args:
        model_fp32: the target in fp32 (see :func:`fp32_reference`), run with its own
                    attention implementation.
        prompt:     int token ids ``[L]``.
        reference, tokens: the two generated continuations.
        tolerance:  the near-tie bound in logits (:data:`NEAR_TIE_TOLERANCE`).
        processor:  the generation options' processors (``(input_ids [1, L], scores [1, V])
                    -> scores``, a transformers ``LogitsProcessorList``), when the runs applied
                    some: the tie is then judged on the processed fp32 scores, which is what
                    greedy chose from.
    Returns None when the outputs are equal. When one output merely stops earlier (EOS
    or budget), the stopping side's choice is unknown and the divergence counts as
    unexplained (``token = -1``).
    """
    i = first_difference(reference, tokens)
    if i is None:
        return None
    if i >= len(reference) or i >= len(tokens):
        return Divergence(i, reference[i] if i < len(reference) else -1,
                          tokens[i] if i < len(tokens) else -1, float("inf"), tolerance)
    ids = torch.tensor([list(prompt) + list(reference[:i])], device=next(model_fp32.parameters()).device)
    logits = model_fp32(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1).logits[0, -1].float()
    if processor is not None:
        logits = processor(ids, logits[None])[0]
    a, b = int(reference[i]), int(tokens[i])
    shortfall = float(logits.max() - torch.minimum(logits[a], logits[b]))
    return Divergence(i, a, b, shortfall, tolerance)


@torch.inference_mode()
def worst_greedy_shortfall(model_fp32, prompt: Sequence[int], tokens: Sequence[int], processor=None,
                           start: int = 0) -> tuple[int, float]:
    """``(index, shortfall)`` of the token among ``tokens[start:]`` that lies furthest below the
    fp32 maximum at its own prefix (``prompt`` and the tokens before it), in one forward: 0 for
    greedy decoding in fp32, within the near-tie tolerance for a bf16 run's; ``(-1, 0.0)`` when
    there is no token to judge. ``processor``: as in :func:`classify_divergence`."""
    n = len(tokens) - start
    if n <= 0:
        return -1, 0.0
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=next(model_fp32.parameters()).device)
    logits = model_fp32(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=n,
                        use_cache=False).logits[0].float()
    if processor is not None:  # each position's scores with its own history, as greedy saw them
        first = len(prompt) + start
        logits = torch.cat([processor(ids[:, : first + j], logits[j: j + 1]) for j in range(n)])
    chosen = torch.tensor(list(tokens[start:]), device=logits.device)
    short = logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0]
    j = int(short.argmax())
    return start + j, float(short[j])
