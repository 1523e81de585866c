"""How often prompt lookup's chains hold beside a head's, on one data set: tau (tokens
committed per verify forward) of each drafter alone, and for lookup the share of steps in
which it had a chain that held at all and how long those runs were. tau is a count: it does
not depend on the machine's load.

    python benchmarks/micro/lookup_tau.py --dataset humaneval --num-prompts 12 --max-new-tokens 256

Feeds docs/drafters.md, "HybridDrafter: a model's tree with prompt lookup grafted on".
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import treespec
from treespec.prompts import load_prompts
from treespec.drafters import NgramDrafter, load_draft
from treespec.models import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-eagle")
    ap.add_argument("--head-tree", default="chain-3")
    ap.add_argument("--lookup-depth", type=int, default=8, help="lookup's chain: TreeConfig.chain(depth)")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    prompts, _ = load_prompts(args.dataset, tok, args.num_prompts)
    runs = [(f"prompt lookup, chain-{args.lookup_depth}", NgramDrafter(), treespec.TreeConfig.chain(args.lookup_depth)),
            (f"{args.head}, {args.head_tree}", load_draft(args.head, model), args.head_tree)]
    for name, draft, tree in runs:
        acc = []
        for ids in prompts:
            out = treespec.generate(model, draft, tree, ids, max_new_tokens=args.max_new_tokens)
            acc.extend(out.metrics.requests[0].accepted)
        a = np.array(acc)
        line = f"{name}: tau {(a.sum() + a.size) / a.size:.2f} over {a.size} steps"
        if isinstance(draft, NgramDrafter):
            line += f"; steps with >= 1 accepted {(a > 0).mean():.0%}, accepted then {a[a > 0].mean():.2f} on average"
        print(line, flush=True)
    print(f"({args.dataset}, first {args.num_prompts}, {args.max_new_tokens} new tokens, greedy, {args.dtype})")


if __name__ == "__main__":
    main()
