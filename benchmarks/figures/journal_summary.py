"""What a Spec-Bench bench journal holds so far, per category: a run of hours (the 480
questions, issue 26) spans sessions, and its figures are worth reading before it ends.

    python benchmarks/figures/journal_summary.py benchmarks/results/specbench480-256-bf16-head5.jsonl \\
        --num-prompts 80 --out benchmarks/results/specbench480-256-bf16-head5-partial.json

Per category: the questions journaled (of ``--num-prompts``), each configuration's tokens/s and
speedup over plain HF generate and over the same-path baseline (the faster of HF generate on
plain and on packed weights; total tokens over total seconds, as ``treespec bench`` computes
them), Spec-Bench's own speedup (the mean of per-question tokens/s over the baseline's mean, its
evaluation/speed.py), mean accepted tokens, how many outputs left HF
generate's and how many of those were not bf16 near-ties (``unexplained``), and for every pair of
treespec configurations their ratio pooled and the per-question median and range. With
``--mt-bench``, also conversation's eight MT-bench categories apart (``conversation:writing``,
...; ten questions each in the 480 run). ``overall``: the mean of the six categories' speedups
and Spec-Bench's "Overall" (its ratio over every question). Reads the journal only (no model):
timings are the run's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from treespec.prompts import spec_bench_questions  # noqa: E402

BASE, PACKED = "hf-generate", "hf-generate+fast"
CATEGORIES = ("conversation", "translation", "summarization", "qa", "math_reasoning", "rag")


def rate(runs: list[dict]) -> float:
    """Tokens over seconds (a run journals its tokens themselves)."""
    return sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs)


def spec_bench(runs: list[dict], base: list[dict]) -> float:
    """Spec-Bench's speedup: the mean of each question's tokens/s over the baseline's mean."""
    return sum(rate([r]) for r in runs) / sum(rate([b]) for b in base)


def summarise(path: Path, num_prompts: int, mt_bench: bool = False) -> dict:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    head, rows = lines[0]["key"], lines[1:]
    names = [c["name"] for c in head["configs"]]
    questions = spec_bench_questions("spec-bench", num_prompts)
    if not head["prompts"].startswith(f"{len(questions)} prompts,"):
        raise SystemExit(f"{path} journals {head['prompts']}, not {len(questions)}: give its --num-prompts")
    labels = [[q["category"]] + ([f"{q['category']}:{q['mt_bench_category']}"] if mt_bench and "mt_bench_category" in q
                                 else []) for q in questions]  # the groups each question counts in
    treespec = [c["name"] for c in head["configs"] if c["kind"] == "treespec"]
    out = {"journal": str(path), "machine": head["machine"], "configs": names, "categories": {}}
    for cat in dict.fromkeys(label for ls in labels for label in ls):
        done = [r for r in rows if cat in labels[r["prompt"]]]
        if not done:
            continue
        per = {n: [r["runs"][n] for r in done] for n in names}
        base = rate(per[BASE])
        same = max(rate(per[n]) for n in (BASE, PACKED) if n in per)  # per category (the bench: over the run)
        c = {"num_prompts": len(done), "of": sum(cat in ls for ls in labels), "configs": {}}
        for n in names:
            acc = [a for run in per[n] if run["metrics"] for a in run["metrics"]["accepted"]]
            diffs = [r["divergences"][n] for r in done if n in r["divergences"]]
            c["configs"][n] = {"tokens_per_second": round(rate(per[n]), 2),
                               "speedup": round(rate(per[n]) / base, 4),
                               "over_same_path": round(rate(per[n]) / same, 4),
                               "spec_bench_speedup": round(spec_bench(per[n], per[BASE]), 4),
                               "tau": round((sum(acc) + len(acc)) / len(acc), 3) if acc else None,
                               # outputs leaving HF generate's, and those past the near-tie tolerance
                               "differences": len(diffs),
                               "unexplained": sum(max(d["fp32_shortfall"], d.get("later_shortfall", 0.0))
                                                  > d["tolerance"] for d in diffs)}
        pairs = {}
        for i, a in enumerate(treespec):
            for b in treespec[i + 1:]:
                q = [rate([ra]) / rate([rb]) for ra, rb in zip(per[a], per[b])]
                pairs[f"{a} / {b}"] = {"pooled": round(rate(per[a]) / rate(per[b]), 3),
                                       "median": round(statistics.median(q), 3),
                                       "range": [round(min(q), 2), round(max(q), 2)]}
        c["ratios"] = pairs
        out["categories"][cat] = c
    cats = [out["categories"][k] for k in CATEGORIES if k in out["categories"]]
    if len(cats) == len(CATEGORIES):
        every = {n: [r["runs"][n] for r in rows] for n in names}
        out["overall"] = {n: {"speedup": round(sum(c["configs"][n]["speedup"] for c in cats) / len(cats), 4),
                              "spec_bench_speedup": round(spec_bench(every[n], every[BASE]), 4)} for n in names}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("journal")
    ap.add_argument("--num-prompts", type=int, default=80, help="the run's --num-prompts (per category)")
    ap.add_argument("--mt-bench", action="store_true", help="also conversation's MT-bench categories apart")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = summarise(Path(args.journal), args.num_prompts, args.mt_bench)
    for cat, c in res["categories"].items():
        print(f"{cat}: {c['num_prompts']} of {c['of']} questions")
        for n, f in c["configs"].items():
            tau = f" tau {f['tau']:.2f}" if f["tau"] is not None else ""
            print(f"  {n:45} {f['tokens_per_second']:6.1f} tok/s {f['speedup']:5.2f}x "
                  f"({f['over_same_path']:.2f}x same path, {f['spec_bench_speedup']:.2f}x Spec-Bench's){tau}; "
                  f"{f['differences']} differ from HF generate, "
                  f"{f['unexplained']} unexplained")
        for pair, r in c["ratios"].items():
            print(f"  {pair}: pooled {r['pooled']:.3f}, per question median {r['median']:.3f} "
                  f"({r['range'][0]}-{r['range'][1]})")
    for n, f in res.get("overall", {}).items():
        print(f"overall {n:45} {f['speedup']:.2f}x (mean of the six), {f['spec_bench_speedup']:.2f}x (Spec-Bench's)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
