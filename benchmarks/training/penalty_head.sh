#!/usr/bin/env bash
# Issue 27: a head that drafts well under a repetition penalty and banned n-grams. Drafts from a
# head trained on plain answers lose a fifth to a third of their acceptance to these options
# (docs/generation.md, "What the options cost"); here the shipped head is fine-tuned on answers
# the target wrote with the options on, and tau is measured with and without them. Steps resume
# (outputs under runs/, outside the work tree):
#
#   bash benchmarks/training/penalty_head.sh 2>&1 | tee -a runs/penalty_head.log
#
#   capture  1,024 conversations (GSM8K train and self-generated chat, held-out rows excluded),
#            answered with --repetition-penalty 1.1 --no-repeat-ngram-size 4, a fifth sampled
#   finetune BASE (default: the shipped head), one epoch at a third of its learning rate: runs/ft-pen/head
#   tau      tau_options.py with the fine-tuned head and the shipped one (same prompts, both options
#            rows and none; greedy, bf16, fixed trees: timing-free, any machine load)
# The figures in docs/generation.md ran with the head shipped before (BASE=runs/head-old4, from git as
# docs/training.md says; benchmarks/results/tau-options-penalty-{ft-pen,head4}.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-"capture finetune tau"}
THREADS=${THREADS:-2}
BASE=${BASE:-smollm2-135m-instruct-eagle}
has() { [[ " $STEPS " == *" $1 "* ]]; }
say() { echo "== $* ($(date -u +%H:%M:%S))"; }
OPTS=(--repetition-penalty 1.1 --no-repeat-ngram-size 4)
if has capture; then
  say "capture runs/cap-pen"
  treespec capture --data "gsm8k-train[:512],magpie-chat[256:768]" --out runs/cap-pen "${OPTS[@]}" \
    --sample-share 0.2 --sample-temperature 0.8 --threads "$THREADS"
fi
if has finetune; then
  say "finetune runs/ft-pen"
  treespec train-eagle --init "$BASE" --captured runs/cap-pen --out runs/ft-pen --epochs 1 \
    --lr 3e-4 --threads "$THREADS"
fi
if has tau; then
  for h in runs/ft-pen/head "$BASE"; do
    out=runs/tau-options-pen-${h//\//_}.json
    [ -e "$out" ] && { say "tau: $out exists"; continue; }
    say "tau $h"
    python benchmarks/micro/tau_options.py --head "$h" --num-prompts 10 --trees cpu --options none,both,repetition_penalty=1.1 \
      --drafts head,hybrid --modes all --threads "$THREADS" --out "$out"
  done
fi
say done
