"""Where a decoding step's draft time goes (issue 29): the default drafter (the shipped head with
prompt lookup) and tree, greedy, packed weights, under cProfile; milliseconds a step per part.

    python benchmarks/micro/draft_profile.py --num-prompts 6 --max-new-tokens 128 --threads 2

Parts (cumulative times of these functions, divided by the decoding steps; cProfile's own
overhead inflates every part, so read them as shares, not as the draft's time):
  head forwards   the session's pass strategy (RowPasses.run for one request on a CPU): the head's
                  layer over a level's frontier or a commit's tokens
  output layer    EagleHead.logits: the draft's norm and vocabulary product
  builder         build_trees without the head's steps and the stop rule (top-k, gathers, the pool)
  stop rule       AutoController.stop (auto's decision after each level)
  lookup          the n-gram drafter's proposal and its graft onto the head's tree
  choose          AutoController.choose (the tree cut to its best prefix)
  draft           the engine's whole draft call, and the head's commit after verification
Feeds docs/benchmarks.md, "The draft's share of a step". Run it with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import treespec  # noqa: E402
from benchmarks.timing import command, machine_line  # noqa: E402
from treespec.drafters import HybridDrafter  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears  # noqa: E402
from treespec.prompts import load_prompts  # noqa: E402

# part -> (file suffix, function name) whose cumulative time it is
PARTS = {
    "draft": ("treespec/engine/loop.py", "_draft"),
    "head commit": ("treespec/drafters/eagle.py", "commit"),
    "head forwards": ("treespec/drafters/eagle_passes.py", "run"),
    "output layer": ("treespec/drafters/eagle_head.py", "logits"),
    "builder": ("treespec/builder.py", "build_dynamic_trees"),
    "head steps": ("treespec/drafters/eagle.py", "step"),
    "stop rule": ("treespec/auto.py", "stop"),
    "lookup": ("treespec/drafters/ngram.py", "propose"),
    "graft": ("treespec/drafters/hybrid.py", "merge_trees"),
    "choose": ("treespec/auto.py", "choose"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m-instruct", dtype=torch.bfloat16)
    head = treespec.load_draft("smollm2-135m-instruct-eagle", model)
    draft = HybridDrafter(head)
    prompts, _ = load_prompts(args.dataset, tok, args.num_prompts)
    steps = 0
    with PackedLinears(model, head.head):
        treespec.generate(model, draft, args.tree, prompts[0], max_new_tokens=16)  # warm-up
        prof = cProfile.Profile()
        prof.enable()
        for p in prompts:
            steps += treespec.generate(model, draft, args.tree, p, max_new_tokens=args.max_new_tokens).metrics.num_steps
        prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)
    ms = {}
    for part, (suffix, name) in PARTS.items():
        hits = [(v[0], v[3]) for (f, _, n), v in stats.items() if f.endswith(suffix) and n == name]
        ms[part] = {"calls_per_step": round(sum(c for c, _ in hits) / steps, 2),
                    "ms_per_step": round(1e3 * sum(t for _, t in hits) / steps, 3)}
    # The builder's own work: its cumulative time less the head's steps and the stop rule it calls.
    own = ms["builder"]["ms_per_step"] - ms["head steps"]["ms_per_step"] - ms["stop rule"]["ms_per_step"]
    ms["builder (own)"] = {"calls_per_step": ms["builder"]["calls_per_step"], "ms_per_step": round(own, 3)}
    print(machine_line("bfloat16", "packed"))
    print(f"{steps} steps; cProfile's overhead included")
    for part, v in ms.items():
        print(f"{part:15} {v['ms_per_step']:7.2f} ms a step  ({v['calls_per_step']:.2f} calls)")
    if args.out:
        res = {"command": command("benchmarks/micro/draft_profile.py", sys.argv[1:]), "machine": machine_line("bfloat16"),
               "steps": steps, "parts": ms}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
