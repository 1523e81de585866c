#!/usr/bin/env bash
# Stage what gpu_check.sh's end-to-end step needs on a GPU machine that fetches nothing and takes at
# most 64 MiB of files a run, the checkout included: the target's GGUF (98 MB) cut into pieces, each
# in a folder of its own under build/gpu/ (ignored by git), with the gguf package's wheel beside the
# first. Each device run carries one folder (carry: ["build/gpu/pN"]); a carried folder stays on the
# warm machine for the next run, so the last run has them all:
#   run 1..K-1: carry build/gpu/pN, command: true        (each within the 30 s the machine stays warm)
#   run K:      carry build/gpu/pK (and build/flashinfer), command:
#               GGUF_PARTS=build/gpu WHEELS=build/gpu/p1 bash benchmarks/figures/gpu_check.sh
#   GGUF=~/.cache/treespec/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
#     [PIECE_MIB=16] bash benchmarks/figures/gpu_stage.sh
# PIECE_MIB: a piece's size, the 64 MiB less the checkout (gpu_check.sh --dry-run prints it) and
# FlashInfer's cut where carried. Prints the folders and their sizes.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
gguf=${GGUF:-$HOME/.cache/treespec/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$gguf" ] || { echo "no GGUF at $gguf (treespec downloads it on a first run: GGUF=path)"; exit 1; }
want=$(cut -d' ' -f1 benchmarks/figures/smollm2-gguf.sha256)
[ "$(sha256sum < "$gguf" | cut -d' ' -f1)" = "$want" ] || { echo "$gguf is not the file of smollm2-gguf.sha256"; exit 1; }
rm -rf build/gpu && mkdir -p build/gpu/tmp
split -b "${PIECE_MIB:-16}M" -a 2 "$gguf" build/gpu/tmp/SmolLM2-135M-Instruct.Q4_1.gguf.part-
i=0
for piece in build/gpu/tmp/*.part-*; do
  i=$((i + 1))
  mkdir -p "build/gpu/p$i" && mv "$piece" "build/gpu/p$i/"
done
rmdir build/gpu/tmp
"$PY" -m pip download -q --no-deps --only-binary=:all: -d build/gpu/p1 "gguf==$("$PY" -c \
  'import importlib.metadata as m; print(m.version("gguf"))')"
du -sh build/gpu/p*
echo "$i pieces: carry build/gpu/p1 .. build/gpu/p$i one a run; the last run: GGUF_PARTS=build/gpu WHEELS=build/gpu/p1"
