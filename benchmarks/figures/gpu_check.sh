#!/usr/bin/env bash
# GPU check for a bare CUDA machine without a network, with at most 64 MiB of files brought
# along: it downloads nothing, installs only what a run brings (FlashInfer's cut, where carried),
# and ends within about 7.5 minutes, 9 with FlashInfer's build (each step has a time limit:
# 110 + 80 + 230 s, and 100 for FlashInfer, each plus at most 10 s to stop); with the end-to-end
# step (a GGUF carried) every limit shrinks so that the whole, FlashInfer included, stays within
# 8 minutes: 80 + 55 + 45 + 120 + 2 x 80 s. What it needs is the
# checkout itself (treespec/, tests/, benchmarks/) and a python with torch (CUDA), transformers,
# triton, pytest and hypothesis; FlashInfer is used when it imports, skipped otherwise.
#   1. the environment: GPU, torch, CUDA, transformers, triton, whether flex and FlashInfer run;
#   1b. FlashInfer, when its cut is carried (build/flashinfer/, made here by
#      benchmarks/figures/flashinfer_cut.py; `carry: ["build/flashinfer"]`): unpacked with its
#      apache-tvm-ffi wheel into /tmp/treespec-fi, the modules treespec's backend loads JIT-built
#      (MAX_JOBS, FLASHINFER_CUDA_ARCH_LIST=9.0a; FI_LIMIT seconds, 100) and loaded through its
#      own entry points (FI_RETURN=1: the built modules back as $OUT/flashinfer-aot.tar, for
#      build/flashinfer/aot/ next time); the later steps import it only when this succeeded;
#   2. the verify cost curve and a logits check on a model of Llama-3.1-8B's shape (hidden 4096,
#      32 layers, 32 heads, 8 KV heads, vocab 128256) with random weights built on the GPU in
#      bf16: one forward of a random tree of q = 1 .. 128 tokens after 1,536 cached tokens,
#      median ms per size for each backend (benchmarks/micro/verify_cost_gpu.py);
#   3. the drafter's step: one tree level of an EAGLE-3 head of Llama-3.1-8B's shape, eager
#      against a CUDA graph of the same level, k = 1, 4, 8; then treespec's own EagleSession
#      with that head drafting eagle2 trees eager, on static passes, and replayed from CUDA
#      graphs (cuda_graphs=True), whose trees must equal the static passes' (benchmarks/micro/draft_step_gpu.py);
#   4. the CUDA tests, the least run first: the EAGLE head's and the verify forward's CUDA graphs
#      (tests/gpu/test_cuda_graphs.py), then greedy equality with HF generate on the GPU through every
#      backend (tests/gpu/test_cuda.py) and flex (and FlashInfer) tree logits against the torch backend
#      (tests/model/test_backends.py), the split backend against it (tests/model/test_split_attention.py);
#      each test is named as it ends, so a step that runs out of time shows where;
#   5. when the target's GGUF is here (GGUF=the file, or GGUF_PARTS=a folder of its pieces, which
#      earlier runs carried: 98 MB is more than one run brings; joined here and checked against
#      benchmarks/figures/smollm2-gguf.sha256; WHEELS=a folder with the gguf package's wheel), the
#      shipped pair end to end (benchmarks/figures/gpu_e2e.sh): the default configuration with its
#      verify and head replayed from CUDA graphs (--cuda-graphs), beside plain HF generate and HF
#      generate compiled on a static cache, on E2E_N GSM8K questions and then E2E_N Spec-Bench
#      questions a category, 128 new tokens, E2E_LIMIT seconds each; without a GGUF it is skipped.
# Results, under $OUT if set, else benchmarks/results/gpu/: gpu_check.json (environment and
# each step's exit status and time), verify_cost.json and .txt, draft_step.json and .txt,
# cuda-tests.txt (with FlashInfer's cut: flashinfer_build.json, and flashinfer-aot.tar with FI_RETURN=1;
# with the GGUF: gpu-gsm8k$E2E_N-graphs-hfc.* and gpu-spec-bench$E2E_N-graphs-hfc.*, json, txt, log and
# jsonl: more than the 8 files a run brings back, so OUT_E2E=dir writes them elsewhere, and the .txt
# tables are what to fetch).
#
#   bash benchmarks/figures/gpu_check.sh             # on the GPU machine
#   bash benchmarks/figures/gpu_check.sh --dry-run   # anywhere, no GPU: checks that it assembles
#   LAYERS=16 PREFIX=1024 REPEATS=5 COST_LIMIT=200 DRAFT_LIMIT=90 TESTS_LIMIT=220 bash benchmarks/figures/gpu_check.sh
#   DEVICE=cpu SHAPE=tiny PREFIX=40 SIZES=1,5 REPEATS=1 DRAFT_REPEATS=2 bash benchmarks/figures/gpu_check.sh  # a rehearsal
#
# --dry-run checks that every Python file it runs imports (and parses its arguments), that the
# tests it names exist and are collected, and that the checkout's files (those git tracks plus
# the untracked ones it does not ignore) fit in the 64 MiB a GPU run may bring along; it
# prints that size and exits 0 when all hold. Exits non-zero when a step fails or runs out of time.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python3 || command -v python)}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-llama-3.1-8b}
LAYERS=${LAYERS:-}                # default: the shape's (32 for Llama-3.1-8B)
SIZES=${SIZES:-}                  # default: the script's, 1 .. 128
PREFIX=${PREFIX:-1536}
# With the end-to-end step (a GGUF given) the earlier steps get less, so that the whole, FlashInfer's
# build included, stays within 8 minutes (issue 47): 80 + 55 + 45 + 120 + 2 x 80 s.
e2e=${GGUF:-${GGUF_PARTS:-}}
REPEATS=${REPEATS:-$([ -n "$e2e" ] && echo 5 || echo 10)}
COST_LIMIT=${COST_LIMIT:-$([ -n "$e2e" ] && echo 55 || echo 110)}     # seconds for step 2 (72 s on an H200)
DRAFT_LIMIT=${DRAFT_LIMIT:-$([ -n "$e2e" ] && echo 45 || echo 80)}    # step 3 (21 s on an H200 before its session part)
TESTS_LIMIT=${TESTS_LIMIT:-$([ -n "$e2e" ] && echo 120 || echo 230)}  # step 4 (106 s on an H200 before the graph tests)
FI_LIMIT=${FI_LIMIT:-$([ -n "$e2e" ] && echo 80 || echo 100)}         # step 1b (not yet run on a GPU)
E2E_LIMIT=${E2E_LIMIT:-80}       # seconds for each half of step 5 (not yet run on a GPU)
E2E_N=${E2E_N:-3}
E2E_CONFIGS=${E2E_CONFIGS:-smollm2-135m-instruct-eagle+lookup@auto}
GGUF_SHA256=benchmarks/figures/smollm2-gguf.sha256
FI_CUT=build/flashinfer/flashinfer-cut.tar.gz
COST_SCRIPT=benchmarks/micro/verify_cost_gpu.py
DRAFT_SCRIPT=benchmarks/micro/draft_step_gpu.py
TESTS=(tests/gpu/test_cuda_graphs.py tests/gpu/test_cuda.py tests/model/test_backends.py tests/model/test_split_attention.py)
CARRY_LIMIT_MIB=${CARRY_LIMIT_MIB:-64}  # the most a GPU run may bring along

