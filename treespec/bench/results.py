"""What a benchmark records: a :class:`RunRecord` per configuration and prompt, gathered per
configuration in :class:`ConfigResult` and for the whole run in :class:`BenchResult`; and the
:class:`BenchProgress` reports a run sends to its callback."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..divergence import Divergence
from ..pack_choice import PackingChoice
from ..sampling_args import SamplingParams
from .configs import TREESPEC, BenchConfig


@dataclass
class BenchProgress:
    """``stage`` is ``"warmup"`` or ``"prompts"``; ``done`` of ``total`` finished; ``config``
    the configuration starting (None once a prompt is done)."""

    stage: str
    done: int
    total: int
    config: str | None = None
    runs: dict[str, RunRecord] | None = None  # a finished prompt's records, by configuration
    resumed: bool = False  # that prompt was read back from the journal, not run


@dataclass
class RunRecord:
    """One configuration on one prompt (every turn of it: tokens concatenated, seconds summed)."""

    tokens: list[int]
    seconds: float
    metrics: dict | None = None  # SpecMetrics.summary() plus steps/accepted, treespec only
    turn_prompts: list[list[int]] = field(default_factory=list)  # what each turn was given
    turn_lengths: list[int] = field(default_factory=list)  # tokens of each turn's answer

    def turn_tokens(self, t: int) -> list[int]:
        start = sum(self.turn_lengths[:t])
        return self.tokens[start:start + self.turn_lengths[t]]

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ConfigResult:
    config: BenchConfig
    runs: list[RunRecord] = field(default_factory=list)
    mismatches: list[int] = field(default_factory=list)  # prompt indices, greedy only
    first_diff: dict[int, int] = field(default_factory=dict)  # prompt -> first differing token
    divergences: dict[int, Divergence] = field(default_factory=dict)  # prompt -> fp32 judgement
    skipped: str | None = None
    warmup_seconds: float | None = None  # the untimed warm-up's wall time (a compiled one compiles there)

    @property
    def unexplained(self) -> list[int]:
        """Prompts whose greedy output left HF generate's other than at a rounding near-tie."""
        return [i for i in self.mismatches if not (i in self.divergences and self.divergences[i].near_tie)]


@dataclass
class BenchResult:
    prompt_lengths: list[int]  # of each prompt's first turn
    results: list[ConfigResult]
    sampling: SamplingParams
    max_new_tokens: int
    seed: int | None
    notes: list[str] = field(default_factory=list)
    dtype: str = "float32"
    fast_path: str | None = None
    categories: list[str | None] = field(default_factory=list)  # each prompt's, where it has one
    turns: list[int] = field(default_factory=list)  # each prompt's number of user turns
    packing: PackingChoice | None = None  # the start-up choice of weights for treespec

    @property
    def baseline(self) -> ConfigResult:
        return self.results[0]

    @property
    def treespec_mismatches(self) -> int:
        """Prompts on which a treespec configuration's greedy output differs from HF's."""
        return sum(len(r.mismatches) for r in self.results if r.config.kind == TREESPEC)

    @property
    def treespec_unexplained(self) -> int:
        """Of those, the ones that are not rounding near-ties (must be 0)."""
        return sum(len(r.unexplained) for r in self.results if r.config.kind == TREESPEC)
