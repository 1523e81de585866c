#!/usr/bin/env bash
# Issue 26: self-generated user turns, then the target's answers to them, in steps that resume
# and span sessions (runs/ outside the work tree, as head_all.sh says).
#
#   STEPS="turns capture" N=8192 THREADS=1 bash benchmarks/training/magpie_all.sh 2>&1 | tee -a runs/magpie_all.log
#
#   turns    sample N raw first turns from the target (python -m treespec.train.magpie: chunks of 64
#            in runs/magpie, each from its own seed, skipped when present), filter them, and write
#            treespec/data/magpie_chat.jsonl.gz (filtering keeps order, so a larger N only appends)
#   capture  the target's answers: magpie-chat[:256] held out (runs/cap-magpie-val, greedy), the
#            rest (runs/cap-magpie, a fifth sampled at T=0.8), resumable shards of 64
#   keep     copy the answers files to benchmarks/data/captures (then commit them)
# Feeds no docs table yet: the data of issue 26 (treespec/data/magpie_chat.jsonl.gz, captures).
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-"turns capture"}
N=${N:-8192}
THREADS=${THREADS:-2}
has() { [[ " $STEPS " == *" $1 "* ]]; }
say() { echo "== $* ($(date -u +%H:%M:%S))"; }
if has turns; then
  say "turns: $N raw"
  python -m treespec.train.magpie --n "$N" --work runs/magpie --out treespec/data --threads "$THREADS"
fi
if has capture; then
  say capture runs/cap-magpie-val
  treespec capture --data "magpie-chat[:256]" --out runs/cap-magpie-val --threads "$THREADS"
  say capture runs/cap-magpie
  treespec capture --data "magpie-chat[256:]" --out runs/cap-magpie --sample-share 0.2 --sample-temperature 0.8 \
    --threads "$THREADS"
fi
if has keep; then say keep; bash benchmarks/training/keep_answers.sh runs/cap-magpie-val runs/cap-magpie; fi