if [ "${1:-}" = "--dry-run" ]; then
  fail=0
  for script in "$COST_SCRIPT" "$DRAFT_SCRIPT"; do
    "$PY" "$script" --help >/dev/null && echo "ok: $script imports and parses its arguments" \
      || { echo "FAIL: $script does not import"; fail=1; }
  done
  for script in benchmarks/figures/gpu_e2e.sh benchmarks/figures/gpu_stage.sh; do
    bash -n "$script" && echo "ok: $script parses" || { echo "FAIL: $script does not parse"; fail=1; }
  done
  collected=$("$PY" -m pytest --collect-only -q -p no:cacheprovider -m cuda "${TESTS[@]}" 2>&1 | tail -1)
  if [[ "$collected" =~ ^([0-9]+)(/[0-9]+)?\ tests?\ collected ]] && [ "${BASH_REMATCH[1]}" -gt 0 ]; then
    echo "ok: ${TESTS[*]}: ${BASH_REMATCH[1]} CUDA tests collected"
  else
    echo "FAIL: collecting the CUDA tests of ${TESTS[*]}: $collected"; fail=1
  fi
  "$PY" - "$CARRY_LIMIT_MIB" <<'EOF' || fail=1
import os, subprocess, sys

def listed(*args):
    out = subprocess.run(["git", "ls-files", "-z", *args], capture_output=True, check=True).stdout
    return {p for p in out.decode().split("\0") if p}

