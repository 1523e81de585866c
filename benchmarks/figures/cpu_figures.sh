#!/usr/bin/env bash
# Every CPU figure of docs/benchmarks.md ("CPU fast path" sections), one after another, on a
# quiet machine (nothing else on the cores: two-thread timings are distorted several-fold by
# any other process). Each step writes its JSON and text under benchmarks/results/ and is
# skipped when its JSON already exists, so an interrupted run resumes where it stopped.
#
#   bash benchmarks/figures/cpu_figures.sh 2>&1 | tee /tmp/cpu_figures.log
#   STEPS="cost bench-bf16" bash benchmarks/figures/cpu_figures.sh     # a subset
set -euo pipefail
cd "$(dirname "$0")/../.."
R=benchmarks/results
STEPS=${STEPS:-"cost tune bench-bf16 profile bench-fp32 humaneval-bf16 gemm compile ngram-chat"}
HEAD=smollm2-135m-instruct-eagle
TRAIN=$(python -c 'from treespec.data import dataset_path; print(dataset_path("gsm8k-train"))')
source benchmarks/figures/steps.sh

step cost $R/forward_cost-bfloat16.json python benchmarks/micro/forward_cost.py --dtype bfloat16
step cost $R/forward_cost-float32.json python benchmarks/micro/forward_cost.py --dtype float32

# auto's profile: the cost curve measured here (refreshed: a cached curve from a busy
# machine is worthless) and the calibration learned on GSM8K *train* questions.
step tune $R/auto-profile-bfloat16.json treespec tune --dtype bfloat16 --pack --dataset "$TRAIN" --prompt-field question \
  --num-prompts 20 --max-new-tokens 256 --refresh-costs --out $R/auto-profile-bfloat16.json --plot-dir $R

# End to end, GSM8K test, first 50 questions, 256 new tokens, greedy, bf16: plain HF generate,
# the same-advantage baselines (HF generate and treespec without a draft, both on packed
# weights), chains and trees of the shipped head, and auto.
step bench-bf16 $R/cpu-fast-gsm8k50-bf16.json treespec bench --dtype bfloat16 --pack --dataset gsm8k \
  --num-prompts 50 --max-new-tokens 256 --no-hf-lookup \
  --config $HEAD@chain-2 --config $HEAD@chain-3 --config $HEAD@cpu-tiny --config $HEAD@cpu \
  --config $HEAD@auto --auto-profile $R/auto-profile-bfloat16.json \
  --out $R/cpu-fast-gsm8k50-bf16.json --plot-dir $R
step profile $R/profile_verify-bfloat16.json python benchmarks/micro/profile_verify.py --dtype bfloat16
step profile $R/profile_verify-float32.json python benchmarks/micro/profile_verify.py --dtype float32
step bench-fp32 $R/cpu-fast-gsm8k10-fp32.json treespec bench --dtype float32 --dataset gsm8k \
  --num-prompts 10 --max-new-tokens 256 --no-hf-lookup \
  --config $HEAD@chain-2 --config $HEAD@chain-3 --config $HEAD@cpu-tiny --config $HEAD@cpu \
  --out $R/cpu-fast-gsm8k10-fp32.json --plot-dir $R
step humaneval-bf16 $R/cpu-fast-humaneval20-bf16.json treespec bench --dtype bfloat16 --pack --dataset humaneval \
  --num-prompts 20 --max-new-tokens 256 --no-hf-lookup \
  --config $HEAD@chain-2 --config $HEAD@cpu-tiny --config $HEAD@auto --auto-profile $R/auto-profile-bfloat16.json \
  --out $R/cpu-fast-humaneval20-bf16.json --plot-dir $R
step gemm $R/gemm_small_m.txt sh -c "python benchmarks/micro/gemm_small_m.py > $R/gemm_small_m.txt"
step compile $R/compile_check-bfloat16.json python benchmarks/micro/compile_check.py --dtype bfloat16
# a draft that is useless on the prompts: prompt lookup on chat questions (few repeats)
step ngram-chat $R/cpu-fast-chat20-ngram-bf16.json treespec bench --dtype bfloat16 --pack --dataset chat \
  --num-prompts 20 --max-new-tokens 256 --no-hf-lookup --config ngram@chain-3 --config ngram@auto \
  --out $R/cpu-fast-chat20-ngram-bf16.json
echo "== done ($(date -u +%H:%M:%S))"
