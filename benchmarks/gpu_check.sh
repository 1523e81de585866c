#!/usr/bin/env bash
# The GPU check at the path issue 29 names; the script itself, its options and what it writes
# are in benchmarks/figures/gpu_check.sh (with the other scripts that feed docs figures).
#   bash benchmarks/gpu_check.sh --dry-run   # anywhere, no GPU: checks that it assembles and fits
exec bash "$(dirname "$0")/figures/gpu_check.sh" "$@"
