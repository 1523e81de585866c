"""What compiling the verify forward costs in memory: the process's resident set before and
after each bucket compiles (SmolLM2-135M by default, features captured as an EAGLE head needs
them): treespec's way, on oneDNN-packed weights that the graphs take as inputs; or, with
``--freezing``, the way tried first: plain weights, which inductor's freezing makes constants
of each graph and packs there.

    python benchmarks/micro/compile_memory.py [--freezing] [--dtype bfloat16] [--threads 1] [--buckets 1 4 8]

Feeds docs/runtime.md, "Fixed-shape verify" (packed weights, shared).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's treespec

import torch  # noqa: E402

from treespec.fixed_shape import FixedShapeVerify, fixed_row_tokens  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears  # noqa: E402
from treespec.runner import ModelRunner  # noqa: E402


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2 ** 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--freezing", action="store_true", help="inductor's freezing on (weights as constants)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.freezing:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
    model, _ = load(args.model, dtype=getattr(torch, args.dtype))
    runner = ModelRunner(model, "torch", feature_layers=[2, 15, 27])
    packed = contextlib.nullcontext() if args.freezing else PackedLinears(model)
    with packed, runner.attached():
        cache, seqs = runner.new_rows_cache(1, fixed_row_tokens(200, max(args.buckets), "compile"), 16)
        verify = FixedShapeVerify(runner, cache, seqs, compile=True)
        print(f"{'freezing' if args.freezing else 'weights as inputs'}: RSS {rss_mb():.0f} MB before compiling")
        for top in args.buckets:
            t = time.perf_counter()
            verify.precompile(top, capture=True)
            print(f"after the buckets up to {top}: RSS {rss_mb():.0f} MB ({time.perf_counter() - t:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
