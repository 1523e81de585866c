"""The ``treespec`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main"]


class UserError(Exception):
    """A mistake the user can fix: printed as one line, no traceback."""


def _add_train(sub):
    p = sub.add_parser("train-eagle", help="train an EAGLE draft head for a target model")
    p.add_argument("--model", default="smollm2-135m-instruct", help="target: a treespec name, HF id or path")
    p.add_argument("--data", required=True, help="JSONL with question/answer, prompt/completion, messages or text")
    p.add_argument("--out", required=True, help="output directory (resumes if it holds a run)")
    p.add_argument("--arch", choices=["eagle3", "eagle1"], default="eagle3")
    p.add_argument("--draft-vocab", type=int, default=4096, help="EAGLE-3 draft vocabulary (0: full)")
    p.add_argument("--max-examples", type=int, default=None)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="self-distil: replace the answers of the first N examples by the target's own (-1: all)")
    p.add_argument("--regen-max-new-tokens", type=int, default=256)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_train)


def _train(args):
    from tqdm import tqdm

    from . import models
    from .train import TrainConfig, train_eagle

    cfg = TrainConfig(
        data=args.data, out_dir=args.out, eagle3=args.arch == "eagle3",
        draft_vocab_size=args.draft_vocab or None, max_examples=args.max_examples,
        max_length=args.max_length, regenerate=args.regenerate != 0,
        regenerate_count=None if args.regenerate < 0 else args.regenerate,
        regen_max_new_tokens=args.regen_max_new_tokens, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps, seed=args.seed,
    )
    model, tok = _load_model(args.model)
    bars = {}

    def progress(p):
        bar = bars.get(p.stage)
        if bar is None:
            bar = bars[p.stage] = tqdm(total=p.total, desc=p.stage, dynamic_ncols=True)
        bar.n = p.done
        if p.info:
            bar.set_postfix(loss=f"{p.info['loss']:.3f}", acc=",".join(f"{a:.2f}" for a in p.info["acc"]),
                            tok_s=f"{p.info['tok/s']:.0f}", refresh=False)
        bar.refresh()

    train_eagle(model, tok, cfg, callback=progress)
    for bar in bars.values():
        bar.close()
    print(f"saved the head to {args.out}/head")


def _load_model(name):
    from . import models

    try:
        return models.load(name)
    except models.ModelUnavailableError as e:
        raise UserError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treespec", description="tree-attention speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (UserError, FileNotFoundError, ValueError) as e:
        print(f"treespec: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
