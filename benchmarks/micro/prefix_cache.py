"""Prefix caching's prefill time: what a PrefixCache saves when prompts share a prefix.

    python benchmarks/micro/prefix_cache.py shared --requests 50 --system-tokens 1000
    python benchmarks/micro/prefix_cache.py mt-bench --num-prompts 16

``shared``: N requests, one generate call each, every prompt a system message of about
``--system-tokens`` tokens (GSM8K training questions, packaged) and its own user question
(GSM8K test). ``max_new_tokens=1``, so each call is its prefill (the target's forward,
``SpecMetrics.prefill_seconds``) and the drafter's start over the prompt; the N calls run
without a cache, then with one (its first call fills it), and the totals are compared.

``mt-bench``: Spec-Bench's MT-bench questions (two user turns each). Each question's first turn
is answered with the cache, then its second turn (the conversation re-rendered through the chat
template with that answer, as a chat server would) is prefilled with the warm cache and without
one, alternately; the time to first token (``RequestMetrics.first_token_seconds``) and the
prompt tokens the cache served are compared.

Prints a table (the first line says where it ran) and, with ``--out``, writes the figures as
JSON with the command. Timings move with any other load on the cores: run on a quiet machine.
Feeds no table yet (docs/runtime.md, "Prefix caching", describes the cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing


def _setup(args):
    import torch

    import treespec
    from treespec.models import load

    torch.set_num_threads(args.threads)
    model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    draft = args.draft if args.draft in ("ngram", "none") else treespec.load_draft(args.draft, model)
    return model, tok, draft


def _call(model, draft, args, ids, cache, max_new: int = 1):
    import treespec

    return treespec.generate(model, draft, args.tree, ids, max_new_tokens=max_new, prefix_cache=cache)


def shared(args) -> dict:
    """N requests sharing a long system prompt: total prefill time with and without a cache."""
    import treespec
    from treespec.data import load_dataset

    model, tok, draft = _setup(args)
    system, questions = [], [r["question"] for r in load_dataset("gsm8k-train")]
    while len(tok(" ".join(system))["input_ids"]) < args.system_tokens:
        system.append(questions[len(system)])
    system_text = " ".join(system)
    asks = [r["question"] for r in load_dataset("gsm8k-test")][: args.requests]
    prompts = [tok.apply_chat_template([{"role": "system", "content": system_text}, {"role": "user", "content": q}],
                                       add_generation_prompt=True, return_dict=False) for q in asks]
    _call(model, draft, args, prompts[0], None)  # warm-up: first-call costs out of both runs
    rows = {}
    for label, cache in (("without", None), ("with", treespec.PrefixCache(max_bytes=int(args.cache_mb * 2**20)))):
        runs = [_call(model, draft, args, p, cache).metrics for p in prompts]
        rows[label] = dict(prefill_seconds=sum(m.prefill_seconds for m in runs),
                           call_seconds=sum(m.total_seconds for m in runs),
                           median_first_token_ms=1000 * statistics.median(
                               m.requests[0].first_token_seconds for m in runs),
                           prompt_tokens=sum(m.requests[0].prompt_tokens for m in runs),
                           hit_tokens=sum(m.hit_tokens for m in runs))
    return dict(requests=len(prompts), system_prompt_tokens=len(tok(system_text)["input_ids"]),
                prompt_tokens=[min(map(len, prompts)), max(map(len, prompts))], runs=rows)


def mt_bench(args) -> dict:
    """MT-bench's second turns: time to first token with the first turn cached and without."""
    import treespec
    from treespec.prompts import load_bench_prompts

    model, tok, draft = _setup(args)
    prompts, _ = load_bench_prompts("spec-bench:conversation", tok, args.num_prompts)
    cache = treespec.PrefixCache(max_bytes=int(args.cache_mb * 2**20))
    _call(model, draft, args, list(prompts[0].ids), None)  # warm-up
    per = []
    for i, p in enumerate(prompts):
        first = _call(model, draft, args, list(p.ids), cache, args.max_new_tokens)
        second = p.next_turn(tok, [first.sequences[0]])
        order = [("with", cache), ("without", None)] if i % 2 == 0 else [("without", None), ("with", cache)]
        got = {label: _call(model, draft, args, second, c).metrics.requests[0] for label, c in order}
        per.append(dict(prompt_tokens=len(second), hit_tokens=got["with"].hit_tokens,
                        first_token_ms_with=1000 * got["with"].first_token_seconds,
                        first_token_ms_without=1000 * got["without"].first_token_seconds))
    med = {k: statistics.median(r[k] for r in per) for k in ("first_token_ms_with", "first_token_ms_without")}
    return dict(questions=len(per), first_turn_new_tokens=args.max_new_tokens, median=med,
                hit_share=sum(r["hit_tokens"] for r in per) / sum(r["prompt_tokens"] for r in per), per_question=per)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["shared", "mt-bench"])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-instruct-eagle", help="a head name or path, 'ngram' or 'none'")
    ap.add_argument("--tree", default="cpu-tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-mb", type=float, default=512.0, help="the PrefixCache's budget")
    ap.add_argument("--requests", type=int, default=50, help="shared: requests")
    ap.add_argument("--system-tokens", type=int, default=1000, help="shared: the system prompt's length")
    ap.add_argument("--num-prompts", type=int, default=16, help="mt-bench: questions")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="mt-bench: the first turn's answer")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)

    from benchmarks.timing import command, machine_line

    result = shared(args) if args.what == "shared" else mt_bench(args)
    print(machine_line(args.model, args.dtype, args.draft, args.tree))
    if args.what == "shared":
        print(f"{result['requests']} requests, system prompt {result['system_prompt_tokens']} tokens, prompts "
              f"{result['prompt_tokens'][0]}-{result['prompt_tokens'][1]} tokens, max_new_tokens=1")
        print("| cache | target prefill s | whole calls s | median time to first token ms | prompt tokens served |")
        print("|---|---|---|---|---|")
        for label, r in result["runs"].items():
            print(f"| {label} | {r['prefill_seconds']:.2f} | {r['call_seconds']:.2f} | "
                  f"{r['median_first_token_ms']:.0f} | {r['hit_tokens']} of {r['prompt_tokens']} |")
    else:
        m = result["median"]
        print(f"{result['questions']} MT-bench second turns (first answers of at most "
              f"{result['first_turn_new_tokens']} tokens): median time to first token "
              f"{m['first_token_ms_without']:.0f} ms without the cache, {m['first_token_ms_with']:.0f} ms with it; "
              f"the cache served {result['hit_share']:.0%} of the prompt tokens")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command(__file__, argv), "machine": machine_line(), **result},
                                       indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
