"""What verification's processing costs under top-p sampling, three ways in one run, prompt
by prompt, same seed (the same tokens, asserted): every tree node processed with
transformers' top-p (before), the accepted path's nodes alone (``RequestDecoding.choose_reached_nodes``), and
the path with the sort-free top-p (``SortFreeTopP``, now).

    python benchmarks/micro/sampling_walk.py --num-prompts 6 --max-new-tokens 128 --top-p 0.95
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if "treespec" not in sys.modules and not any("treespec" in p for p in sys.path[1:]):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's treespec

import torch  # noqa: E402

import treespec  # noqa: E402
from treespec.drafters import HybridDrafter  # noqa: E402
from treespec.machine import machine_info  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears  # noqa: E402
from transformers import TopPLogitsWarper  # noqa: E402

from treespec.accept import RequestDecoding  # noqa: E402
from treespec.processing import SortFreeTopP  # noqa: E402
from treespec.prompts import load_prompts  # noqa: E402


def every_node(self, history, logits, tree):  # before: the processors at every node of the tree
    return self.choose_all_nodes(history, logits, tree)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="cpu")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m-instruct", dtype=torch.bfloat16)
    prompts = load_prompts(args.dataset, tok, args.num_prompts)[0]
    walk, sort_free = RequestDecoding.choose_reached_nodes, SortFreeTopP.__call__
    variants = {"every node": (every_node, TopPLogitsWarper.__call__), "path only": (walk, TopPLogitsWarper.__call__),
                "path, sort-free top-p": (walk, sort_free)}
    rows = {name: [] for name in variants}
    with PackedLinears(model):
        draft = HybridDrafter(treespec.load_draft("smollm2-135m-instruct-eagle", model))
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
        treespec.generate(model, draft, args.tree, prompts[0], seed=0, **kw)  # warm-up
        for i, prompt in enumerate(prompts):
            outs = []
            for name, (fn, top_p) in variants.items():
                RequestDecoding.choose_reached_nodes, SortFreeTopP.__call__ = fn, top_p
                try:
                    t = time.perf_counter()
                    out = treespec.generate(model, draft, args.tree, prompt, seed=i, **kw)
                    dt = time.perf_counter() - t
                finally:
                    RequestDecoding.choose_reached_nodes, SortFreeTopP.__call__ = walk, sort_free
                m = out.metrics
                rows[name].append(dict(tokens=m.num_generated, seconds=dt, steps=m.num_steps,
                                       verify_ms=m.verify_seconds / m.num_steps * 1e3))
                outs.append(out.sequences[0])
            assert all(o == outs[0] for o in outs), f"prompt {i}: a variant changed the tokens"
    res = {"machine": machine_info(), "settings": vars(args), "rows": rows}
    for name, r in rows.items():
        tps = sum(x["tokens"] for x in r) / sum(x["seconds"] for x in r)
        res[name] = dict(tokens_per_second=tps, median_verify_ms=statistics.median(x["verify_ms"] for x in r))
        print(f"{name:>21}: {tps:6.1f} tok/s, verify {res[name]['median_verify_ms']:.1f} ms/step (median)")
    for name in list(variants)[1:]:
        print(f"{name} / every node: {res[name]['tokens_per_second'] / res['every node']['tokens_per_second']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
