"""One layer's tree attention on a CPU: the torch backend (a dense mask, SDPA) against the split
backend (the prefix through the fused kernel without a mask, the tree block written out, merged
by log-sum-exp), after 128, 512 and 2,048 cached tokens, for trees of 8, 32 and 64 tokens.

    python benchmarks/micro/split_attention_cpu.py --threads 2 --out benchmarks/results/split-attention-cpu.json

Two real models' attention shapes: SmolLM2-135M's (9 heads over 3 KV heads, head dim 64) and
Llama-3.1-8B's (32 over 8, head dim 128). One request whose K/V lie in consecutive slots (read
as a view by both backends, as in a decoding run of one request), fp32 as on a CPU
(``kv_dtype``), a random tree of the size with its ancestor mask. Each call is one layer's
``backend.run`` (the forward's ``plan`` is made once, outside the timing: it is once per
forward, not per layer); the two backends alternate call by call and each cell is the median
of ``--repeats`` calls after ``--warmup``. Each cell also records the largest difference
between the two backends' outputs. Prints a table (the first line says where it ran) and,
with ``--out``, writes it as JSON with the command. Feeds docs/runtime.md, "Attention
backends" (the split backend's paragraph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402

from benchmarks.timing import Timer, command, machine_line  # noqa: E402
from treespec import Tree  # noqa: E402
from treespec.attention import SplitBackend, TorchBackend, make_batch  # noqa: E402
from treespec.kv_cache import PagedKVCache  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128)}  # heads, KV heads, head dim
PREFIXES = (128, 512, 2048)
TREE_SIZES = (8, 32, 64)


def batches(heads_kv: int, head_dim: int, prefix: int, n: int, g: torch.Generator):
    """One request of ``prefix`` cached tokens and a random tree of ``n``, planned for both
    backends over one cache of random K/V (consecutive slots: both read views)."""
    cache = PagedKVCache(1, heads_kv, head_dim, -(-(prefix + n) // 16) + 1, 16)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    seq = cache.add_sequence()
    cache.reserve(seq, prefix)
    cache.commit(seq, range(prefix))
    tree = Tree([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    args = ([seq], [prefix], [tree.attention_mask()], [tree.position_ids(prefix)])
    return make_batch(cache, *args, TorchBackend()), make_batch(cache, *args, SplitBackend())


def cell(shape: str, prefix: int, n: int, repeats: int, warmup: int) -> dict:
    """Median ms of one layer's attention through each backend, and their largest difference."""
    H, Hkv, D = SHAPES[shape]
    g = torch.Generator().manual_seed(prefix * 1000 + n)
    ref, split = batches(Hkv, D, prefix, n, g)
    q = torch.randn(n, H, D, generator=g)
    scale = D**-0.5
    calls = {"torch": lambda: ref.backend.run(ref, 0, q, scale), "split": lambda: split.backend.run(split, 0, q, scale)}
    times = {name: [] for name in calls}
    for i in range(warmup + repeats):
        for name, fn in calls.items():
            with Timer() as t:
                fn()
            if i >= warmup:
                times[name].append(t.ms)
    diff = float((calls["split"]() - calls["torch"]()).abs().max())
    torch_ms, split_ms = (statistics.median(times[name]) for name in ("torch", "split"))
    return dict(shape=shape, heads=H, kv_heads=Hkv, head_dim=D, prefix=prefix, tree=n, torch_ms=torch_ms,
                split_ms=split_ms, split_over_torch=split_ms / torch_ms, max_abs_diff=diff)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--prefixes", default=",".join(map(str, PREFIXES)), help="cached tokens, comma-separated")
    p.add_argument("--trees", default=",".join(map(str, TREE_SIZES)), help="tree sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per backend and cell")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per backend and cell before them")
    p.add_argument("--out", type=Path, default=None, help="JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    head = machine_line("fp32, one layer's attention")
    print(head, flush=True)
    print(f"{'shape':<14}{'prefix':>7}{'tree':>6}{'torch ms':>10}{'split ms':>10}{'split/torch':>13}{'max diff':>11}")
    rows = []
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            for prefix in map(int, args.prefixes.split(",")):
                for n in map(int, args.trees.split(",")):
                    r = cell(shape, prefix, n, args.repeats, args.warmup)
                    rows.append(r)
                    print(f"{shape:<14}{prefix:>7}{n:>6}{r['torch_ms']:>10.3f}{r['split_ms']:>10.3f}"
                          f"{r['split_over_torch']:>13.2f}{r['max_abs_diff']:>11.1e}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"command": command(__file__, argv), "machine": head, "threads": args.threads,
                  "repeats": args.repeats, "warmup": args.warmup, "rows": rows}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
