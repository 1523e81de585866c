"""Held-out top-1 agreement by training-time-test step of any EAGLE head (shipped name or
folder) on a capture's greedy conversations, exactly as ``train-eagle --val-captured``
validates a head it trains: heads trained on different data compare on one set.

    python benchmarks/training/validate_head.py --head smollm2-135m-instruct-eagle --val-capture runs/cap-val

Feeds docs/training.md, "Ablations (issue 10)" and "The shipped head".
"""

from __future__ import annotations

import argparse

from treespec.drafters import load_draft
from treespec.models import load
from treespec.train import validate
from treespec.train.capture import load_shards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", action="append", required=True, help="repeatable")
    ap.add_argument("--val-capture", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--val-examples", type=int, default=32, help="as train-eagle's default")
    ap.add_argument("--ttt-steps", type=int, default=3)
    args = ap.parse_args()
    model, _ = load(args.model)
    for name in args.head:
        head = load_draft(name, model).head.float().eval()
        recs = load_shards(args.val_capture, eagle3=head.config.eagle3, greedy_only=True)[: args.val_examples]
        loss, acc = validate(head, recs, args.ttt_steps)
        print(f"{name}: loss {loss:.4f} top1_by_step {' '.join(f'{a:.4f}' for a in acc)} "
              f"({len(recs)} conversations of {args.val_capture})")


if __name__ == "__main__":
    main()
