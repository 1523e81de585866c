"""Whether two configurations of a bench journal wrote the same tokens, prompt by prompt, and
where they did not, whether HF generate's judge explains it.

    python benchmarks/figures/same_tokens.py benchmarks/results/compile6-gsm8k8-gguf.jsonl \\
        treespec-ar+compile smollm2-135m-instruct-eagle+lookup/auto+compile

Issue 48 asks that treespec's default give the tokens of treespec's own one-token decoding
(treespec-ar) on the same weights: two arithmetics (a tree bucket's products against a
one-token forward's) that round apart where two logits are within rounding. The bench judges
each configuration against HF generate in fp32 on the same weights (``divergences`` in the
journal): its first departure from HF generate, and every later token on its own prefix. Where
the judge calls both departures near-ties and finds every later token of both within its
tolerance of the fp32 choice, each of the two outputs is, token by token, a choice within
rounding of the fp32 model's on its own prefix, so where the two part from each other they part
at a near-tie: explained. Anything else is unexplained. Prints a line per prompt and a count;
exits 1 when a difference is unexplained.
"""

from __future__ import annotations

import argparse
import json
import sys


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def verdict(runs: dict, divergences: dict, a: str, b: str) -> tuple[str, bool]:
    """``(line, explained)`` for one prompt of the journal."""
    at = first_difference(runs[a]["tokens"], runs[b]["tokens"])
    if at is None:
        return "same tokens", True
    judged = []
    for name in (a, b):
        d = divergences.get(name)
        if d is None:  # no verdict: only an output equal to HF generate's needs none
            if runs[name]["tokens"] != runs["hf-generate"]["tokens"]:
                return f"differ at {at}; {name} differs from HF generate, unjudged: unexplained", False
            judged.append(f"{name} = HF generate")
            continue
        ok = d["fp32_shortfall"] <= d["tolerance"] and (d.get("later_shortfall") or 0.0) <= d["tolerance"]
        judged.append(f"{name} parts from HF generate at {d['position']} (fp32 shortfall {d['fp32_shortfall']:.3f}, "
                      f"later at most {d.get('later_shortfall') or 0.0:.3f}; tolerance {d['tolerance']})"
                      + ("" if ok else ": not a near-tie"))
        if not ok:
            return f"differ at {at}; " + "; ".join(judged) + ": unexplained", False
    return f"differ at {at}; " + "; ".join(judged) + ": near-ties", True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("journal")
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.journal)]
    key = next((r["key"] for r in rows if "key" in r), {})
    if (key.get("sampling") or {}).get("temperature", 0) not in (0, 0.0, None):
        print("a sampled run: outputs are not compared token for token", file=sys.stderr)
        return 2
    prompts = [r for r in rows if "runs" in r]
    bad = same = 0
    for r in prompts:
        if args.a not in r["runs"] or args.b not in r["runs"]:
            print(f"prompt {r['prompt']}: not run by both")
            continue
        line, explained = verdict(r["runs"], r.get("divergences", {}), args.a, args.b)
        same += line == "same tokens"
        bad += not explained
        print(f"prompt {r['prompt']}: {line}")
    compared = sum(args.a in r["runs"] and args.b in r["runs"] for r in prompts)
    print(f"{args.b} against {args.a}: {same} of {compared} prompts the same tokens, {bad} unexplained")
    if not compared:
        print(f"no prompt ran both {args.a} and {args.b}", file=sys.stderr)
    return 1 if bad or not compared else 0


if __name__ == "__main__":
    sys.exit(main())
