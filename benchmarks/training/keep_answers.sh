#!/usr/bin/env bash
# Keep the costly part of a capture in git: its manifest and answers files (a few kB per 64
# conversations; the shards, tens of MB each, are rebuilt from them in about a quarter of the
# time decoding took). Copies whole files only (answers files are written atomically).
#
#   bash benchmarks/training/keep_answers.sh runs/cap-all runs/cap-val     # -> benchmarks/data/captures/cap-all, ...
#
# Restore on a new machine, then resume with the capture's own command (docs/training.md):
#   mkdir -p runs/cap-all && cp benchmarks/data/captures/cap-all/* runs/cap-all/
set -euo pipefail
cd "$(dirname "$0")/../.."
for src in "$@"; do
  dst=benchmarks/data/captures/$(basename "$src")
  mkdir -p "$dst"
  cp "$src/capture.json" "$dst/"
  cp "$src"/answers-*.jsonl.gz "$dst/"
  echo "$dst: $(ls "$dst"/answers-*.jsonl.gz | wc -l) answers files, $(du -sh "$dst" | cut -f1)"
done
