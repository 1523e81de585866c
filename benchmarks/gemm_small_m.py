"""Why small-M fp32 matrix products are slow through eager PyTorch on some CPUs.

One SmolLM2 MLP weight (1536 x 576, fp32) times M rows, M = 1..32: PyTorch's eager
``F.linear`` (MKL ``sgemm`` for fp32 on x86) against oneDNN with the weight packed once
(``treespec.packing``), median of 300 calls each, interleaved, at 1 and 2 threads. Run it
with ``MKL_VERBOSE=1`` to see MKL's calls and ``MKL_ENABLE_INSTRUCTIONS=AVX512`` (or AVX2) to
test whether MKL's instruction-set choice is the cause.

    python benchmarks/gemm_small_m.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treespec.machine import machine_info  # noqa: E402


def median_us(fn, repeats=300) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    w = torch.randn(1536, 576).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    print(f"{machine_info()['cpu']}, torch {torch.__version__}, {args.dtype}, weight 1536 x 576, "
          f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', 'unset')}: microseconds per call")
    print(f"{'threads':>7} {'M':>3} {'eager F.linear':>15} {'oneDNN packed':>14} {'eager x M=1':>12} {'packed x M=1':>13}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        base = None
        for M in (1, 2, 4, 8, 16, 32):
            x = torch.randn(M, 576).to(dtype)
            eager = median_us(lambda: F.linear(x, w))
            onednn = median_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            base = base or (eager, onednn)
            print(f"{threads:>7} {M:>3} {eager:15.0f} {onednn:14.0f} {eager / base[0]:12.2f} {onednn / base[1]:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
