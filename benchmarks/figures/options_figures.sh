#!/usr/bin/env bash
# Issue 27: the speedup with generation options against the speedup without them, the same
# prompts and configuration, side by side with HF generate given the same options. Feeds
# docs/generation.md, "What the options cost". Run on a quiet machine (nothing else on the cores).
#
#   bash benchmarks/figures/options_figures.sh            # all steps; STEPS="gsm8k-plain ..." for some
#
#   gsm8k-plain / gsm8k-options     GSM8K test first 20, 128 new tokens
#   conv-plain / conv-options       Spec-Bench conversation (MT-bench, both turns) first 10, 128 per turn
# options: --repetition-penalty 1.1 --no-repeat-ngram-size 4. Configuration: the default
# (the shipped head with prompt lookup, auto trees), bf16, packed weights.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/figures/steps.sh
STEPS=${STEPS:-"gsm8k-plain gsm8k-options conv-plain conv-options"}
R=benchmarks/results
COMMON=(--config smollm2-135m-instruct-eagle+lookup@auto --no-hf-lookup --no-treespec-ar --dtype bfloat16 --pack
        --max-new-tokens 128)
OPTS=(--repetition-penalty 1.1 --no-repeat-ngram-size 4)
step gsm8k-plain "$R/options-gsm8k20-plain.json" treespec bench --dataset gsm8k --num-prompts 20 "${COMMON[@]}" \
  --out "$R/options-gsm8k20-plain.json"
step gsm8k-options "$R/options-gsm8k20-options.json" treespec bench --dataset gsm8k --num-prompts 20 "${COMMON[@]}" \
  "${OPTS[@]}" --out "$R/options-gsm8k20-options.json"
step conv-plain "$R/options-conv10-plain.json" treespec bench --dataset spec-bench:conversation --num-prompts 10 \
  "${COMMON[@]}" --out "$R/options-conv10-plain.json"
step conv-options "$R/options-conv10-options.json" treespec bench --dataset spec-bench:conversation --num-prompts 10 \
  "${COMMON[@]}" "${OPTS[@]}" --out "$R/options-conv10-options.json"
