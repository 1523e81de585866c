#!/usr/bin/env bash
# Figures of a head (issue 10) and of `auto` with it, alone and with prompt lookup grafted on
# (issue 9), on a quiet machine (nothing else on the cores). Each step writes its JSON/TXT under
# benchmarks/results/ and is skipped when that file exists: rerun to resume.
#
#   HEAD=runs/head-s2/head TAG=head3 bash benchmarks/figures/head_figures.sh 2>&1 | tee /tmp/head_figures.log
#
# HEAD: the head (a shipped name or a folder); OLD: another head run beside with chain-3 on
# HumanEval; STEPS: which steps run (add "ship" to write HEAD's auto-profile.json from the
# merged profile); CHAT: how many chat-eval prompts.
# Feeds README.md "Measured" and docs/benchmarks.md "The head trained on ..." sections (TAG=head2,
# head3, head4); the ship step, docs/training.md "The shipped head".
set -euo pipefail
cd "$(dirname "$0")/../.."
R=benchmarks/results
HEAD=${HEAD:-smollm2-135m-instruct-eagle}
TAG=${TAG:-head3}
OLD=${OLD:-}
CHAT=${CHAT:-24}
STEPS=${STEPS:-"tune tune-lookup humaneval gsm8k chat"}
TRAIN=$(python -c 'from treespec.data import dataset_path; print(dataset_path("gsm8k-train"))')
source benchmarks/figures/steps.sh
P=$R/auto-profile-$TAG-bfloat16.json         # the head alone: what ships beside the head
PL=$R/auto-profile-$TAG-lookup-bfloat16.json  # the head with prompt lookup grafted on
PM=$R/auto-profile-$TAG-merged-bfloat16.json  # the head's own calibration + lookup's sources
# auto's profiles: the cost curve measured now, the calibrations on 10 GSM8K-train questions.
step tune $P treespec tune --dtype bfloat16 --pack --draft "$HEAD" --dataset "$TRAIN" --prompt-field question \
  --num-prompts 10 --max-new-tokens 256 --refresh-costs --out $P --plot-dir $R/$TAG-plots
step tune-lookup $PL treespec tune --dtype bfloat16 --pack --draft "$HEAD+lookup" --dataset "$TRAIN" \
  --prompt-field question --num-prompts 10 --max-new-tokens 256 --out $PL --plot-dir $R/$TAG-lookup-plots
# The bench starts both drafters' auto from one profile: the head's calibration learned alone
# (the hybrid's own source-0 calibration sees only the nodes lookup did not also propose) and
# the lookup and agreed calibrations learned with the hybrid.
if [ ! -e $PM ]; then
  python - "$P" "$PL" "$PM" <<'EOF'
import sys
from treespec.auto import AutoProfile
alone, hybrid = AutoProfile.load(sys.argv[1]), AutoProfile.load(sys.argv[2])
alone.sources = hybrid.sources
alone.keys["sources"] = sys.argv[2]
alone.save(sys.argv[3])
EOF
fi
CONFIGS=(--config "$HEAD@chain-3" --config "$HEAD@cpu" --config "$HEAD@auto"
         --config "$HEAD+lookup@chain-3" --config "$HEAD+lookup@auto")
# GSM8K test first 50, HumanEval first 20, chat-eval; 256 new tokens, greedy, bf16, plain HF
# generate and HF generate on packed weights as baselines, HF prompt lookup beside the hybrid
# (GSM8K without it: it takes the longest there).
step humaneval $R/$TAG-humaneval20-bf16.json treespec bench --dtype bfloat16 --pack --dataset humaneval \
  --num-prompts 20 --max-new-tokens 256 --no-treespec-ar "${CONFIGS[@]}" ${OLD:+--config "$OLD@chain-3"} \
  --auto-profile $PM --out $R/$TAG-humaneval20-bf16.json
step gsm8k $R/$TAG-gsm8k50-bf16.json treespec bench --dtype bfloat16 --pack --dataset gsm8k \
  --num-prompts 50 --max-new-tokens 256 --no-hf-lookup --no-treespec-ar "${CONFIGS[@]}" \
  --auto-profile $PM --out $R/$TAG-gsm8k50-bf16.json
step chat $R/$TAG-chat$CHAT-bf16.json treespec bench --dtype bfloat16 --pack --dataset chat \
  --num-prompts $CHAT --max-new-tokens 256 --no-treespec-ar "${CONFIGS[@]}" \
  --auto-profile $PM --out $R/$TAG-chat$CHAT-bf16.json
# ship (not a default step: run it once the figures are in, for the head that ships): the merged
# profile's calibrations, without this machine's cost curve and timings, as the head's own
# auto-profile.json (what `auto` starts from with it; docs/trees.md).
if [[ " $STEPS " == *" ship "* ]]; then
  python - "$PM" "$HEAD" <<'EOF'
import sys
from treespec.assets import resolve_draft
from treespec.auto import HEAD_PROFILE, AutoProfile
profile = AutoProfile.load(sys.argv[1]).calibrations_only()
profile.keys["note"] = ("calibrations only: auto reads the calibrations of a head directory's auto-profile.json (the "
                        "head's own, learned alone; prompt lookup's, learned with lookup grafted on); the cost curve "
                        f"is measured on each machine. Copied from {sys.argv[1]} (written by benchmarks/figures/head_figures.sh).")
print("== ship:", profile.save(resolve_draft(sys.argv[2]) / HEAD_PROFILE))
EOF
fi
echo "== done ($(date -u +%H:%M:%S))"
