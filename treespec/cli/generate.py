"""``treespec generate``: one prompt, the text streamed to stdout as steps commit it, a summary
line on stderr."""

from __future__ import annotations

import sys

from .common import add_auto_profile, add_model, add_pair, add_runtime, add_sampling
from .prompt_source import add_prompt_source, add_system, prompt_ids, read_message


def add_arguments(p):
    p.description = ("Generate with tree speculation: the text streams to stdout as it is committed, a summary "
                     "line goes to stderr. The prompt: --prompt, --chat, --prompt-file, or text piped to stdin "
                     "(echo 'Tell me about Paris' | treespec generate); else a built-in one, shown on stderr.")
    add_model(p)
    add_pair(p)
    src = add_prompt_source(p, "plain text to continue", "a user message, wrapped in the model's chat template")
    src.add_argument("--prompt-file", metavar="FILE",
                     help="a user message read from FILE (UTF-8), as --chat (plain text if the model has no chat "
                          "template); text piped to stdin is read the same way when no prompt flag is given")
    add_system(p, "with --chat, --prompt-file, stdin or the built-in message, through the chat template")
    p.add_argument("--allow-past-context", action="store_true",
                   help="generate even when the prompt is longer than the model's context (max_position_embeddings; "
                        "refused otherwise) or the answer may run past it: the text degrades there")
    add_sampling(p)
    add_runtime(p, compile=True)
    add_auto_profile(p)


def run(args):
    from .loading import check, load, stream_options

    sp, trees = check(args, [args.tree], [args.draft], then=[lambda: read_message(args)])
    cfg, tree_name = trees[args.tree]
    options = stream_options(args, sp, cfg)
    loaded = load(args, [args.draft], prompts=lambda tok: prompt_ids(tok, args, args.model))
    drafter, draft_name = loaded.drafters[args.draft]

    from ..engine import stream
    from ..text import TextStream

    text = TextStream(loaded.tokenizer, sys.stdout)
    metrics = None
    try:
        with loaded.packed():
            for out in stream(loaded.model, drafter, cfg, loaded.prompts, tokenizer=loaded.tokenizer,
                              allow_past_context=args.allow_past_context, **options):
                text.push(out.tokens[0])
                metrics = out.metrics
    except KeyboardInterrupt:
        if text.text:
            print(flush=True)  # end the streamed line, so the interruption note starts its own
        raise
    text.push([], final=True)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary(metrics, len(loaded.prompts), draft_name, tree_name, cfg.auto), file=sys.stderr)


def summary(m, prompt_tokens: int, draft_name: str, tree_name: str, auto: bool) -> str:
    """The closing line: decoding's rate apart from the prompt's prefill, whose rate depends
    on the prompt's length and nothing of speculation."""
    decoded = m.num_generated - 1  # prefill makes the first token
    prefill_rate = prompt_tokens / m.prefill_seconds if m.prefill_seconds > 0 else 0.0
    return (f"[treespec] {m.num_generated} tokens in {m.total_seconds:.2f} s: decoding {m.decode_tokens_per_second:.1f} "
            f"tokens/s ({decoded} tokens in {m.decode_seconds:.2f} s), prefill {prefill_rate:.0f} "
            f"tokens/s ({prompt_tokens} prompt tokens and the first new one in {m.prefill_seconds:.2f} s); mean "
            f"accepted length {m.mean_accepted_length:.2f}, {m.num_steps} steps (draft {draft_name}, tree {tree_name}"
            + (f", mean tree size {m.mean_tree_size:.1f} nodes" if auto else "") + ")")
