"""``treespec capture``: the target answers every prompt of a dataset mix (batched through
treespec's engine) and its features are kept in resumable shards, for ``train-eagle --captured``."""

from __future__ import annotations

from .common import UserError, add_generation_options, add_model, add_runtime, generation_options


def add_arguments(p):
    p.description = ("Self-distillation at scale: the target answers every prompt (batched through treespec's "
                     "engine, greedy or a sampled share), and its features are kept, in shards of --shard-size "
                     "conversations. Run the same command again to resume; train with train-eagle --captured DIR. "
                     "See docs/training.md.")
    add_model(p)
    p.add_argument("--data", required=True, help="comma-separated datasets (packaged names or JSONL files), each "
                   "optionally sliced: 'gsm8k-train[:7000],stdlib-code,chat-train'")
    p.add_argument("--mix", default=None, help="comma-separated weights, one per dataset (default: their sizes); "
                   "every prefix of the capture keeps these proportions")
    p.add_argument("--out", required=True, help="capture folder (resumes if it holds shards)")
    p.add_argument("--max-examples", type=int, default=None, help="capture the first N conversations of the mix")
    p.add_argument("--answers", choices=["target", "reference"], default="target",
                   help="target: the target writes every answer (self-distillation); reference: the data's answers")
    p.add_argument("--sample-share", type=float, default=0.0, help="share of answers sampled instead of greedy")
    p.add_argument("--sample-temperature", type=float, default=0.8, help="temperature of the sampled share")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens of each answer")
    p.add_argument("--max-length", type=int, default=512, help="prompt + answer tokens")
    p.add_argument("--batch-size", type=int, default=64,
                   help="requests decoded together, greedy and sampled alike (free to change when resuming)")
    p.add_argument("--shard-size", type=int, default=64, help="conversations per shard file")
    p.add_argument("--features", choices=["both", "eagle3", "eagle1"], default="both",
                   help="features kept: both layouts (default, trains either) or one")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled share and of the sampled answers")
    p.add_argument("--answers-from", default=None, metavar="DIR[,DIR...]",
                   help="capture folders (same model and answer settings) whose answers to the same prompts are "
                        "reused: a shard they answer whole is rebuilt from them, not decoded (a capture of a subset "
                        "or another mix of data captured before)")
    add_generation_options(p)
    add_runtime(p, graphs=False)  # the target alone: no drafter


def run(args):
    from .loading import check, load
    from .train_progress import TrainReport

    check(args)
    from ..train.capture import CaptureConfig, answers_of, capture_shards

    try:
        mix = tuple(float(w) for w in args.mix.split(",")) if args.mix else None
        cfg = CaptureConfig(
            data=args.data, out_dir=args.out, mix=mix, max_examples=args.max_examples, max_length=args.max_length,
            max_new_tokens=args.max_new_tokens, answers=args.answers, sample_share=args.sample_share,
            sample_temperature=args.sample_temperature, seed=args.seed, shard_size=args.shard_size,
            batch_size=args.batch_size, features=args.features, model=args.model, dtype=args.dtype,
            attention_backend=args.backend, options=generation_options(args))
        sources = [d for d in (args.answers_from or "").split(",") if d.strip()]
        borrowed = answers_of(cfg, sources) if sources else None  # refused before the model loads
    except ValueError as e:
        raise UserError(f"capture: {e}") from None
    loaded = load(args)
    bars = TrainReport()  # a bar on a terminal, else a line every tenth (a capture runs for hours)
    with loaded.packed():
        s = capture_shards(loaded.model, loaded.tokenizer, cfg, callback=bars,
                           answers_from=sources, borrowed=borrowed)
    bars.close()
    rebuilt = f" ({s['rebuilt']} rebuilt from answers files)" if s["rebuilt"] else ""
    print(f"{args.out}: {s['written']} shard(s) written{rebuilt}, {s['skipped']} already there, of {s['shards']}; "
          f"{s['conversations']} conversations, {s['generated_tokens']} generated tokens in {s['seconds']:.0f} s "
          f"({s['tokens_per_second']:.1f} tok/s)" + (f"; {s['too_long']} too long, skipped" if s["too_long"] else ""))
    return 0
