#!/usr/bin/env bash
# The head on the whole capture plan (issue 10), in steps that resume and span sessions
# (a new checkout has no runs/: the answers kept in benchmarks/data/captures bring the capture back).
#
#   mkdir -p runs && STEPS="restore capture keep" bash benchmarks/training/head_all.sh 2>&1 | tee -a runs/head_all.log
#
#   restore   into runs/cap-val and runs/cap-all, the answers kept in benchmarks/data/captures that
#             they lack (and capture.json where missing): those shards are then rebuilt, not decoded
#   capture   the held-out and the main capture: shards with answers files are rebuilt from
#             them, the rest decoded (run again to resume; keep commits what it added)
#   keep      copy the answers files back to benchmarks/data/captures (then commit them)
#   ablate    the "data: all" row of the ablation table (one epoch, reduced protocol), in
#             runs/ablate-all (a row name the earlier runs/ablate already holds), appended to
#             benchmarks/results/ablate-head.jsonl
#   train     two epochs on the whole capture -> runs/head-all/head, the head shipped now
#   validate  HEAD's held-out top-1 beside the shipped head's -> benchmarks/results/validate-head-all.txt
#             (HEAD: runs/ablate-all/data-all/head, the ablate step's head, one epoch over every
#             conversation: as many optimiser steps as the two over 7,744 of the head shipped
#             before; the shipped head's own check, run before its copy: validate-head4.txt)
#
# Every answer of the plan is kept, so "capture" now only rebuilds; with the ablate row, its tau
# and the training, that is more than one session on some machines (wall times by machine:
# docs/training.md, "Throughput and wall time of the full capture" and "The shipped head"): let
# runs/ outlive the work tree, which a new session gets laid anew while the machine may be handed on,
#   mkdir -p /root/treespec-runs && ln -sfn /root/treespec-runs runs && echo /runs >> .git/info/exclude
# and every step resumes there: shards are skipped once written, training continues from its
# checkpoint.pt (every 200 steps), ablate_head.py skips the rows it has.
# Feeds docs/training.md: "Throughput and wall time of the full capture", "Ablations (issue 10)",
# "The shipped head".
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-"restore capture keep"}
has() { [[ " $STEPS " == *" $1 "* ]]; }
say() { echo "== $* ($(date -u +%H:%M:%S))"; }
VAL=(--data "gsm8k-train[7400:],stdlib-code[3100:],chat-train[3750:]" --out runs/cap-val --threads 2)
ALL=(--data "gsm8k-train[:7400],stdlib-code[:3100],chat-train[:3750]" --out runs/cap-all
     --sample-share 0.2 --sample-temperature 0.8 --threads 2)
if has restore; then
  for c in cap-val cap-all; do
    say "restore runs/$c from benchmarks/data/captures/$c (what it lacks)"
    mkdir -p runs/$c
    cp -n benchmarks/data/captures/$c/capture.json benchmarks/data/captures/$c/answers-*.jsonl.gz runs/$c/
  done
fi
if has capture; then
  say capture runs/cap-val; treespec capture "${VAL[@]}"
  say capture runs/cap-all; treespec capture "${ALL[@]}"
fi
if has keep; then say keep; bash benchmarks/training/keep_answers.sh runs/cap-val runs/cap-all; fi
if has ablate; then
  say ablate data-all
  python benchmarks/training/ablate_head.py --capture runs/cap-all --val-capture runs/cap-val --out runs/ablate-all \
    --sizes all --epochs 1 --threads 2 --eval gsm8k:20,humaneval:12 --max-new-tokens 128 --only data-all
  grep -qxFf runs/ablate-all/results.jsonl benchmarks/results/ablate-head.jsonl ||
    cat runs/ablate-all/results.jsonl >> benchmarks/results/ablate-head.jsonl
fi
if has train; then
  say train runs/head-all
  treespec train-eagle --captured runs/cap-all --val-captured runs/cap-val --out runs/head-all --epochs 2 --threads 2
fi
if has validate; then
  say validate
  python benchmarks/training/validate_head.py --head "${HEAD:-runs/ablate-all/data-all/head}" --head smollm2-135m-instruct-eagle \
    --val-capture runs/cap-val --val-examples 64 | tee benchmarks/results/validate-head-all.txt
fi
say done
