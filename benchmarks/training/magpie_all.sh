#!/usr/bin/env bash
# Issue 26: self-generated user turns, then the target's answers to them, in steps that resume
# and span sessions (runs/ outside the work tree, as head_all.sh says).
#
#   STEPS="turns capture" N=8192 THREADS=1 bash benchmarks/training/magpie_all.sh 2>&1 | tee -a runs/magpie_all.log
#
#   restore  the raw chunks kept in benchmarks/data/magpie that runs/magpie lacks, and the capture
#            folders' answers kept in benchmarks/data/captures (their shards are then rebuilt)
#   turns    sample N raw first turns from the target (treespec make-prompts: chunks of 64
#            in runs/magpie, each from its own seed, skipped when present), filter them, and write
#            treespec/data/magpie_chat.jsonl.gz (filtering keeps order, so a larger N only appends)
#   capture  the target's answers: magpie-chat[:256] held out (runs/cap-magpie-val, greedy), the
#            rest (a fifth sampled at T=0.8) in resumable shards of 64: [256:2928], the first 52 chunks' turns, in
#            runs/cap-magpie (captured whole), and the turns sampled after them in runs/cap-magpie-more
#   follow   second turns: a follow-up the target writes to each answer of the FOLLOW captures (default
#            cap-magpie-val, then cap-magpie; add ,benchmarks/data/captures/cap-magpie-more once it is kept whole:
#            its chunks then append) (treespec make-prompts --follow-ups: chunks of 64 in runs/magpie2),
#            filtered, written to treespec/data/magpie_chat2.jsonl.gz; the rows that follow held-out conversations
#            come first
#   capture2 the target's answers to the second turns (treespec/data/magpie_chat2.jsonl.gz, packaged as
#            magpie-chat2; VAL2=233 for the shipped set): the first VAL2 rows held out (runs/cap-magpie2-val,
#            greedy; VAL2 is what `follow` printed for cap-magpie-val's rows), the rest runs/cap-magpie2
#            (MAX2=N: the first N training rows only; a later run with a larger MAX2 or none resumes)
#   rebuild  the old plan's folders the fine-tune needs, from their kept answers: its first 2,688 conversations
#            (runs/cap-all-2688: so that the head keeps what it knew; a folder of its own, as a fine-tune takes
#            whatever a folder holds) and runs/cap-val's first 64 (its held-out check)
#   finetune HEAD (default: the shipped head), EPOCHS epochs (default 2) at a third of its learning rate, on
#            TRAIN (default runs/cap-magpie, runs/cap-magpie2 (what capture2 has done) and runs/cap-all-2688; the
#            whole mixture of issue 26 adds runs/cap-magpie-more), validated on
#            runs/cap-magpie-val: FT/head (default runs/ft-magpie3; resumes), then validate_head.py on the held-out
#            first turns, second turns and old plan. The head shipped now (docs/training.md) is
#            HEAD=runs/head-old4 EPOCHS=2 FT=runs/ft-magpie3, its second-result run EPOCHS=1 FT=runs/ft-magpie2 MAX2=1024
#   keep     copy the raw chunks (gzip -n: same chunk, same bytes) to benchmarks/data/magpie{,2} and the
#            answers files to benchmarks/data/captures (then commit them): a chunk sampled on another
#            machine or dtype differs, so the chunks themselves are what makes a larger N append
# Feeds no docs table yet: the data of issue 26 (treespec/data/magpie_chat.jsonl.gz, captures).
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-"turns capture"}
N=${N:-8192}
HEAD=${HEAD:-smollm2-135m-instruct-eagle}
EPOCHS=${EPOCHS:-2}
FT=${FT:-runs/ft-magpie3}
FOLLOW=${FOLLOW:-benchmarks/data/captures/cap-magpie-val,benchmarks/data/captures/cap-magpie}
TRAIN=${TRAIN:-runs/cap-magpie,runs/cap-magpie2,runs/cap-all-2688}
THREADS=${THREADS:-2}
has() { [[ " $STEPS " == *" $1 "* ]]; }
say() { echo "== $* ($(date -u +%H:%M:%S))"; }
if has restore; then
  say restore
  mkdir -p runs/magpie
  for d in magpie magpie2; do
    mkdir -p runs/$d
    for f in benchmarks/data/$d/chunk-*.jsonl.gz; do
      [ -e "$f" ] || continue
      out=runs/$d/$(basename "$f" .gz)
      [ -e "$out" ] || gunzip -c "$f" > "$out"
    done
  done
  for c in cap-magpie-val cap-magpie cap-magpie-more cap-magpie2-val cap-magpie2; do
    [ -d benchmarks/data/captures/$c ] || continue
    mkdir -p runs/$c && cp -n benchmarks/data/captures/$c/* runs/$c/
  done
fi
if has turns; then
  say "turns: $N raw"
  treespec make-prompts --n "$N" --work runs/magpie --out treespec/data --threads "$THREADS"
fi
if has capture; then
  say capture runs/cap-magpie-val
  treespec capture --data "magpie-chat[:256]" --out runs/cap-magpie-val --threads "$THREADS"
  say capture runs/cap-magpie
  treespec capture --data "magpie-chat[256:2928]" --out runs/cap-magpie --sample-share 0.2 --sample-temperature 0.8 \
    --threads "$THREADS"
  say capture runs/cap-magpie-more
  treespec capture --data "magpie-chat[2928:]" --out runs/cap-magpie-more --sample-share 0.2 --sample-temperature 0.8 \
    --threads "$THREADS"
fi
if has follow; then
  say "follow: second turns"
  treespec make-prompts --follow-ups "$FOLLOW" \
    --work runs/magpie2 --out treespec/data --threads "$THREADS"
  python -c "import treespec.data as d; print(sum(int(r['source'].split(':')[1]) < 256 for r in d.read_jsonl('treespec/data/magpie_chat2.jsonl.gz')), 'rows follow held-out conversations')"
fi
if has capture2; then
  : "${VAL2:?set VAL2 to the number of magpie-chat2 rows that follow held-out conversations (follow prints it)}"
  say capture2 runs/cap-magpie2-val
  treespec capture --data "treespec/data/magpie_chat2.jsonl.gz[:$VAL2]" --out runs/cap-magpie2-val --max-length 768 --threads "$THREADS"
  say capture2 runs/cap-magpie2
  treespec capture --data "treespec/data/magpie_chat2.jsonl.gz[$VAL2:]" --out runs/cap-magpie2 --max-length 768 --sample-share 0.2 --sample-temperature 0.8 \
    ${MAX2:+--max-examples "$MAX2"} --threads "$THREADS"
fi
if has rebuild; then
  say "rebuild: runs/cap-all-2688, runs/cap-val[:64]"
  mkdir -p runs/cap-all-2688 runs/cap-val
  cp -n benchmarks/data/captures/cap-all/* runs/cap-all-2688/  # answers of all; shards for the first 2,688
  cp -n benchmarks/data/captures/cap-val/* runs/cap-val/
  treespec capture --data "gsm8k-train[:7400],stdlib-code[:3100],chat-train[:3750]" --out runs/cap-all-2688 \
    --sample-share 0.2 --sample-temperature 0.8 --max-examples 2688 --threads "$THREADS"
  treespec capture --data "gsm8k-train[7400:],stdlib-code[3100:],chat-train[3750:]" --out runs/cap-val \
    --max-examples 64 --threads "$THREADS"
fi
if has finetune; then
  say "finetune: train $FT from $HEAD"
  treespec train-eagle --init "$HEAD" --captured "$TRAIN" \
    --val-captured runs/cap-magpie-val --out "$FT" --epochs "$EPOCHS" --lr 3e-4 --max-length 768 --threads "$THREADS"
  say "finetune: validate ($HEAD, then the fine-tuned one)"
  for v in runs/cap-magpie-val runs/cap-magpie2-val runs/cap-val; do
    echo "on $v:"
    python benchmarks/training/validate_head.py --head "$HEAD" --head "$FT/head" \
      --val-capture "$v" --val-examples 64
  done
fi
if has keep; then
  say keep
  for d in magpie magpie2; do
    mkdir -p benchmarks/data/$d
    for f in runs/$d/chunk-*.jsonl; do [ -e "$f" ] && gzip -n -c "$f" > "benchmarks/data/$d/$(basename "$f").gz"; done
  done
  for c in cap-magpie-val cap-magpie cap-magpie-more cap-magpie2-val cap-magpie2; do
    [ -e runs/$c/capture.json ] && bash benchmarks/training/keep_answers.sh runs/$c
  done
fi
