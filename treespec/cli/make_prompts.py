"""``treespec make-prompts``: training prompts the target writes itself (first turns, or a follow-up
to each conversation of captures), or the templated sets treespec ships."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

from .bars import Bars
from .common import UserError, add_model


def add_arguments(p):
    p.description = ("Write training prompts. By default the target writes user turns itself (\"Magpie\": its chat "
                     "template up to a user turn, sampled at T=1, top-p 0.95, one seed per chunk of --batch-size), "
                     "kept in --work chunk by chunk (a re-run skips the chunks there), then filtered (cut off, "
                     "length, not English, repetition, overlap with the evaluation sets, near-duplicates). "
                     "--follow-ups: a second turn to each conversation of capture folders. --templated: the "
                     "templated sets that ship (stdlib-code, chat-train, chat-eval). treespec train-eagle --model M "
                     "--out DIR samples its own prompts this way. See docs/training.md, Data sources.")
    add_model(p)
    p.add_argument("--n", type=int, default=None,
                   help="raw first-turn messages to sample, before filtering (default 32768); with --follow-ups, "
                        "at most this many follow-ups (default: one per captured conversation)")
    p.add_argument("--follow-ups", metavar="CAPTURE[,CAPTURE]", default=None,
                   help="write second turns instead: a follow-up to each conversation these capture folders answered")
    p.add_argument("--templated", action="store_true",
                   help="write the templated sets (stdlib_code, chat_train, chat_eval .jsonl.gz) into --out; no model")
    p.add_argument("--seed", type=int, default=None, help="default 0 for first turns, 1 for follow-ups")
    p.add_argument("--batch-size", type=int, default=64, help="messages per chunk (each chunk has its own seed)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bf16 where the CPU has it natively, else fp32")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: one per physical core available)")
    p.add_argument("--work", default=None, help="folder of raw chunks (a re-run skips those present; default "
                                                "runs/magpie, runs/magpie2 for follow-ups)")
    p.add_argument("--out", default=None, help="write magpie_chat.jsonl.gz (filtered; follow-ups: "
                                               "magpie_chat2.jsonl.gz) here, e.g. treespec/data")


def run(args):
    if args.templated:
        if args.follow_ups or args.n is not None or not args.out:
            raise UserError("--templated writes the templated sets into --out: give --out, without --n or --follow-ups")
        from ..train.generated_prompts import write_templated_sets

        for path, n in write_templated_sets(args.out):
            print(f"wrote {path}: {n} prompts")
        return 0
    if args.batch_size < 1 or (args.n is not None and args.n < 1):
        raise UserError("--batch-size and --n must be >= 1")
    from ..train import magpie
    from .loading import load_model, setup_threads

    follow = args.follow_ups is not None
    seed = args.seed if args.seed is not None else int(follow)
    setup_threads(args)
    work = Path(args.work or ("runs/magpie2" if follow else "runs/magpie"))
    work.mkdir(parents=True, exist_ok=True)
    dtype = None if args.dtype == "auto" else args.dtype
    model = tok = convs = None
    if follow:  # the conversations are read with the target's tokenizer
        model, tok = _load(args.model, dtype, load_model)
        convs = magpie.captured_conversations(args.follow_ups.split(","), tok)[: args.n]
        n = len(convs)
    else:
        n = args.n if args.n is not None else 32768
    chunks = range((n + args.batch_size - 1) // args.batch_size)
    todo = magpie.chunks_to_sample(work, chunks, args.batch_size, convs)
    if todo:
        if model is None:
            model, tok = _load(args.model, dtype, load_model)
        _sample(model, tok, work, todo, seed, args.batch_size, convs, "follow-ups" if follow else "user turns")
    rows = magpie.read_chunks(work, chunks)
    kept, why = magpie.kept_turns(rows, convs)
    print(f"{len(kept)} of {len(rows)} kept; dropped: {dict(why.most_common())}")
    if args.out:
        path = Path(args.out) / ("magpie_chat2.jsonl.gz" if follow else "magpie_chat.jsonl.gz")
        print(f"wrote {magpie.write_prompt_set(path, kept)}")
    return 0


def _load(name, dtype, load_model):
    import torch

    from ..packing import default_dtype

    return load_model(name, default_dtype() if dtype is None else getattr(torch, dtype))


def _sample(model, tok, work, todo, seed, batch_size, convs, desc):
    """The missing chunks, on packed weights where oneDNN packs them, a bar per chunk."""
    from ..packing import PackedLinears, packing_supported
    from ..train.magpie import sample_chunk

    bars = Bars("chunk")
    with PackedLinears(model) if packing_supported(model) else contextlib.nullcontext():
        bars(SimpleNamespace(stage=desc, done=0, total=len(todo)))
        for i, c in enumerate(todo):
            sample_chunk(model, tok, work, c, seed, batch_size=batch_size, conversations=convs)
            bars(SimpleNamespace(stage=desc, done=i + 1, total=len(todo)))
    bars.close()
