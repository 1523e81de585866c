"""``treespec train-eagle``: train an EAGLE draft head for a target: with nothing but ``--model``
and ``--out``, on prompts the target writes itself (sized by ``--budget``); or on a JSONL file or
a packaged dataset (capturing the target's features first); or on ``treespec capture`` folders."""

from __future__ import annotations

import re
import sys
import time

from .common import UserError, add_model

_UNITS = {"h": 3600, "m": 60, "s": 1}


def duration(text: str) -> float:
    """Seconds of ``2h``, ``30m``, ``90s``, ``1h30m`` or a bare number of seconds (argparse's type)."""
    import argparse

    t = text.strip().lower().replace(" ", "")
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms]?)", t)
    if not parts or "".join(a + u for a, u in parts) != t or (len(parts) > 1 and not all(u for _, u in parts)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: write it as 2h, 30m, 90s or 1h30m")
    seconds = sum(float(a) * _UNITS[u or "s"] for a, u in parts)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the budget must be more than 0")
    return seconds


def add_arguments(p):
    p.description = ("Train an EAGLE draft head for the target. With only --model and --out: the target writes its "
                     "own user prompts, answers them (features recorded), a head is trained, validated on a held-out "
                     "share and its auto profile tuned, all sized to --budget from rates measured in the first "
                     "minutes; the same command resumes (docs/own-model.md). Or on a JSONL file or a packaged dataset "
                     "(--data; the target's features captured first), or on treespec capture folders (--captured); "
                     "resumes from --out (docs/training.md).")
    add_model(p)
    p.add_argument("--budget", type=duration, default=None, metavar="TIME",
                   help="self-generated prompts: the run's time, e.g. 2h, 30m, 90s; the number of prompts, the "
                        "answers' length and the epochs are sized to it (default: 2h, unless --prompts is given)")
    p.add_argument("--prompts", type=int, default=None, metavar="N",
                   help="self-generated prompts: train on N conversations (default: as many as --budget allows)")
    p.add_argument("--data", default=None, help="JSONL with question/answer, prompt/completion, messages or text, "
                   "or a packaged dataset: gsm8k-train (GSM8K train, shipped with treespec); not with --captured")
    p.add_argument("--captured", default=None, metavar="DIR[,DIR...]",
                   help="train on treespec capture folders, comma-separated (the first --max-examples "
                        "conversations of them in order) instead of --data")
    p.add_argument("--val-captured", default=None, metavar="DIR",
                   help="validate on this capture folder (greedy answers) instead of a share of the training data")
    p.add_argument("--out", required=True, help="output directory (resumes if it holds a run)")
    p.add_argument("--arch", choices=["eagle3", "eagle1"], default="eagle3",
                   help="eagle3: a head on three of the target's layers with its own draft vocabulary; eagle1: "
                        "the EAGLE-1/2 head on the last layer's features")
    p.add_argument("--draft-vocab", type=int, default=4096, help="EAGLE-3 draft vocabulary: the most frequent target "
                   "tokens of the data (0: the full vocabulary)")
    p.add_argument("--max-examples", type=int, default=None,
                   help="train on the first N examples (conversations) of the data (default: all)")
    p.add_argument("--max-length", type=int, default=512,
                   help="prompt + answer tokens; longer conversations are skipped and counted")
    p.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="self-distil: replace the answers of the first N examples by the target's own (-1: all)")
    p.add_argument("--max-new-tokens", "--regen-max-new-tokens", dest="max_new_tokens", type=int, default=None,
                   help="the most tokens of each answer the target writes (--regenerate: default 256; self-generated "
                        "prompts: 256, 128 under a 10-minute budget, 64 under 3)")
    p.add_argument("--epochs", type=float, default=None, help="passes over the training data, fractions allowed "
                   "(default: 2; self-generated prompts: 2, then fitted to the time left once the answers are in)")
    p.add_argument("--batch-size", type=int, default=8, help="conversations per optimiser step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (after a warm-up)")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="training-time-test steps: the head also learns from its own drafts this many tokens deep "
                        "(EAGLE-3)")
    p.add_argument("--soft-labels", action="store_true",
                   help="train on the target's whole next-token distribution over the draft vocabulary "
                        "(from the captured final state, as EAGLE-3 trains) instead of its one token; "
                        "needs --captured with features 'both'")
    p.add_argument("--init", default=None, metavar="HEAD",
                   help="fine-tune this head (a directory or a shipped head's name) instead of starting from a "
                        "fresh one; its layout and draft vocabulary are kept")
    p.add_argument("--seed", type=int, default=0, help="seed of the head's initialisation, shuffling and split")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="compute dtype of training (bf16 autocast; weights and optimiser state stay fp32). "
                        "auto: bf16 on a GPU or a CPU with native bf16, else float32. Self-generated prompts: also "
                        "the target's while it writes and answers them")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: one per physical core available, as generate and bench)")


