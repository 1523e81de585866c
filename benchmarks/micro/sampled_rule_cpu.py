"""Sampled acceptance's choice on a CPU: the host's rule against the device's over a whole bucket.

    python benchmarks/micro/sampled_rule_cpu.py --threads 2 --out benchmarks/results/sampled-rule-cpu.json

A 16-token bucket of bf16 logits over the shipped target's vocabulary (49,152; 3 times standard
normal, so that top-p keeps about a hundred tokens, as a trained model's would) and a tree of 16
nodes whose path reaches 4 of them (its tokens made certain), for a request sampling with temperature 0.7 and top-p 0.9
(and with top-k 50 besides):

- the host's rule, the path the loop takes on a CPU: ``RequestDecoding.choose_reached_nodes``
  (transformers' warpers, top-p in its sort-free form, on the nodes it reaches, one at a time,
  with their positions' Gumbel noise);
- the device's (``treespec/device_sampling.py``), what a captured GPU verify runs: the warpers
  over all 16 tokens and the argmax of the scores and their noise, eager and compiled, with the
  step's noise written first (``SamplingRows.fill_noise``).

The two must choose the same tokens at the reached nodes (checked first). Timed round-robin
(``--rounds`` rounds of ``--calls`` calls); printed: the median milliseconds a call. Feeds
docs/runtime.md, "Fixed-shape verify" (why the loop keeps the host's rule on a CPU). Run it with
nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper  # noqa: E402

from benchmarks.timing import command, machine_line, round_robin_ms  # noqa: E402
from treespec import Tree  # noqa: E402
from treespec.accept import RequestDecoding, first_argmax  # noqa: E402
from treespec.device_sampling import SamplingRows, row_warp, sampled_choices  # noqa: E402
from treespec.processing import NodeProcessor  # noqa: E402

V, N, L = 49152, 16, 128


def setup():
    """A tree whose sampled path (seed 0, the bias below) is nodes 0 -> 1 -> 3 -> 7, its logits."""
    g = torch.Generator().manual_seed(0)
    tree = Tree([-1] + [i // 2 for i in range(N - 1)], list(range(5, 5 + N)))
    logits = (3 * torch.randn(N, V, generator=g)).to(torch.bfloat16)  # top-p 0.9 at 0.7 keeps about 110 tokens
    for node, child in ((0, 1), (1, 3), (3, 7)):
        logits[node, int(tree.tokens[child])] = 30.0
    return tree, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tree, logits = setup()
    history = list(range(L + 1))
    variants, checks = {}, []
    for name, warpers in (("temperature 0.7, top-p 0.9", [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)]),
                          ("with top-k 50", [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50),
                                             TopPLogitsWarper(0.9)])):
        decoding = RequestDecoding(NodeProcessor.of(warpers), seed=0)
        w = row_warp(decoding)
        rows = SamplingRows.empty(1, N, V, "cpu")
        rows.set_rows({0: w})
        depth = tree.depth[None]

        def device(body, rows=rows, w=w):
            rows.fill_noise([0], [L], [tree])
            return body(logits[None], depth, rows, w.uses)[0].tolist()

        eager = lambda x, d, s, u: sampled_choices(x, d, s, u, first_argmax)  # noqa: E731
        compiled = torch.compile(eager, dynamic=False)
        variants[f"{name}: the host's rule, the reached nodes"] = (
            lambda d=decoding: d.choose_reached_nodes(history, logits, tree).tolist())
        variants[f"{name}: the device's, all {N} tokens, eager"] = lambda b=eager, f=device: f(b)
        variants[f"{name}: the device's, all {N} tokens, compiled"] = lambda b=compiled, f=device: f(b)
        checks.append(list(variants)[-3:])
    with torch.inference_mode():
        for host, *on_device in checks:  # compiles, and the same choice at every reached node
            want = variants[host]()
            reached = [i for i, c in enumerate(want) if c >= 0]
            assert len(reached) == 4, reached
            for name in on_device:
                got = variants[name]()
                assert [got[i] for i in reached] == [want[i] for i in reached], name
        medians = {name: round(ms, 3) for name, ms in round_robin_ms(variants, args.rounds, args.calls).items()}
    head = machine_line("bfloat16")
    print(head)
    print(f"logits [{N}, {V}] bf16; a tree of {N} nodes whose sampled path reaches 4")
    for name in variants:
        print(f"  {name:64} {medians[name]:8.3f} ms a call")
    if args.out:
        res = {"command": command("benchmarks/micro/sampled_rule_cpu.py", sys.argv[1:]), "machine": head,
               "median_ms": medians}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
