"""Greedy acceptance on a CPU, on the host against inside a compiled step, side by side.

    python benchmarks/micro/accept_on_device.py --threads 2 --out benchmarks/results/accept_on_device.json

A 16-token bucket of bf16 logits over the shipped target's vocabulary (49,152), with a tree of
16 nodes whose greedy path accepts 3 of them, on a 30-layer cache of the shipped target's shape:

- the argmax of every row, compiled: ``x.float().argmax(-1)`` (inductor's one pass) against
  ``accept.first_argmax`` (two reductions), and eagerly;
- the whole rule: the host's (``RequestDecoding.choose_reached_nodes``, the argmax of the path's
  rows alone, then ``accept.accept``; the loop then moves the path's K/V with
  ``PagedKVCache.commit``) against the fixed-shape body's tail, compiled (``first_argmax``,
  ``accept_fixed``, ``PagedKVCache.move``) and its one read back.

Each variant compiled first, then timed round-robin (``--rounds`` rounds of ``--calls`` calls);
printed: the median milliseconds a call. Feeds docs/runtime.md, "Fixed-shape verify". Run it
with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.timing import command, machine_line, round_robin_ms  # noqa: E402
from treespec import Tree  # noqa: E402
from treespec.accept import RequestDecoding, accept, accept_fixed, first_argmax, verdicts_of  # noqa: E402
from treespec.fixed_shape import ancestor_masks  # noqa: E402
from treespec.kv_cache import PagedKVCache  # noqa: E402
from treespec.processing import NodeProcessor  # noqa: E402

V, N, LAYERS, ROW = 49152, 16, 30, 2048


def setup():
    """Logits, a tree whose greedy path is nodes 0 -> 1 -> 3 -> 7 (the bonus after 7), its
    bucket tensors and a cache row."""
    g = torch.Generator().manual_seed(0)
    tree = Tree([-1] + [i // 2 for i in range(N - 1)], list(range(5, 5 + N)))
    logits = torch.randn(N, V, generator=g).to(torch.bfloat16)
    for node, child in ((0, 1), (1, 3), (3, 7)):
        logits[node, int(tree.tokens[child])] = 10.0
    ids, parents = tree.tokens[None].clone(), tree.parents[None].clone()
    cache = PagedKVCache(LAYERS, 3, 64, ROW // 16, 16, torch.bfloat16, "cpu")
    (seq,) = cache.add_sequences(1, ROW)
    return tree, logits, ids, parents, ancestor_masks(parents), cache, seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tree, logits, ids, parents, reach, cache, seq = setup()
    decoding = RequestDecoding(NodeProcessor.of([]))
    L = 128
    slots = torch.arange(L, L + N)[None]

    def host():
        cache.reserve(seq, L + N)
        choices = decoding.choose_reached_nodes([0] * L, logits, tree)
        (v,) = accept([tree], choices[None])
        cache.seq_lens[seq] = L
        cache.commit(seq, [L + j for j in v.path])
        return v

    def tail(x, ids, parents, reach, slots):
        packed = accept_fixed(first_argmax(x[None]), ids, parents, reach)
        cache.move(slots.gather(1, packed[:, 1: N + 1]), slots)
        return packed

    compiled_tail = torch.compile(tail, dynamic=False)

    def device():
        return verdicts_of(compiled_tail(logits, ids, parents, reach, slots).tolist(), [0])[0]

    variants = {
        "argmax, one pass, compiled": torch.compile(lambda x: x.float().argmax(-1), dynamic=False),
        "first_argmax, compiled": torch.compile(first_argmax, dynamic=False),
        "argmax, one pass, eager": lambda x: x.float().argmax(-1),
        "first_argmax, eager": lambda x: first_argmax(x, two_stage=True),
        "the rule on the host (path's rows, accept, commit)": lambda x: host(),
        "the rule compiled (first_argmax, accept_fixed, move, one read)": lambda x: device(),
    }
    assert host() == device(), "the two rules disagree"
    with torch.inference_mode():
        for fn in variants.values():
            fn(logits)  # compile
        medians = round_robin_ms({name: functools.partial(fn, logits) for name, fn in variants.items()},
                                 args.rounds, args.calls)
    head = machine_line("bfloat16")
    print(head)
    print(f"logits [{N}, {V}] bf16; a tree of {N} nodes accepting 3; a cache of {LAYERS} layers")
    rows = {}
    for name, ms in medians.items():
        rows[name] = round(ms, 3)
        print(f"  {name:64} {ms:6.3f} ms a call")
    if args.out:
        res = {"command": command("benchmarks/micro/accept_on_device.py", sys.argv[1:]), "machine": head,
               "median_ms": rows}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
