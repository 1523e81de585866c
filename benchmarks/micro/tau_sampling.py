"""Mean accepted length (tau) under sampling, the shipped head alone on GSM8K test questions.

Feeds docs/generation.md, "Sampling and acceptance": run it on a checkout from before the
engine sampled by Gumbel-max noise (rejection sampling) and on this one, and compare.
tau depends only on the tokens, not on timing, so a busy machine does not change it.

    python benchmarks/micro/tau_sampling.py --num-prompts 10 --out benchmarks/results/tau-sampling-gumbel.json
    PYTHONPATH=<old checkout> python benchmarks/micro/tau_sampling.py --num-prompts 10 --out ...-rejection.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if "treespec" not in sys.modules and not any("treespec" in p for p in sys.path[1:]):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's treespec

import torch  # noqa: E402

import treespec  # noqa: E402
from treespec.data import load_dataset  # noqa: E402
from treespec.models import load  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m-instruct", dtype=torch.bfloat16)
    head = treespec.load_draft("smollm2-135m-instruct-eagle", model)
    ids = [tok.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                   return_dict=False) for r in load_dataset("gsm8k-test", args.num_prompts)]
    res = {"treespec": treespec.__file__, "num_prompts": len(ids), "max_new_tokens": args.max_new_tokens, "tau": {}}
    for temperature in (0.7, 1.0):
        for tree in ("chain-3", "cpu"):
            accepted = steps = 0
            for i, prompt in enumerate(ids):  # prompt i sampled with seed i
                m = treespec.generate(model, head, tree, prompt, max_new_tokens=args.max_new_tokens,
                                      temperature=temperature, seed=i).metrics
                accepted += m.num_generated - 1  # the first token comes from the prefill
                steps += m.num_steps
            res["tau"][f"T={temperature} {tree}"] = round(accepted / steps, 3)
            print(f"T={temperature} {tree}: tau {accepted / steps:.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
