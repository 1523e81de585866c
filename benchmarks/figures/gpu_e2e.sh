#!/usr/bin/env bash
# treespec end to end on a GPU machine without a network: SmolLM2-135M-Instruct with the
# shipped EAGLE-3 head, `treespec bench` on the first N GSM8K test questions (DATASET=spec-bench:
# N Spec-Bench questions a category), MAX_NEW new tokens (256), bf16, greedy, side by side with HF
# generate on the same GPU (greedy outputs compared too).
# Nothing can be downloaded there, so the model's Q4_1 GGUF (98 MB, the file every first run
# converts) is brought along, and the `gguf` package as a wheel (WHEELS=dir) where it is
# missing. A run brings at most 64 MiB of files, so the GGUF comes in pieces, joined with cat
# before this script runs; GGUF=... names the joined file.
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf [WHEELS=dir] [N=5] [DATASET=gsm8k] [MAX_NEW=256] [LIMIT=420] \
#     [GRAPHS=1] [COMPILE=1] [HF_COMPILE=1] [CONFIGS="a b"] bash benchmarks/figures/gpu_e2e.sh
# Writes gpu-$DATASET$N.{json,txt,log,jsonl} (CONFIGS, by default the hybrid's chain-3, the hybrid
# with auto, which first measures this GPU's verify costs, and the head alone's chain-3) under
# $OUT, else benchmarks/results/gpu/, within LIMIT seconds (420). GRAPHS=1 runs the same with the
# target's verify forward on fixed shapes and the head's passes replayed from CUDA graphs
# (--cuda-graphs), files gpu-$DATASET$N-graphs.*, its own HF baseline beside it. The first run (2026-12-04, files gpu-gsm8k5-{fixed,auto}.*) ran the
# fixed trees and auto as two benches, two baselines.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-benchmarks/results/gpu}
N=${N:-5}
DATASET=${DATASET:-gsm8k}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/treespec-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="/tmp/treespec-site${PYTHONPATH:+:$PYTHONPATH}"  # after step 1b's FlashInfer, if any
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TREESPEC_CACHE=${TREESPEC_CACHE:-/tmp/treespec-cache}
dir=$TREESPEC_CACHE/models/smollm2-135m-instruct
mkdir -p "$dir"
[ -f "$dir/SmolLM2-135M-Instruct.Q4_1.gguf" ] || cp "${GGUF:?GGUF=path to SmolLM2-135M-Instruct.Q4_1.gguf}" "$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
bench=("$PY" -m treespec.cli bench --device "${DEVICE:-cuda}" --dtype bfloat16 --dataset "$DATASET" --num-prompts "$N"
       --max-new-tokens "${MAX_NEW:-256}" --no-hf-lookup --no-treespec-ar)
name=gpu-$DATASET$N
if [ "${GRAPHS:-0}" = 1 ]; then
  bench+=(--cuda-graphs)
  name=$name-graphs
fi
# DEVICE=cpu rehearses the plumbing on a CPU (GRAPHS=1 needs CUDA).
# COMPILE=1: treespec's configurations also compiled (`--compile`: the verify on fixed shapes with greedy
# acceptance inside it, one read back between the forward and the commit, and the head's passes compiled). Not yet
# run on a GPU.
if [ "${COMPILE:-0}" = 1 ]; then
  bench+=(--compile)
  name=$name-compiled
fi
# HF_COMPILE=1: HF generate with a static cache and torch.compile beside plain HF generate (issue 47's
# second baseline; its warm-up compiles, and the report says for how long). Not yet run on a GPU.
if [ "${HF_COMPILE:-0}" = 1 ]; then
  bench+=(--hf-compile)
  name=$name-hfc
fi
# One bench, so that every configuration shares one HF baseline; its journal keeps each
# finished prompt if the time limit stops it.
configs=()
for c in ${CONFIGS:-smollm2-135m-instruct-eagle+lookup@chain-3 smollm2-135m-instruct-eagle+lookup@auto \
                   smollm2-135m-instruct-eagle@chain-3}; do
  configs+=(--config "$c")
done
timeout --kill-after=10 "${LIMIT:-420}" "${bench[@]}" "${configs[@]}" \
  --journal "$OUT/$name.jsonl" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
exit "${PIPESTATUS[0]}"