# What counts against the 64 MiB: the checkout's tracked files, the untracked ones git does
# not ignore, and a shared/ folder inside the checkout.
paths = listed("--cached") | listed("--others", "--exclude-standard")
if os.path.isdir("shared"):
    paths |= {os.path.join(d, f) for d, _, fs in os.walk("shared") for f in fs}
size = {p: os.lstat(p).st_size for p in paths if os.path.lexists(p)}
mib = sum(size.values()) / 2**20
needed = sum(s for p, s in size.items() if p.startswith(("treespec/", "tests/", "benchmarks/micro/verify_cost_gpu.py",
                                                          "benchmarks/micro/draft_step_gpu.py",
                                                          "benchmarks/figures/gpu_check.sh", "benchmarks/timing.py")))
limit = float(sys.argv[1])
print(f"carried: {mib:.1f} MiB in {len(size)} files (the working tree as it is brought to the GPU machine; "
      f"limit {limit:.0f} MiB); of which the check needs {needed / 2**20:.1f} MiB "
      f"(treespec/, tests/, benchmarks/timing.py and the three scripts)")
if os.path.isdir("build/flashinfer"):  # FlashInfer's cut, carried beside the tree (carry: build/flashinfer)
    cut = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk("build/flashinfer") for f in fs) / 2**20
    mib += cut
    print(f"with FlashInfer's cut (build/flashinfer, {cut:.1f} MiB): {mib:.1f} MiB")
if mib > limit:
    print(f"FAIL: {mib:.1f} MiB is over the {limit:.0f} MiB that can be brought to the GPU machine")
    sys.exit(1)
EOF
  if [ -f "$FI_CUT" ]; then
    echo "ok: the FlashInfer cut is here: carry build/flashinfer"
  else
    echo "note: no FlashInfer cut (python benchmarks/figures/flashinfer_cut.py makes it): a run tests without it"
  fi
  [ "$fail" = 0 ] && echo "dry run: ok" || echo "dry run: FAILED"
  exit "$fail"
fi

OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
steps=()
run_step() {  # run_step NAME LIMIT COMMAND...: time-limited, exit status recorded
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  steps+=("$name $rc $(( $(date +%s) - start )) $limit")
  echo "== $name: exit $rc after $(( $(date +%s) - start )) s (limit $limit s)"
}

# 1b. FlashInfer from its carried cut, its modules built and loaded before anything imports it
# (modules of an earlier run, carried as build/flashinfer/aot/<name>/<name>.so, load without a
# build); the later steps see FlashInfer only when this step succeeded.
if [ -f "$FI_CUT" ] && [ "$DEVICE" = cuda ] \
    && "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  FI=/tmp/treespec-fi
  tvm=$(ls build/flashinfer/apache_tvm_ffi-*.whl 2>/dev/null | head -1)
  if mkdir -p "$FI/site" "$FI/ws" && tar xzf "$FI_CUT" -C "$FI/site" && [ -n "$tvm" ] \
      && "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$FI/site" "$tvm"; then
    [ -d build/flashinfer/aot ] && mkdir -p "$FI/site/flashinfer/data/aot" \
      && cp -r build/flashinfer/aot/. "$FI/site/flashinfer/data/aot/"
    fi_env=(PYTHONPATH="$PYTHONPATH:$FI/site" FLASHINFER_WORKSPACE_BASE="$FI/ws"
            FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}")
    # FI_RETURN=1: the modules built come back as one tar ($OUT's files are few): untar it into
    # build/flashinfer/aot/ for the next run
    run_step flashinfer "$FI_LIMIT" env "${fi_env[@]}" "$PY" benchmarks/figures/flashinfer_cut.py --jit-build \
      --json "$OUT/flashinfer_build.json" ${FI_RETURN:+--aot-tar "$OUT/flashinfer-aot.tar"}
    read -r _ fi_rc _ <<< "${steps[-1]}"
    [ "$fi_rc" = 0 ] && export "${fi_env[@]}" \
      || echo "FlashInfer's modules did not build and load: the later steps run without FlashInfer"
  else
    echo "FAIL: unpacking the FlashInfer cut ($FI_CUT, ${tvm:-no apache-tvm-ffi wheel}): the run goes on without it"
    steps+=("flashinfer 1 0 $FI_LIMIT")
  fi
fi

