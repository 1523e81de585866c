"""The bench's judge: where a configuration's greedy output leaves HF generate's, whether the
difference is a rounding near-tie or unexplained, judged in fp32 with
:mod:`treespec.divergence` (its first difference, then every later token on its own prefix)."""

from __future__ import annotations

import dataclasses
import logging

from ..divergence import classify_divergence, fp32_reference, worst_greedy_shortfall
from .results import ConfigResult, RunRecord

log = logging.getLogger(__name__)


class Judge:
    """Records where a configuration left HF generate's greedy output on a prompt, and whether
    an fp32 copy of the model (made at the first difference) calls it a bf16 near-tie."""

    def __init__(self, tolerance: float, options: dict):
        self.tolerance = tolerance
        self.options = options  # the generation options every configuration ran with
        self.reference = None

    def __call__(self, model, r: ConfigResult, i: int, ref: RunRecord, got: RunRecord) -> None:
        # The first turn whose answers differ: earlier answers agree, so both runs were given
        # the same prompt for it; later turns' prompts differ and are not compared.
        t = next(t for t in range(len(got.turn_lengths)) if ref.turn_tokens(t) != got.turn_tokens(t))
        self.reference = self.reference if self.reference is not None else fp32_reference(model)
        d = classify_divergence(self.reference, got.turn_prompts[t], ref.turn_tokens(t), got.turn_tokens(t),
                                self.tolerance, self._processor(model, len(got.turn_prompts[t])))
        # What follows answers the run's own prefixes: every later token must be a greedy choice there.
        worst = max((self._worst(model, got, u, d.position + 1 if u == t else 0)
                     for u in range(t, len(got.turn_lengths))), key=lambda x: x[1], default=(None, 0.0))
        d = dataclasses.replace(d, position=sum(got.turn_lengths[:t]) + d.position,  # into the whole output
                                later_position=worst[0], later_shortfall=worst[1])
        r.mismatches.append(i)
        r.first_diff[i] = d.position
        r.divergences[i] = d
        log.warning("%s differs from HF generate on prompt %d at token %d: %s (fp32 shortfall %.3g, after it at most "
                    "%.3g, tolerance %.3g)", r.config.name, i, d.position, "near-tie" if d.near_tie else "UNEXPLAINED",
                    d.fp32_shortfall, d.later_shortfall, self.tolerance)

    def _worst(self, model, got: RunRecord, turn: int, start: int) -> tuple[int | None, float]:
        """The worst fp32 shortfall among turn ``turn``'s tokens from ``start`` on, and where it
        lies in the whole output."""
        tokens = got.turn_tokens(turn)
        j, short = worst_greedy_shortfall(self.reference, got.turn_prompts[turn], tokens,
                                          self._processor(model, len(got.turn_prompts[turn])), start)
        return (None if j < 0 else sum(got.turn_lengths[:turn]) + j), short

    def _processor(self, model, prompt_len: int):
        """The options' processors for a prompt of ``prompt_len`` tokens (None without options):
        a near-tie is judged on the scores greedy chose from."""
        opts = {k: v for k, v in self.options.items() if k != "stop_strings"}  # stops end a run; they rank nothing
        if not opts:
            return None
        from ..processing import NodeProcessor, exact_generation_config

        cfg = exact_generation_config(model, eos_token_id=model.generation_config.eos_token_id, **opts)
        return NodeProcessor.build(model, cfg, prompt_len).processors
