"""``treespec generate``: one prompt, the text streamed to stdout as steps commit it, a
summary line on stderr."""

from __future__ import annotations

import sys

from .common import (DEFAULT_SPEC, DEFAULT_TREE, DRAFT_HELP, add_auto_profile, add_model, add_prompt_source,
                     add_runtime, add_sampling, auto_profile, generation_options, log, prompt_ids)


def add_arguments(p):
    p.description = ("Generate with tree speculation: the text streams to stdout as it is committed, a summary "
                     "line goes to stderr.")
    add_model(p)
    p.add_argument("--draft", default=DEFAULT_SPEC,
                   help=DRAFT_HELP + " (default: %(default)s, the shipped head with prompt lookup)")
    p.add_argument("--tree", default=DEFAULT_TREE,
                   help="a preset name or a JSON tree file (default: %(default)s: each step verifies the tree that "
                        "pays most from this machine's measured verify costs and the draft's calibrated scores; "
                        "the fastest beside every fixed preset with the shipped head, docs/benchmarks.md)")
    add_prompt_source(p, "plain text to continue", "a user message, wrapped in the model's chat template")
    add_sampling(p)
    add_runtime(p)
    add_auto_profile(p)


def run(args):
    from .loading import check, load

    sp, trees = check(args, [args.tree], [args.draft])
    cfg, tree_name = trees[args.tree]
    profile = None
    if cfg.auto:
        profile = auto_profile(args)
    elif args.auto_profile:
        log.warning("--auto-profile is for the auto tree: --tree %s does not use it", args.tree)
    loaded = load(args, [args.draft], prompts=lambda tok: prompt_ids(tok, args, args.model))
    drafter, draft_name = loaded.drafters[args.draft]

    from ..engine import stream
    from ..text import TextStream

    text = TextStream(loaded.tokenizer, sys.stdout)
    metrics = None
    try:
        with loaded.packed():
            for out in stream(loaded.model, drafter, cfg, loaded.prompts, max_new_tokens=args.max_new_tokens,
                              temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                              seed=args.seed, attention_backend=args.backend, auto_profile=profile,
                              tokenizer=loaded.tokenizer, **generation_options(args)):
                text.push(out.tokens[0])
                metrics = out.metrics
    except KeyboardInterrupt:
        if text.text:
            print(flush=True)  # end the streamed line, so the interruption note starts its own
        raise
    text.push([], final=True)
    sys.stdout.write("\n")
    sys.stdout.flush()
    m = metrics
    print(f"[treespec] {m.num_generated} tokens in {m.total_seconds:.2f} s: {m.tokens_per_second:.1f} tokens/s, "
          f"mean accepted length {m.mean_accepted_length:.2f}, {m.num_steps} steps "
          f"(draft {draft_name}, tree {tree_name}"
          + (f", mean tree size {m.mean_tree_size:.1f} nodes" if cfg.auto else "") + ")", file=sys.stderr)
