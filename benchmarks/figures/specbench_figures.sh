#!/usr/bin/env bash
# Issue 26: Spec-Bench as its "done when" asks (bf16, packed weights, greedy, 256 new tokens, ten
# questions per category, MT-bench both turns), side by side in one run: plain HF generate, HF
# generate on the same packed weights, HF prompt lookup, and treespec's default (the shipped
# head with prompt lookup on auto trees), the hybrid's chain-3 and the head alone. Feeds
# docs/benchmarks.md, "Spec-Bench". Run on a quiet machine (nothing else on the cores): 43-50
# minutes on a 2-core AMD EPYC Zen 4.
#
#   bash benchmarks/figures/specbench_figures.sh        # STEPS="spec10" (the default)
#
# spec480: all 480 questions (80 per category): the default configuration and the hybrid's chain-3
# (issue 26 item 5: which to pick per category) beside plain HF generate, HF generate on the same
# packed weights and HF prompt lookup, about six hours on two cores: it keeps a journal
# (benchmarks/results/specbench480-256-bf16-$TAG.jsonl, committed as it grows) and the same command
# resumes from it after a stop, in this session or a later one on the same machine type (a
# journal refuses another head's weights: head5's 212 questions are specbench480-256-bf16-head5.jsonl):
#   STEPS=spec480 bash benchmarks/figures/specbench_figures.sh
#
# TAG names the shipped head the figures are for (files specbench10-256-bf16-$TAG.*): head4 ran
# 2026-12-03, head5 2026-12-04, head6 (shipped 2026-12-05) is the default.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/figures/steps.sh
STEPS=${STEPS:-"spec10"}
TAG=${TAG:-head6}
R=benchmarks/results
step spec10 "$R/specbench10-256-bf16-$TAG.json" treespec bench --dataset spec-bench --num-prompts 10 --max-new-tokens 256 \
  --dtype bfloat16 --pack --no-treespec-ar --threads 2 --out "$R/specbench10-256-bf16-$TAG.json" \
  --plot-dir "$R" --plot-prefix "specbench10-256-bf16-$TAG-"
step spec480 "$R/specbench480-256-bf16-$TAG.json" treespec bench --dataset spec-bench --num-prompts 80 --max-new-tokens 256 \
  --dtype bfloat16 --pack --no-treespec-ar --config smollm2-135m-instruct-eagle+lookup@auto \
  --config smollm2-135m-instruct-eagle+lookup@chain-3 --threads 2 \
  --journal "$R/specbench480-256-bf16-$TAG.jsonl" --out "$R/specbench480-256-bf16-$TAG.json" --plot-dir "$R" \
  --plot-prefix "specbench480-256-bf16-$TAG-"
