"""Two small costs every decoding step pays, timed alone (issue 29): building a draft tree
(``Tree``: validation and depths; a step builds several) and a cache commit (the accepted
entries moved into place in every layer; SmolLM2-135M's cache shape, bf16, four entries kept
out of ten looked ahead).

    python benchmarks/micro/step_overheads.py --threads 1
    python benchmarks/micro/step_overheads.py --threads 1 --src /tmp/old   # another checkout's treespec

Median microseconds a call over --rounds rounds of --calls calls. Timing: run it with nothing
else on the cores (a parallel copy on a busy core costs several times its idle time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _timed(fn, rounds: int, calls: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--nodes", type=int, default=24)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[2]),
                    help="the checkout whose treespec is timed (default: this one)")
    ap.add_argument("--out", default=None, help="also write the figures as JSON")
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    import torch

    from treespec.kv_cache import PagedKVCache
    from treespec.machine import machine_info
    from treespec.tree import Tree

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n = args.nodes
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    tokens = torch.randperm(1000, generator=g)[:n]
    scores, source = -torch.rand(n, generator=g), torch.zeros(n, dtype=torch.int8)

    cache, (seq,) = PagedKVCache.with_rows(30, 3, 64, 1, 1024, dtype=torch.bfloat16)
    keep = torch.tensor([300, 302, 305, 309])

    def commit():
        cache.reserve(seq, 310)
        cache.seq_lens[seq] = 300
        cache.commit(seq, keep)

    rev = subprocess.run(["git", "-C", args.src, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip() or None
    res = {"command": "python benchmarks/micro/step_overheads.py " + " ".join(sys.argv[1:]), "commit": rev,
           "machine": f"torch {torch.__version__}, {args.threads} threads, {machine_info().get('cpu', '?')}",
           "tree_us": round(1e6 * _timed(lambda: Tree(parents, tokens, scores, source), args.rounds, args.calls), 1),
           "commit_us": round(1e6 * _timed(commit, args.rounds, args.calls), 1), "nodes": n}
    print(f"treespec of commit {rev} ({args.src}); {res['machine']}")
    print(f"Tree of {n} nodes:  {res['tree_us']:7.1f} us")
    print(f"cache commit:       {res['commit_us']:7.1f} us")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