def _train_config(args, epochs: float):
    from ..train import TrainConfig

    return TrainConfig(
        data=args.data or "", out_dir=args.out, eagle3=args.arch == "eagle3", captured=args.captured,
        val_captured=args.val_captured,
        draft_vocab_size=args.draft_vocab or None, max_examples=args.max_examples,
        max_length=args.max_length, regenerate=args.regenerate != 0,
        regenerate_count=None if args.regenerate < 0 else args.regenerate,
        regen_max_new_tokens=args.max_new_tokens or 256, epochs=epochs,
        batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps, seed=args.seed,
        dtype=args.dtype, soft_labels=args.soft_labels, init=args.init,
    )


def run(args):
    from ..train import keep_freed_memory, train_eagle
    from .loading import load_model, setup_threads
    from .train_progress import TrainReport

    if args.data is not None and args.captured is not None:
        raise UserError("give --data (capture, then train) or --captured DIR (train on a treespec capture), not both")
    if args.data is None and args.captured is None:
        return _own(args)
    if args.budget is not None or args.prompts is not None:
        raise UserError("--budget and --prompts size a run on self-generated prompts: leave out --data and --captured")
    cfg = _train_config(args, 2.0 if args.epochs is None else args.epochs)
    setup_threads(args)
    keep_freed_memory()
    # float32 weights: --dtype is training's autocast dtype (TrainConfig.dtype), not the target's.
    model, tok = load_model(args.model)
    report = TrainReport()
    train_eagle(model, tok, cfg, callback=report)
    report.close()
    print(f"saved the head to {args.out}/head")


def _own(args):
    """The self-generated run (:mod:`treespec.train.pipeline`)."""
    import contextlib

    started = time.perf_counter()
    for flag, value in (("--regenerate", args.regenerate), ("--max-examples", args.max_examples),
                        ("--val-captured", args.val_captured)):
        if value:
            raise UserError(f"{flag} is for --data or --captured: with self-generated prompts the run holds out its "
                            "own share (--prompts sets how many it trains on)")
    if args.soft_labels:
        raise UserError("--soft-labels needs --captured (a capture with the final state)")
    from ..pack_choice import choose_packing
    from ..packing import default_dtype
    from ..train import keep_freed_memory
    from ..train.pipeline import OwnRun, PipelineConfig, asked_before
    from .loading import load_model, setup_threads
    from .train_progress import TrainReport

    # A resumed run takes the amounts it was asked, unless they are given again.
    before = asked_before(args.out) or {"budget": None if args.prompts else 7200.0}
    amounts = {"budget": args.budget, "prompts": args.prompts, "answer_tokens": args.max_new_tokens,
               "epochs": args.epochs}
    amounts = {k: v if v is not None else before.get(k) for k, v in amounts.items()}
    try:
        cfg = PipelineConfig(args.out, **amounts, train=_train_config(args, 2.0), model=args.model, dtype=args.dtype,
                             seed=args.seed)
    except ValueError as e:
        raise UserError(str(e)) from None
    setup_threads(args)
    keep_freed_memory()
    import torch

    model, tok = load_model(args.model, default_dtype() if args.dtype == "auto" else getattr(torch, args.dtype))
    choice, packed = choose_packing(model)  # the target decodes on packed weights where they measure faster
    report = TrainReport()
    run = OwnRun(model, tok, cfg, callback=report, started=started,
                 packed=(lambda: packed) if packed is not None and choice.pack else contextlib.nullcontext)
    try:
        head = run.run()
    except KeyboardInterrupt:
        report.close()
        print(f"treespec: stopped; what is done is kept: treespec train-eagle --model {args.model} --out {args.out} "
              "resumes", file=sys.stderr, flush=True)
        raise
    report.close()
    print(f"saved the head to {head}; use it with: treespec generate --model {args.model} --draft {head}")
    return 0
