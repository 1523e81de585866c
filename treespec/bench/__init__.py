"""Side-by-side benchmark: transformers' ``generate``, its prompt lookup, and treespec.

    prompts, _ = load_prompts("gsm8k", tokenizer, num_prompts=50)   # treespec.prompts
    result = run_bench(model, prompts, configs, max_new_tokens=256)
    print(format_table(to_json(result)))

    prompts, _ = load_bench_prompts("spec-bench", tokenizer, num_prompts=10)  # 10 per category
    result = run_bench(model, prompts, configs, max_new_tokens=256, tokenizer=tokenizer)

Every configuration runs on prompt i before any runs on prompt i+1, so drift in machine
load (another job, thermal throttling) spreads over all of them alike. Times are wall
seconds around one ``generate`` call, prompt tokenisation excluded. Under greedy decoding
every output is checked token for token against ``model.generate``'s.

A multi-turn prompt (:class:`~treespec.prompts.Prompt` with several turns: Spec-Bench's
MT-bench questions) runs as a conversation in every configuration: turn 1, then turn 2
templated after *that configuration's own* answer to turn 1, and so on; each turn may
generate ``max_new_tokens``, and its tokens and seconds are the sum over turns (as Spec-Bench
counts them). Under greedy decoding every configuration answers turn 1 as HF generate does,
so turn 2's prompt is the same for all and is compared token for token too; where a
configuration's answer differs (a bf16 near-tie), the difference is judged at its first
token, in the turn where it happened, and later turns are not compared.

Figures, per configuration:
    tokens_per_second         total generated tokens / total wall seconds
    median_tokens_per_second  median over prompts of that prompt's tokens / seconds
    speedup                   tokens_per_second / the HF generate baseline's
    median_speedup            median over prompts of the per-prompt ratio
    speedup_vs_same_path      tokens_per_second / the same-path baseline's: HF generate on plain
                              or on packed weights, whichever ran faster (``same_path_baseline``)
    speedup_vs_best_baseline  tokens_per_second / the fastest configuration's without speculation
                              (``best_baseline``; treespec without a draft is among them)
    mean_accepted_length      tokens committed per verify forward, bonus included (tau)
    acceptance_rate_by_position[d-1]  share of verify steps that accepted >= d drafts
    categories[c]             tokens/s, speedup and tau over the prompts of category c, and
                              ``spec_bench_speedup``: Spec-Bench's own ratio (evaluation/speed.py),
                              the mean of per-question tokens/s over the baseline's mean

The package, in the order a run goes through it:
    configs   :class:`BenchConfig`, one way to generate (HF generate, its prompt lookup, treespec),
              and :class:`BenchSettings`, how they all run
    results   what a run records: :class:`RunRecord` per configuration and prompt, gathered in
              :class:`ConfigResult` and :class:`BenchResult`; :class:`BenchProgress` reports
    running   :func:`run_bench`: every configuration on prompt i, then prompt i+1
    journal   the JSONL file a stopped run resumes from (:class:`~treespec.bench.journal.Journal`)
    judge     a greedy output that left HF generate's, judged in fp32 (:mod:`treespec.divergence`)
    report    :func:`to_json` (the figures above) and :func:`header_lines`
    table     :func:`format_table`, the plain-text table with its legend, and :func:`format_report`,
              the whole printed report, redrawn from a report's JSON alone
    plots     :func:`save_plots`, the PNGs

This package never prints: progress goes to ``callback``, details to ``logging``.
"""

from __future__ import annotations

from .configs import HF_GENERATE, HF_LOOKUP, PEER, TREESPEC, TREESPEC_AR, BenchConfig, BenchSettings
from .plots import save_plots
from .report import header_lines, spec_bench_ratio, to_json
from .results import BenchProgress, BenchResult, ConfigResult, RunRecord
from .running import run_bench
from .table import TABLE_WIDTH, format_report, format_table

__all__ = ["BenchConfig", "BenchSettings", "BenchResult", "ConfigResult", "BenchProgress", "RunRecord", "run_bench",
           "format_table", "format_report", "to_json", "header_lines", "save_plots", "spec_bench_ratio", "TABLE_WIDTH",
           "HF_GENERATE", "HF_LOOKUP", "TREESPEC", "TREESPEC_AR", "PEER"]
