"""What a verify forward costs on fixed shapes: today's forward, the fixed-shape one eager, and
the fixed-shape one compiled, at q tree tokens after a prefix of cached tokens.

One target (SmolLM2-135M by default), one cache row holding ``--cached`` tokens; for each q a
chain of q tree tokens (the root and q - 1 drafted nodes) is verified, without committing, by
``ModelRunner.forward`` (each step's own shapes), ``FixedShapeVerify`` eager (the tree padded
to its bucket, attention over the row's whole length) and ``FixedShapeVerify`` through
``torch.compile(dynamic=False)`` (inductor; the first call of each bucket compiles, timed on its
own). Each figure is the median of ``--repeats`` calls after a warm-up; the largest logits
difference of each fixed-shape row against today's forward is printed beside it.

    python benchmarks/micro/fixed_shape_cost.py [--dtype bfloat16] [--threads 2] [--sizes 1 4 8 16 32]
        [--cached 128] [--repeats 15] [--no-compile] [--weights gguf] [--pack] [--out results.json]

Feeds docs/runtime.md, "Fixed-shape verify" (the figures are the lead's, from a quiet machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402

from benchmarks.timing import Timer, command, machine_line, median_ms  # noqa: E402
from treespec import Tree  # noqa: E402
from treespec.fixed_shape import FixedShapeVerify, bucket_for, fixed_row_tokens  # noqa: E402
from treespec.machine import machine_info  # noqa: E402
from treespec.mask import causal_mask  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.runner import ModelRunner  # noqa: E402


def prefilled(runner: ModelRunner, cached: int, largest: int, mode):
    """A one-row cache holding ``cached`` random tokens, room for a tree of ``largest`` tokens
    on fixed shapes; returns the cache and its sequence."""
    cache, (seq,) = runner.new_rows_cache(1, fixed_row_tokens(cached, largest, mode))
    prompt = torch.randint(min(100, runner.vocab_size // 2), min(10000, runner.vocab_size), (cached,),
                           generator=torch.Generator().manual_seed(0))
    runner.forward(cache, [seq], [prompt], [torch.arange(cached)], [causal_mask(cached)], logits_rows=[[cached - 1]])
    cache.commit(seq, torch.arange(cached))
    return cache, seq


def chain(q: int, vocab: int) -> Tree:
    return Tree.chain(q - 1, torch.randint(0, min(10000, vocab), (q,), generator=torch.Generator().manual_seed(q)))


def rows(runner: ModelRunner, args) -> tuple[dict, dict, dict]:
    """ms per forward of each way and q, the largest logits difference against today's, and
    the seconds each bucket took to compile."""
    ms, diff, compile_s = {}, {}, {}
    largest = max(args.sizes)
    cache, seq = prefilled(runner, args.cached, largest, "compile")
    ways = {"fixed-shape eager": FixedShapeVerify(runner, cache, [seq])}
    if not args.no_compile:
        ways["fixed-shape compiled"] = FixedShapeVerify(runner, cache, [seq], compile=True)
    L = args.cached
    for q in args.sizes:
        tree = chain(q, runner.vocab_size)

        def today():
            return runner.forward(cache, [seq], [tree.tokens], [tree.position_ids(L)], [tree.attention_mask()])

        want = today().logits[0].float()
        ms.setdefault("today's forward", {})[q] = median_ms(today, args.repeats, warmup=2)
        for name, verify in ways.items():
            def fixed(verify=verify):
                return verify.forward([seq], [tree], [L])

            if name.endswith("compiled") and bucket_for(q) not in compile_s:
                with Timer() as t:
                    fixed()
                compile_s[bucket_for(q)] = t.seconds
            diff.setdefault(name, {})[q] = float((fixed().logits[0].float() - want).abs().max())
            ms.setdefault(name, {})[q] = median_ms(fixed, args.repeats, warmup=2)
    return ms, diff, compile_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--cached", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled row")
    p.add_argument("--weights", choices=["dense", "gguf", "int4", "int8"], default="dense",
                   help="the target's linear layers: dense, the GGUF's own blocks, or quantized on load")
    p.add_argument("--pack", action="store_true", help="dense linears on packed weights (treespec.packing)")
    p.add_argument("--out", type=Path, default=None, help="also write the figures here (JSON)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if max(args.sizes) > 64 or min(args.sizes) < 1:
        p.error("--sizes: tree tokens from 1 to 64 (the largest bucket)")
    model, _ = load(args.model, dtype=getattr(torch, args.dtype), weights=args.weights)
    model.requires_grad_(False)
    runner = ModelRunner(model, "torch")
    packed = contextlib.nullcontext()
    if args.pack:
        from treespec.packing import PackedLinears
        packed = PackedLinears(model)
    with runner.attached(), packed, torch.inference_mode():
        ms, diff, compile_s = rows(runner, args)
    print(f"{machine_line(args.model, args.dtype)}, {args.weights} weights{', packed' if args.pack else ''}: ms per verify forward of q tree tokens after {args.cached} "
          f"cached (median of {args.repeats})")
    if compile_s:
        print("compiling took " + ", ".join(f"{s:.1f} s (bucket {b})" for b, s in compile_s.items()))
    print(f"{'':24}" + "".join(f"{'q=' + str(q):>9}" for q in args.sizes) + "   max |logits - today's|")
    for name, r in ms.items():
        d = max(diff[name].values()) if name in diff else 0.0
        print(f"{name:24}" + "".join(f"{r[q]:9.2f}" for q in args.sizes) + (f"   {d:.2e}" if name in diff else ""))
    if args.out:
        args.out.write_text(json.dumps({
            "command": command(__file__, argv), "machine": machine_info(), "dtype": args.dtype,
            "weights": args.weights, "packed": args.pack,
            "cached": args.cached, "compile_seconds": {str(b): s for b, s in compile_s.items()},
            "ms": {k: {str(q): v for q, v in r.items()} for k, r in ms.items()},
            "max_logits_diff": {k: {str(q): v for q, v in r.items()} for k, r in diff.items()},
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
