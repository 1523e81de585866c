"""What a generation returns: the tokens of each step (:class:`StepOutput`), the whole
sequences (:class:`GenerateOutput`), and the counters of both (:class:`SpecMetrics`, one
:class:`RequestMetrics` per request)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..tree import Tree

__all__ = ["GenerateOutput", "SpecMetrics", "RequestMetrics", "StepOutput"]


@dataclass
class RequestMetrics:
    num_steps: int = 0  # verify forwards this request took part in
    num_generated: int = 0  # tokens generated (prefill's first token included)
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per step
    prompt_tokens: int = 0
    hit_tokens: int = 0  # prompt tokens whose K/V (and draft state) a PrefixCache supplied, not recomputed
    first_token_seconds: float = 0.0  # time to first token: from decoding's start through prefill (batch-wide)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify forward, the bonus included (tau)."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the prefill ran through the target: the prompt less the cache's hit."""
        return self.prompt_tokens - self.hit_tokens


@dataclass
class SpecMetrics:
    """Counters of one generation.

    ``mean_accepted_length`` (tau) is the mean over (request, verify step) pairs of the
    tokens committed, bonus included; the first token, produced by prefill, is not part
    of it. ``acceptance_counts[d-1]`` counts the (request, step) pairs that accepted at
    least ``d`` drafted tokens; dividing by ``num_request_steps`` gives the acceptance rate
    by draft position.
    """

    num_steps: int = 0
    num_generated: int = 0
    num_request_steps: int = 0
    acceptance_counts: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    compile_seconds: float = 0.0  # compiling verify buckets and head passes in this call (outside the timers)
    tree_tokens: int = 0  # tokens run through verify forwards (roots included)
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes verified, per request-step
    requests: list[RequestMetrics] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        acc = [a for r in self.requests for a in r.accepted]
        return (sum(acc) + len(acc)) / max(len(acc), 1)

    @property
    def acceptance_rate_by_position(self) -> list[float]:
        return [c / max(self.num_request_steps, 1) for c in self.acceptance_counts]

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def decode_seconds(self) -> float:
        """Wall time after prefill: drafting, verifying and committing."""
        return max(self.total_seconds - self.prefill_seconds, 0.0)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after each request's first (prefill makes it) per decode second: the rate
        speculation changes, whatever the prompt's length."""
        decoded = self.num_generated - len(self.requests)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def mean_tree_size(self) -> float:
        """Drafted nodes verified per request-step (what an ``auto`` tree chose)."""
        return sum(self.tree_sizes) / max(len(self.tree_sizes), 1)

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens a PrefixCache supplied (their prefill was not run): the prefill work
        the cache saved, in tokens. Its time is not measured here (it would take the prefill
        run both ways; ``benchmarks/micro/prefix_cache.py`` does)."""
        return sum(r.hit_tokens for r in self.requests)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens run through the target at prefill."""
        return sum(r.prefill_tokens for r in self.requests)

    def record_first_tokens(self, hits: Sequence[int], seconds: float) -> None:
        """Prefill produced each request's first token, ``seconds`` after decoding began;
        ``hits[b]``: request b's prompt tokens that came from a prefix cache."""
        for r, hit in zip(self.requests, hits):
            r.num_generated = 1
            r.hit_tokens = hit
            r.first_token_seconds = seconds
        self.num_generated = len(self.requests)

    def record_step(self, requests: Sequence[int], trees: Sequence[Tree], tokens: Sequence[list[int]]) -> None:
        """One verify forward: ``requests[i]`` verified ``trees[i]`` and committed ``tokens[i]``
        (its accepted drafts, then the bonus)."""
        for b, toks in zip(requests, tokens):
            r, accepted = self.requests[b], len(toks) - 1
            r.num_steps += 1
            r.accepted.append(accepted)
            r.num_generated += len(toks)
            self.num_generated += len(toks)
            self.num_request_steps += 1
            while len(self.acceptance_counts) < accepted:
                self.acceptance_counts.append(0)
            for d in range(accepted):
                self.acceptance_counts[d] += 1
        self.num_steps += 1
        self.tree_tokens += sum(t.num_nodes for t in trees)
        self.tree_sizes.extend(t.num_drafted for t in trees)

    def summary(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_generated": self.num_generated,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate_by_position": self.acceptance_rate_by_position,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
            "compile_seconds": self.compile_seconds,
            "tokens_per_second": self.tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "mean_tree_size": self.mean_tree_size,
            "prefill_tokens": self.prefill_tokens,
            "hit_tokens": self.hit_tokens,
        }


@dataclass
class StepOutput:
    """Tokens committed in one step: ``tokens[i]`` for request i (empty if it was idle),
    ``finished[i]`` once request i has ended. ``metrics`` is the live counter object.
    ``scores[i]``: with ``output_scores``, float ``[len(tokens[i]), V]``, the processed logits
    each of those tokens was chosen from (as ``generate``'s ``output_scores``); else None."""

    step: int
    tokens: list[list[int]]
    finished: list[bool]
    metrics: SpecMetrics
    scores: list[torch.Tensor] | None = None


@dataclass
class GenerateOutput:
    """``sequences[i]``: request i's generated ids (prompt excluded, EOS kept if produced).
    ``scores[i]``: with ``output_scores``, float ``[len(sequences[i]), V]``, the processed logits
    of every generated position; else None."""

    sequences: list[list[int]]
    metrics: SpecMetrics
    scores: list[torch.Tensor] | None = None

    def __getitem__(self, i):
        return self.sequences[i]
