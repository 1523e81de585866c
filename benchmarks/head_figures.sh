#!/usr/bin/env bash
# Figures of the self-distilled head (issue 10) and auto with it (issue 9), on a quiet
# machine (nothing else on the cores). Each step writes its JSON/TXT under
# benchmarks/results/ and is skipped when that file exists: rerun to resume.
#
#   HEAD=runs/head-s1/head bash benchmarks/head_figures.sh 2>&1 | tee /tmp/head_figures.log
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
HEAD=${HEAD:-smollm2-135m-instruct-eagle}
TAG=${TAG:-head2}
OLD=${OLD:-}  # optional: another head run beside on HumanEval and chat (chain-3)
EXTRA=()
[ -n "$OLD" ] && EXTRA=(--config "$OLD@chain-3")
STEPS=${STEPS:-"tune gsm8k humaneval chat"}
TRAIN=$(python -c 'from treespec.data import dataset_path; print(dataset_path("gsm8k-train"))')
source benchmarks/steps.sh
P=$R/auto-profile-$TAG-bfloat16.json
# auto's profile for this head: the cost curve measured now, the calibration on GSM8K train.
step tune $P treespec tune --dtype bfloat16 --draft "$HEAD" --dataset "$TRAIN" --prompt-field question \
  --num-prompts 10 --max-new-tokens 256 --refresh-costs --out $P --plot-dir $R/$TAG-plots
# GSM8K test first 50, HumanEval first 20, chat-eval first 24; 256 new tokens, greedy, bf16,
# plain HF generate and HF generate on packed weights as baselines.
step gsm8k $R/$TAG-gsm8k50-bf16.json treespec bench --dtype bfloat16 --dataset gsm8k \
  --num-prompts 50 --max-new-tokens 256 --no-hf-lookup --no-treespec-ar \
  --config "$HEAD@chain-3" --config "$HEAD@cpu" --config "$HEAD@auto" --auto-profile $P \
  --out $R/$TAG-gsm8k50-bf16.json
step humaneval $R/$TAG-humaneval20-bf16.json treespec bench --dtype bfloat16 --dataset humaneval \
  --num-prompts 20 --max-new-tokens 256 --no-hf-lookup --no-treespec-ar \
  --config "$HEAD@chain-3" --config "$HEAD@cpu" --config "$HEAD@auto" --auto-profile $P "${EXTRA[@]}" \
  --out $R/$TAG-humaneval20-bf16.json
step chat $R/$TAG-chat24-bf16.json treespec bench --dtype bfloat16 --dataset chat \
  --num-prompts 24 --max-new-tokens 256 --no-hf-lookup --no-treespec-ar \
  --config "$HEAD@chain-3" --config "$HEAD@cpu" "${EXTRA[@]}" \
  --out $R/$TAG-chat24-bf16.json
echo "== done ($(date -u +%H:%M:%S))"
