"""The draft's share of a decoding step, and what verification costs, variant by variant in
one run (issue 29): every prompt through each variant in turn, the shipped head with prompt
lookup and the default ``auto`` tree, greedy, packed weights.

Variants (``--variants``, in the order given):
  ``general``   the batch-planned EAGLE pass every request took before the lean one, and
                greedy verification's argmax over every row of the tree;
  ``lean``      the lean single-request pass (``RowPasses``), argmax over every row;
  ``lean+path`` the lean pass, and greedy verification's argmax over the rows it reaches alone,
                widened to fp32 (``RequestDecoding.choose_reached_nodes``: the default now).
All draft the same trees (tests/drafters/test_eagle_passes.py) and verify to the same verdicts
(tests/unit/test_processing.py), so only the time differs, except where ``auto`` sizes a tree from
the step's measured times. Per variant: draft and verify milliseconds per step, the draft's
share of the decode time, tokens per second, and the medians over prompts.

    python benchmarks/micro/draft_share.py --num-prompts 50 --max-new-tokens 256 \\
        --variants general,lean --out benchmarks/results/draft-share-gsm8k50.json

Feeds docs/benchmarks.md, "The draft's share of a step". Timing: run it with nothing else on
the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402

import treespec  # noqa: E402
from benchmarks.timing import command, machine_line  # noqa: E402
from treespec.drafters import HybridDrafter  # noqa: E402
from treespec.drafters import eagle  # noqa: E402
from treespec.drafters.eagle_passes import RowPasses  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears  # noqa: E402
from treespec.accept import RequestDecoding  # noqa: E402
from treespec.prompts import load_prompts  # noqa: E402

VARIANTS = ("general", "lean", "lean+path")


class _Switch:
    """Whether new EAGLE sessions take the lean pass, and whether greedy verification takes the
    argmax of the reached rows alone (both on by default)."""

    def __init__(self):
        self.lean = self.path = True
        start, walk = eagle.EagleSession.__init__, RequestDecoding.choose_reached_nodes
        switch = self

        def init(session, *a, **kw):
            start(session, *a, **kw)
            if not switch.lean and isinstance(session.passes, RowPasses):  # the packed pass instead
                session.passes = session.passes.fallback

        def every_row(decoding, history, logits, tree):  # before: the argmax of every row, in their dtype
            if switch.path or decoding.processor or not decoding.greedy:
                return walk(decoding, history, logits, tree)
            return decoding.choose_all_nodes(history, logits, tree)

        eagle.EagleSession.__init__ = init
        RequestDecoding.choose_reached_nodes = every_row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tree", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--no-pack", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = args.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variant(s) {', '.join(bad)}: choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    head = treespec.load_draft("smollm2-135m-instruct-eagle", model)
    draft = HybridDrafter(head)
    prompts, _ = load_prompts(args.dataset, tok, args.num_prompts)
    switch = _Switch()
    packed = PackedLinears(model, head.head) if not args.no_pack else None
    rows = {v: [] for v in variants}
    same = True
    print(machine_line(args.dtype, "packed" if packed else "plain weights"), flush=True)
    with packed or contextlib.nullcontext():
        treespec.generate(model, draft, args.tree, prompts[0], max_new_tokens=16)  # warm-up
        for i, p in enumerate(prompts):
            outs = []
            for v in variants:
                switch.lean, switch.path = v != "general", v == "lean+path"
                m = (out := treespec.generate(model, draft, args.tree, p, max_new_tokens=args.max_new_tokens)).metrics
                outs.append(out.sequences[0])
                rows[v].append({"draft_s": m.draft_seconds, "verify_s": m.verify_seconds,
                                "decode_s": m.decode_seconds, "steps": m.num_steps, "tokens": m.num_generated,
                                "seconds": m.total_seconds})
            same &= all(o == outs[0] for o in outs)
            print(f"{i + 1}/{len(prompts)} " + ", ".join(
                f"{v} draft {1e3 * rows[v][-1]['draft_s'] / max(rows[v][-1]['steps'], 1):.1f} ms/step"
                for v in variants), flush=True)
    res = {"command": command("benchmarks/micro/draft_share.py", sys.argv[1:]),
           "machine": machine_line(args.dtype), "dataset": args.dataset, "tree": args.tree,
           "draft": "smollm2-135m-instruct-eagle+lookup", "packed": packed is not None, "same_tokens": same,
           "variants": {}}
    for v in variants:
        r = rows[v]
        steps = sum(x["steps"] for x in r)
        draft, verify, decode = (sum(x[k] for x in r) for k in ("draft_s", "verify_s", "decode_s"))
        res["variants"][v] = {
            "draft_ms_per_step": round(1e3 * draft / steps, 2),
            "verify_ms_per_step": round(1e3 * verify / steps, 2),
            "step_ms": round(1e3 * decode / steps, 2),
            "draft_share": round(draft / decode, 4),
            "draft_share_median": round(statistics.median(x["draft_s"] / x["decode_s"] for x in r), 4),
            "tokens_per_s": round(sum(x["tokens"] for x in r) / sum(x["seconds"] for x in r), 2),
            "tokens_per_s_median": round(statistics.median(x["tokens"] / x["seconds"] for x in r), 2),
            "tau": round((sum(x["tokens"] for x in r) - len(r)) / steps, 3),
        }
    print(f"{'variant':9} {'draft ms/step':>13} {'verify ms/step':>14} {'step ms':>8} {'share':>6} "
          f"{'median share':>12} {'tok/s':>6} {'tau':>5}")
    for v, s in res["variants"].items():
        print(f"{v:9} {s['draft_ms_per_step']:13.2f} {s['verify_ms_per_step']:14.2f} {s['step_ms']:8.2f} "
              f"{s['draft_share']:6.3f} {s['draft_share_median']:12.3f} {s['tokens_per_s']:6.2f} {s['tau']:5.2f}")
    print(f"same tokens: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
