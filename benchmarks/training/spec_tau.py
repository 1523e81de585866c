"""Mean accepted tokens (tau) per Spec-Bench category of one or more EAGLE heads, on fixed
trees, greedy: how heads trained on different data compare where users ask (issue 26).

tau counts tokens per verify forward; it does not depend on the machine's load, so this runs
beside other jobs. Fixed trees only (``auto`` follows measured times). Each head runs alone
and with prompt lookup grafted on (``+lookup``, the shipped default drafter). MT-bench's
questions (``conversation``) run both turns, the second after the target's own first answer,
as Spec-Bench does; ``--extra gsm8k,humaneval`` adds those sets as columns (``gsm8k:50``: its
first 50), ``--no-spec-bench`` runs them alone.

    python benchmarks/training/spec_tau.py --head smollm2-135m-instruct-eagle --head runs/ft/head \\
        --num-prompts 10 --max-new-tokens 128 --out benchmarks/results/spec-tau.json

Feeds docs/training.md, "Heads on Spec-Bench".
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

if "treespec" not in sys.modules and not any("treespec" in p for p in sys.path[1:]):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's treespec

import torch  # noqa: E402

import treespec  # noqa: E402
from treespec.drafters import HybridDrafter  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.prompts import SPEC_BENCH_CATEGORIES, load_bench_prompts  # noqa: E402


def run_set(model, tok, draft, tree, prompts, max_new) -> tuple[int, int, list[list[int]]]:
    """``(accepted tokens, verify steps, outputs)`` over ``prompts``, every turn of each."""
    accepted = steps = 0
    outputs = []
    for p in prompts:
        answers = []
        for turn in range(p.num_turns):
            ids = list(p.ids) if turn == 0 else p.next_turn(tok, answers)
            out = treespec.generate(model, draft, tree, ids, max_new_tokens=max_new)
            accepted += out.metrics.num_generated - 1  # the first token comes from the prefill
            steps += out.metrics.num_steps
            answers.append(out.sequences[0])
            outputs.append(out.sequences[0])
    return accepted, steps, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", action="append", required=True, help="a shipped head's name or a folder (repeatable)")
    ap.add_argument("--tree", action="append", default=None, help="fixed tree (repeatable; default chain-3 and cpu)")
    ap.add_argument("--num-prompts", type=int, default=10, help="questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--extra", default="",
                    help="more datasets as columns, e.g. gsm8k,humaneval; NAME:N for its first N "
                         "(default --num-prompts)")
    ap.add_argument("--no-spec-bench", action="store_true", help="the --extra sets alone")
    ap.add_argument("--no-lookup", action="store_true", help="the heads alone only")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m-instruct", dtype=torch.bfloat16)
    cats = () if args.no_spec_bench else SPEC_BENCH_CATEGORIES
    sets = {c: load_bench_prompts(f"spec-bench:{c}", tok, args.num_prompts)[0] for c in cats}
    for spec in filter(None, args.extra.split(",")):
        name, _, n = spec.partition(":")
        sets[name] = load_bench_prompts(name, tok, int(n) if n else args.num_prompts)[0]
    if not sets:
        ap.error("nothing to run: --no-spec-bench needs --extra")
    trees = args.tree or ["chain-3", "cpu"]
    res = {"dtype": "bfloat16", "num_prompts": {k: len(v) for k, v in sets.items()},
           "max_new_tokens": args.max_new_tokens,
           "tau": {}, "outputs_equal": {}}
    first_outputs = {}
    for head_name in args.head:
        head = treespec.load_draft(head_name, model)
        drafts = [(head_name, head)] + ([] if args.no_lookup else [(f"{head_name}+lookup", HybridDrafter(head))])
        for dname, draft in drafts:
            for tree in trees:
                row = {}
                t0 = time.time()
                for sname, prompts in sets.items():
                    acc, steps, outs = run_set(model, tok, draft, tree, prompts, args.max_new_tokens)
                    row[sname] = round(acc / max(steps, 1), 3)
                    # Greedy: every head and tree gives the target's tokens (bf16 near-ties aside).
                    ref = first_outputs.setdefault(sname, outs)
                    res["outputs_equal"].setdefault(sname, []).append(sum(a == b for a, b in zip(ref, outs)))
                if cats:
                    row["overall"] = round(sum(row[c] for c in cats) / len(cats), 3)
                res["tau"][f"{dname} @ {tree}"] = row
                print(f"{dname} @ {tree}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items())
                      + f" ({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
