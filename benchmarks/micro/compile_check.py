"""Does torch.compile (inductor, CPU) make treespec's verify forward faster than packed eager?

Times one target forward of q tree tokens after a prompt through treespec's runner, three
ways in one process: eager on plain weights, eager on oneDNN-packed weights
(treespec.packing), and every decoder layer compiled with inductor (``dynamic=True`` over
the token count; treespec's attention function stays outside the graph, since it reads the
paged cache through Python objects). Compilation time is reported separately.

    python benchmarks/micro/compile_check.py [--dtype bfloat16] [--threads 2]

Not part of the library: the measurement that decided to ship packed weights and not a
compiled forward (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402

from benchmarks.timing import Timer, command, machine_line, median_ms  # noqa: E402
from treespec import attention  # noqa: E402
from treespec.machine import machine_info  # noqa: E402
from treespec.mask import causal_mask  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears  # noqa: E402
from treespec.runner import ModelRunner  # noqa: E402


def curve(runner, prompt, sizes, repeats) -> dict[int, float]:
    P = prompt.numel()
    cache = runner.new_cache([P + max(sizes) + 8])
    seq = cache.add_sequence()
    out = {}
    with runner.attached():
        runner.forward(cache, [seq], [prompt], [torch.arange(P)], [causal_mask(P)], logits_rows=[[P - 1]])
        cache.commit(seq, torch.arange(P))
        for q in sizes:
            def run():
                runner.forward(cache, [seq], [prompt[:q]], [torch.arange(P, P + q)], [causal_mask(q)])
            out[q] = median_ms(run, repeats, warmup=2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load(args.model, dtype=getattr(torch, args.dtype))
    model.requires_grad_(False)
    runner = ModelRunner(model, "torch")
    prompt = torch.randint(100, 10000, (160,), generator=torch.Generator().manual_seed(0))
    rows = {"eager": curve(runner, prompt, args.sizes, args.repeats)}
    with PackedLinears(model):
        rows["eager, packed weights"] = curve(runner, prompt, args.sizes, args.repeats)

    # Keep treespec's attention (Python objects, paged cache) out of the compiled graphs.
    real = attention.treespec_attention
    attention.AttentionInterface.register(attention.ATTENTION_NAME, torch.compiler.disable(real))
    layers = model.get_decoder().layers
    plain_forward = [layer.forward for layer in layers]
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    try:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        with Timer() as compiling:
            curve(runner, prompt, args.sizes, 1)  # compiles
        compile_seconds = compiling.seconds
        rows["compiled layers (inductor)"] = curve(runner, prompt, args.sizes, args.repeats)
    finally:
        for layer, fwd in zip(layers, plain_forward):
            layer.forward = fwd
        attention.AttentionInterface.register(attention.ATTENTION_NAME, real)

    info = machine_info()
    print(f"{machine_line(args.model, args.dtype)}: ms per forward of q tokens (median of {args.repeats}); "
          f"compiling took {compile_seconds:.0f} s")
    print(f"{'':28}" + "".join(f"{'q=' + str(q):>9}" for q in args.sizes))
    for name, r in rows.items():
        print(f"{name:28}" + "".join(f"{r[q]:9.1f}" for q in args.sizes))
    out = args.out or ROOT / "benchmarks" / "results" / f"compile_check-{args.dtype}.json"
    out.write_text(json.dumps({
        "command": command(__file__, argv),
        "machine": info, "dtype": args.dtype, "compile_seconds": compile_seconds,
        "ms": {k: {str(q): v for q, v in r.items()} for k, r in rows.items()},
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
