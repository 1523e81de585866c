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
template with that answer, as a chat server would) is answered (``--second-tokens``) with the
warm cache and without one, alternately; the time to first token
(``RequestMetrics.first_token_seconds``), the prompt tokens the cache served and the second
answer's tau (mean tokens per target forward: a hit must cost no acceptance) are compared, over
all questions and over those whose second turn has ``--long-history`` tokens or more.

Prints a table (the first line says where it ran) and, with ``--out``, writes the figures as
JSON with the command. Timings move with any other load on the cores: run on a quiet machine.
Feeds docs/runtime.md, "Prefix caching", "What it saves".
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
        got = {label: _call(model, draft, args, second, c, args.second_tokens) for label, c in order}
        req = {label: out.metrics.requests[0] for label, out in got.items()}
        per.append(dict(prompt_tokens=len(second), hit_tokens=req["with"].hit_tokens,
                        first_token_ms_with=1000 * req["with"].first_token_seconds,
                        first_token_ms_without=1000 * req["without"].first_token_seconds,
                        tau_with=got["with"].metrics.mean_accepted_length,
                        tau_without=got["without"].metrics.mean_accepted_length,
                        same_tokens=got["with"].sequences == got["without"].sequences))
    long = [r for r in per if r["prompt_tokens"] >= args.long_history]
    return dict(questions=len(per), first_turn_new_tokens=args.max_new_tokens, second_turn_new_tokens=args.second_tokens,
                median=_medians(per), long_history=args.long_history, long=dict(questions=len(long), median=_medians(long)),
                hit_share=sum(r["hit_tokens"] for r in per) / sum(r["prompt_tokens"] for r in per),
                same_tokens=sum(r["same_tokens"] for r in per), per_question=per)


def _medians(rows: list[dict]) -> dict:
    keys = ("first_token_ms_with", "first_token_ms_without", "tau_with", "tau_without")
    out = {k: statistics.median(r[k] for r in rows) if rows else None for k in keys}
    if rows:
        out["first_token_ratio"] = statistics.median(r["first_token_ms_with"] / r["first_token_ms_without"] for r in rows)
        out["tau_spread_without"] = statistics.pstdev(r["tau_without"] for r in rows)
        out["tau_mean_with"] = statistics.mean(r["tau_with"] for r in rows)
        out["tau_mean_without"] = statistics.mean(r["tau_without"] for r in rows)
    return out


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
    ap.add_argument("--max-new-tokens", type=int, default=512, help="mt-bench: the first turn's answer")
    ap.add_argument("--second-tokens", type=int, default=128, help="mt-bench: the second turn's answer")
    ap.add_argument("--long-history", type=int, default=500, help="mt-bench: a second turn this long or longer")
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
        print(f"MT-bench second turns (first answers of at most {result['first_turn_new_tokens']} tokens, second "
              f"{result['second_turn_new_tokens']}); the cache served {result['hit_share']:.0%} of their prompt tokens; "
              f"{result['same_tokens']} of {result['questions']} second answers identical with and without it")
        print("| second turns | n | median TTFT without, ms | with, ms | median ratio | tau without (mean, sd) | tau with |")
        print("|---|---|---|---|---|---|---|")
        for label, n, m in (("all", result["questions"], result["median"]),
                            (f">= {result['long_history']} tokens", result["long"]["questions"], result["long"]["median"])):
            if n:
                print(f"| {label} | {n} | {m['first_token_ms_without']:.0f} | {m['first_token_ms_with']:.0f} | "
                      f"{m['first_token_ratio']:.2f}x | {m['tau_mean_without']:.2f} (sd {m['tau_spread_without']:.2f}) | "
                      f"{m['tau_mean_with']:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command(__file__, argv), "machine": machine_line(), **result},
                                       indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
