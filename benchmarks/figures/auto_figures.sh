#!/usr/bin/env bash
# Issue 9's figures: `auto` beside every fixed preset (chain-1..4, cpu-tiny, cpu, eagle2) with
# the shipped head, greedy on GSM8K test (first 50) and HumanEval (first 20), then
# temperature 1 on GSM8K test (first 10), and prompt lookup where it finds little (chat
# prompts sampled at temperature 1: text without repeats) beside treespec without a draft.
# bf16, packed weights, 256 new tokens, on a quiet machine (nothing else on the cores).
# TREES narrows the trees run, EXTRA adds DRAFT@TREE configs (e.g. the head alone beside
# HEAD=smollm2-135m-instruct-eagle+lookup), HF_LOOKUP=1 adds transformers' prompt lookup,
# TAG renames the outputs. Each step writes its JSON/TXT under
# benchmarks/results/ and is skipped when that file exists: rerun to resume.
#
#   bash benchmarks/figures/auto_figures.sh 2>&1 | tee /tmp/auto_figures.log
# Feeds docs/benchmarks.md: "`auto` beside every fixed preset" and the issue-9 sections after it
# (each gives its TAG/TREES/EXTRA); docs/trees.md quotes its auto-*.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=benchmarks/results
HEAD=${HEAD:-smollm2-135m-instruct-eagle}
TAG=${TAG:-auto}
STEPS=${STEPS:-"gsm8k humaneval t1 useless"}
# auto's profile for the shipped head (written by benchmarks/figures/head_figures.sh's tune step:
# cost curve on this machine, calibration from 10 GSM8K-train questions).
P=${PROFILE:-$R/auto-profile-head2-bfloat16.json}
source benchmarks/figures/steps.sh
CONFIGS=()
TREES=${TREES:-"chain-1 chain-2 chain-3 chain-4 cpu-tiny cpu eagle2 auto"}
for t in $TREES; do CONFIGS+=(--config "$HEAD@$t"); done
for c in ${EXTRA:-}; do CONFIGS+=(--config "$c"); done
LOOKUP=--no-hf-lookup
[ -n "${HF_LOOKUP:-}" ] && LOOKUP=

step gsm8k $R/$TAG-gsm8k50-bf16.json treespec bench --dtype bfloat16 --pack --dataset gsm8k \
  --num-prompts 50 --max-new-tokens 256 $LOOKUP --no-treespec-ar "${CONFIGS[@]}" \
  --auto-profile $P --out $R/$TAG-gsm8k50-bf16.json
step humaneval $R/$TAG-humaneval20-bf16.json treespec bench --dtype bfloat16 --pack --dataset humaneval \
  --num-prompts 20 --max-new-tokens 256 $LOOKUP --no-treespec-ar "${CONFIGS[@]}" \
  --auto-profile $P --out $R/$TAG-humaneval20-bf16.json
step t1 $R/$TAG-gsm8k10-t1-bf16.json treespec bench --dtype bfloat16 --pack --dataset gsm8k \
  --num-prompts 10 --max-new-tokens 256 --temperature 1 --no-hf-lookup --no-treespec-ar "${CONFIGS[@]}" \
  --auto-profile $P --out $R/$TAG-gsm8k10-t1-bf16.json
step useless $R/$TAG-ngram-chat12-t1-bf16.json treespec bench --dtype bfloat16 --pack --dataset chat \
  --num-prompts 12 --max-new-tokens 256 --temperature 1 --no-hf-lookup --config ngram@chain-3 --config ngram@auto \
  --out $R/$TAG-ngram-chat12-t1-bf16.json
echo "== done ($(date -u +%H:%M:%S))"