# 1. The environment; without a GPU nothing else runs.
"$PY" - "$OUT/gpu_check.json" "$DEVICE" <<'EOF' || { echo "gpu_check.sh needs a CUDA GPU (see above)"; exit 2; }
import json, sys, torch, transformers
from treespec.attention import flashinfer_available, flex_problem
env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
try:
    import triton
    env["triton"] = triton.__version__
except ImportError:
    env["triton"] = None
env["device"] = sys.argv[2]
env["flex"] = flex_problem(sys.argv[2]) or "runs"
env["flashinfer"] = flashinfer_available()
print(json.dumps(env))
json.dump({"environment": env}, open(sys.argv[1], "w"), indent=2)
sys.exit(0 if env["gpu"] or sys.argv[2] == "cpu" else 1)
EOF

# 2. The verify cost curve and the logits check on a model of real shape.
run_step verify_cost "$COST_LIMIT" bash -c "set -o pipefail; '$PY' $COST_SCRIPT --device $DEVICE --shape $SHAPE \
  ${LAYERS:+--layers $LAYERS} ${SIZES:+--sizes $SIZES} --prefix $PREFIX --repeats $REPEATS \
  --out '$OUT/verify_cost.json' 2>&1 | tee '$OUT/verify_cost.txt'"

# 3. The drafter's step, eager against a CUDA graph (on a CPU the eager half alone).
run_step draft_step "$DRAFT_LIMIT" bash -c "set -o pipefail; '$PY' $DRAFT_SCRIPT --device $DEVICE --shape $SHAPE \
  --prefix $PREFIX ${DRAFT_REPEATS:+--repeats $DRAFT_REPEATS} --out '$OUT/draft_step.json' 2>&1 | tee '$OUT/draft_step.txt'"

# 4. The CUDA tests (a skip says what is missing: -rs lists why).
run_step cuda_tests "$TESTS_LIMIT" bash -c "set -o pipefail; '$PY' -m pytest -v -rs --durations=15 -p no:cacheprovider -m cuda \
  ${TESTS[*]} 2>&1 | tee '$OUT/cuda-tests.txt'"

# 5. The shipped pair end to end, when its GGUF is here.
if [ -z "${GGUF:-}" ] && [ -n "${GGUF_PARTS:-}" ]; then
  joined=/tmp/treespec-gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  # the pieces in name order wherever they lie under GGUF_PARTS (gpu_stage.sh puts each in a folder)
  mkdir -p /tmp/treespec-gguf && find "$GGUF_PARTS" -name '*.part-*' -printf '%f %p\n' | sort | cut -d' ' -f2- \
    | xargs cat > "$joined"
  if [ "$(sha256sum < "$joined" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$GGUF_SHA256")" ]; then
    GGUF=$joined
  else
    echo "FAIL: the GGUF's pieces in $GGUF_PARTS do not join into the file of $GGUF_SHA256 (a piece missing?)"
    steps+=("e2e 1 0 $E2E_LIMIT")
  fi
fi
if [ -n "${GGUF:-}" ]; then
  for dataset in gsm8k spec-bench; do
    run_step "e2e_$dataset" "$E2E_LIMIT" env GGUF="$GGUF" OUT="${OUT_E2E:-$OUT}" N="$E2E_N" DATASET="$dataset" MAX_NEW=128 \
      GRAPHS=1 HF_COMPILE=1 CONFIGS="$E2E_CONFIGS" LIMIT=$((E2E_LIMIT - 5)) bash benchmarks/figures/gpu_e2e.sh
  done
else
  echo "== e2e: skipped (no GGUF=... or GGUF_PARTS=...: the shipped pair's target cannot be brought in one run)"
fi

"$PY" - "$OUT/gpu_check.json" "${steps[@]}" <<'EOF'
import json, sys
path, steps = sys.argv[1], [s.split() for s in sys.argv[2:]]
result = json.load(open(path))
result["steps"] = [{"name": n, "exit": int(rc), "seconds": int(s), "limit": int(lim), "timed_out": rc in ("124", "137")}
                   for n, rc, s, lim in steps]
json.dump(result, open(path, "w"), indent=2)
print("gpu_check:", ", ".join(f"{s['name']} {'ok' if s['exit'] == 0 else 'FAILED'}" for s in result["steps"]))
sys.exit(0 if all(s["exit"] == 0 for s in result["steps"]) else 1)
EOF
