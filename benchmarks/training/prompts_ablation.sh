#!/usr/bin/env bash
# Issue 26, item 4's ablation rows at reduced scale: which training prompts make a head accept
# more where users ask. Heads trained from scratch (no --init), one epoch, the same trainer
# settings (EAGLE-3, draft vocabulary 4096 from each row's own data, 3 training-time-test steps),
# on the target's own answers (a fifth sampled at T=0.8) to:
#
#   templ-2672    2,672 templated chat prompts (chat-train[:2672], the generator the old plan used)
#   self-2672     2,672 self-generated first turns (magpie-chat[256:2928], runs/cap-magpie)
#   self-1336     the first 1,336 of them                                   (amount)
#   self-3952     those and the first 1,280 of runs/cap-magpie-more         (amount)
#   self-7000     those and the first 4,328 of runs/cap-magpie-more         (amount)
#   self-14179    all 14,179 self-generated first turns (magpie-chat[256:]) (amount)
#   self-2672+2nd self-2672 and 1,984 second turns (runs/cap-magpie2)      (second turns)
#
# Each row: held-out top-1 by step on 64 greedy conversations of self-generated first turns,
# second turns and the old plan (validate_head.py), and mean accepted tokens per Spec-Bench
# category, the head alone on the `cpu` tree, ten questions a category (MT-bench both turns),
# 128 new tokens, greedy, bf16 (spec_tau.py). tau is a count, not a timing: this runs beside
# other work, but on two cores it slows timing runs and is slowed by them.
#
#   STEPS="restore rebuild train eval" bash benchmarks/training/prompts_ablation.sh 2>&1 | tee -a runs/prompts_ablation.log
#
#   restore  the kept answers (benchmarks/data/captures) into runs/
#   rebuild  every training and held-out folder's shards from those answers (no decoding: the
#            templated chat comes out of the mixed capture runs/cap-all with --answers-from)
#   train    one head per row in runs/ablate-prompts/ROW (resumes)
#   eval     benchmarks/results/ablate-prompts-validate-ROW.txt and ablate-prompts-spec-tau-ROW.json
#            (a file already there is not made again)
#
# Every step resumes, so the run can span sessions. Feeds docs/training.md, "Which prompts:
# templated against self-generated, and how many".
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-"restore rebuild train eval"}
THREADS=${THREADS:-2}
ROWS=${ROWS:-"templ-2672 self-2672 self-1336 self-3952 self-2672+2nd"}
A=runs/ablate-prompts
R=benchmarks/results
has() { [[ " $STEPS " == *" $1 "* ]]; }
say() { echo "== $* ($(date -u +%H:%M:%S))"; }
FIFTH=(--sample-share 0.2 --sample-temperature 0.8)

if has restore; then
  say restore
  for c in cap-all cap-val cap-magpie-val cap-magpie cap-magpie-more cap-magpie2-val cap-magpie2; do
    mkdir -p runs/$c && cp -n benchmarks/data/captures/$c/* runs/$c/
  done
fi
if has rebuild; then
  say "rebuild: held-out folders (their first 64 conversations)"
  treespec capture --data "magpie-chat[:256]" --out runs/cap-magpie-val --max-examples 64 --threads "$THREADS"
  treespec capture --data "treespec/data/magpie_chat2.jsonl.gz[:233]" --out runs/cap-magpie2-val --max-length 768 \
    --max-examples 64 --threads "$THREADS"
  treespec capture --data "gsm8k-train[7400:],stdlib-code[3100:],chat-train[3750:]" --out runs/cap-val \
    --max-examples 64 --threads "$THREADS"
  say "rebuild: templated chat, from runs/cap-all's answers"
  mkdir -p runs/cap-chat
  treespec capture --data "chat-train[:2672]" --out runs/cap-chat "${FIFTH[@]}" --answers-from runs/cap-all \
    --threads "$THREADS"
  say "rebuild: self-generated first turns"
  treespec capture --data "magpie-chat[256:2928]" --out runs/cap-magpie "${FIFTH[@]}" --threads "$THREADS"
  more=1280  # as many of runs/cap-magpie-more as the rows ask for (42 s a shard here)
  for row in $ROWS; do
    if [ "$row" = self-14179 ]; then more=11507; elif [ "$row" = self-7000 ] && [ "$more" -lt 4328 ]; then more=4328; fi
  done
  treespec capture --data "magpie-chat[2928:]" --out runs/cap-magpie-more "${FIFTH[@]}" --max-examples "$more" \
    --threads "$THREADS"
  say "rebuild: second turns"
  treespec capture --data "treespec/data/magpie_chat2.jsonl.gz[233:]" --out runs/cap-magpie2 --max-length 768 \
    "${FIFTH[@]}" --max-examples 1984 --threads "$THREADS"
fi
data() {  # a row's training folders and --max-examples
  case $1 in
    templ-2672) echo "runs/cap-chat" ;;
    self-2672) echo "runs/cap-magpie" ;;
    self-1336) echo "runs/cap-magpie --max-examples 1336" ;;
    self-3952) echo "runs/cap-magpie,runs/cap-magpie-more --max-examples 3952" ;;
    self-7000) echo "runs/cap-magpie,runs/cap-magpie-more --max-examples 7000" ;;
    self-14179) echo "runs/cap-magpie,runs/cap-magpie-more" ;;
    self-2672+2nd) echo "runs/cap-magpie,runs/cap-magpie2" ;;
    *) echo "unknown row $1" >&2; exit 2 ;;
  esac
}
if has train; then
  for row in $ROWS; do
    say "train $row"
    # shellcheck disable=SC2046
    treespec train-eagle --captured $(data "$row") --val-captured runs/cap-magpie-val --out "$A/$row" \
      --epochs 1 --max-length 768 --threads "$THREADS"
  done
fi
if has eval; then
  for row in $ROWS; do
    out="$R/ablate-prompts-validate-$row.txt"
    if [ ! -e "$out" ]; then
      say "eval: held-out top-1, $row"
      for v in runs/cap-magpie-val runs/cap-magpie2-val runs/cap-val; do
        python benchmarks/training/validate_head.py --head "$A/$row/head" --val-capture "$v" --val-examples 64
      done > "$out.tmp" && mv "$out.tmp" "$out"
      cat "$out"
    fi
    out="$R/ablate-prompts-spec-tau-$row.json"
    [ -e "$out" ] && { echo "$out: there"; continue; }
    say "eval: Spec-Bench tau, $row"
    python benchmarks/training/spec_tau.py --head "$A/$row/head" --tree cpu --no-lookup --num-prompts 10 \
      --max-new-tokens 128 --threads "$THREADS" --out "$out"
  done
fi
