"""Sizing a self-generated training run to a time budget, from rates measured on this run.

A run's cost is nearly linear in its amounts: each training conversation costs its share of
sampled user turns (``turn / keep``: the filters drop some), its answer (``answer``, decoded
with its features recorded) and one training pass per epoch (``epochs * train``); the tune
stage is a fixed cost. The first minutes of the run measure these rates on real work (the
first chunk of user turns, the held-out answers, a few training steps), and :func:`size_plan`
fits the amounts into what the budget has left:

    rates = Rates(turn=0.6, keep=0.88, answer=1.3, train=0.2, tune=60)
    plan = size_plan(7200 - spent, rates)        # Plan(prompts=..., answer_tokens=256, epochs=2)
    plan.seconds(rates)                          # {"prompts": ..., "answers": ..., "train": ..., "tune": ...}

Why epochs stay at 2 and data takes the rest: in the ablations (docs/training.md) acceptance
grows with the number of conversations and has not levelled off at 14,000, and a second
epoch buys about what as many new conversations do at a tenth of their cost; so data gets
every second the budget leaves, after two epochs over it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["Rates", "Plan", "size_plan", "answer_tokens_for", "tune_size", "refit_epochs", "format_duration",
           "STAGES"]

STAGES = ("prompts", "answers", "train", "tune")
ANSWER_TOKENS = 256  # the most tokens of an answer: what the shipped head's captures used
EPOCHS = 2.0
MAX_EPOCHS = 3.0  # what time left after the answers may raise the epochs to
MIN_PROMPTS = 16  # fewer conversations train no useful head: the plan says so and keeps these


@dataclass(frozen=True)
class Rates:
    """Seconds per unit of work, measured on this run (all > 0; ``keep`` in (0, 1])."""

    turn: float  # one raw user turn sampled (chunks of 64 decoded together)
    keep: float  # the share of raw turns the filters keep
    answer: float  # one conversation answered, features recorded (batches of 64)
    train: float  # one conversation through one training epoch
    tune: float  # the whole tune stage

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """The amounts of a run: ``prompts`` training conversations (the held-out ones apart),
    answers of at most ``answer_tokens``, ``epochs`` passes over them."""

    prompts: int
    answer_tokens: int
    epochs: float

    def seconds(self, rates: Rates) -> dict[str, float]:
        """What each stage should take at ``rates``."""
        return {"prompts": self.prompts / rates.keep * rates.turn, "answers": self.prompts * rates.answer,
                "train": self.prompts * self.epochs * rates.train, "tune": rates.tune}

    def to_json(self) -> dict:
        return asdict(self)


def answer_tokens_for(budget: float | None) -> int:
    """The answers' length limit, chosen before anything is measured (the held-out answers are
    decoded with it): 256 tokens, 128 under 10 minutes, 64 under 3 (a short run would spend
    its budget on a few long answers)."""
    if budget is None or budget >= 600:
        return ANSWER_TOKENS
    return 128 if budget >= 180 else 64


def tune_size(budget: float | None) -> tuple[int, int]:
    """``(prompts, new tokens)`` of each tune pass: 8 x 128 from an hour's budget, 4 x 64 from
    10 minutes, 2 x 32 below."""
    if budget is None or budget >= 3600:
        return 8, 128
    return (4, 64) if budget >= 600 else (2, 32)


def size_plan(left: float, rates: Rates, *, prompts: int | None = None, answer_tokens: int = ANSWER_TOKENS,
              epochs: float | None = None) -> Plan:
    """The amounts that fit ``left`` seconds at ``rates``; an amount given is kept as it is
    and the others fill the rest. Never fewer than :data:`MIN_PROMPTS` conversations (a budget
    too short for them is overrun, and the caller says so)."""
    epochs = EPOCHS if epochs is None else epochs
    if prompts is None:
        per = rates.turn / rates.keep + rates.answer + epochs * rates.train
        prompts = max(MIN_PROMPTS, math.floor((left - rates.tune) / per))
    return Plan(prompts=prompts, answer_tokens=answer_tokens, epochs=epochs)


def refit_epochs(left: float, rates: Rates, conversations: int, planned: float) -> float:
    """The epochs once the answers are in: the plan's, lowered (to one at least) where the
    time left would not cover them, raised (to :data:`MAX_EPOCHS` at most) where the data
    stages came in early. Rounded to a tenth."""
    if conversations < 1:
        return planned
    fits = (left - rates.tune) / (conversations * rates.train)
    return round(min(max(fits, 1.0), max(planned, MAX_EPOCHS)), 1)


def format_duration(seconds: float) -> str:
    """``"1 h 05 min"``, ``"12 min"``, ``"45 s"``."""
    s = max(0, round(seconds))
    if s < 120:
        return f"{s} s"
    m = round(s / 60)
    return f"{m // 60} h {m % 60:02d} min" if m >= 60 else f"{m} min"
