"""``treespec train-eagle``: train an EAGLE draft head for a target, on a JSONL file or a
packaged dataset (capturing the target's features first) or on a ``treespec capture`` folder."""

from __future__ import annotations

from .common import Bars, UserError, add_model


def add_arguments(p):
    p.description = ("Train an EAGLE draft head for the target: on a JSONL file or a packaged dataset (the target's "
                     "features captured first) or on treespec capture folders; resumes from --out "
                     "(docs/training.md).")
    add_model(p)
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
    p.add_argument("--draft-vocab", type=int, default=4096, help="EAGLE-3 draft vocabulary: the most frequent target tokens of the data (0: the full "
                        "vocabulary)")
    p.add_argument("--max-examples", type=int, default=None,
                   help="train on the first N examples (conversations) of the data (default: all)")
    p.add_argument("--max-length", type=int, default=512,
                   help="prompt + answer tokens; longer conversations are skipped and counted")
    p.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="self-distil: replace the answers of the first N examples by the target's own (-1: all)")
    p.add_argument("--regen-max-new-tokens", type=int, default=256,
                   help="with --regenerate: the most tokens of each answer the target writes")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the training data (fractions allowed)")
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
                        "auto: bf16 on a GPU or a CPU with native bf16, else float32")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: one per physical core available, as generate and bench)")


def _postfix(p) -> str | None:
    """The train stage's figures after its bar; the capture and regenerate stages have none."""
    if not p.info:
        return None
    return (f"loss={p.info['loss']:.3f}, acc={','.join(f'{a:.2f}' for a in p.info['acc'])}, "
            f"tok_s={p.info['tok/s']:.0f}")


def run(args):
    from ..train import TrainConfig, keep_freed_memory, train_eagle
    from .loading import load_model, setup_threads

    if (args.data is None) == (args.captured is None):
        raise UserError("give --data (capture, then train) or --captured DIR (train on a treespec capture)")
    cfg = TrainConfig(
        data=args.data or "", out_dir=args.out, eagle3=args.arch == "eagle3", captured=args.captured,
        val_captured=args.val_captured,
        draft_vocab_size=args.draft_vocab or None, max_examples=args.max_examples,
        max_length=args.max_length, regenerate=args.regenerate != 0,
        regenerate_count=None if args.regenerate < 0 else args.regenerate,
        regen_max_new_tokens=args.regen_max_new_tokens, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps, seed=args.seed,
        dtype=args.dtype, soft_labels=args.soft_labels, init=args.init,
    )
    setup_threads(args)
    keep_freed_memory()
    # float32 weights: --dtype is training's autocast dtype (TrainConfig.dtype), not the target's.
    model, tok = load_model(args.model)
    bars = Bars(postfix=_postfix, disable=False)
    train_eagle(model, tok, cfg, callback=bars)
    bars.close()
    print(f"saved the head to {args.out}/head")
