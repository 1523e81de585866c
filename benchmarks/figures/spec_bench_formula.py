"""Spec-Bench's own speedups from a ``treespec bench`` report of Spec-Bench questions (its
JSON), for reports written before the bench computed them.

    python benchmarks/figures/spec_bench_formula.py benchmarks/results/specbench10-256-bf16-head6.json

Spec-Bench (evaluation/speed.py) divides the mean of each question's tokens/s by the baseline's
mean, and its "Overall" does so over every question; the bench's ``speedup`` per category is
total tokens over total seconds, and its ``overall_speedup`` the mean of the six categories'
speedups. Prints both for each configuration, per category and overall; reads the report only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BASE = "hf-generate"


def formula(report: dict) -> dict:
    """``{config: {category or "overall": {"speedup": pooled, "spec_bench": Spec-Bench's}}}``."""
    prompts = report["prompts"]
    groups = {c: [p for p in prompts if p["category"] == c] for c in dict.fromkeys(p["category"] for p in prompts)}
    groups["overall"] = prompts
    out = {}
    for c in report["configs"]:
        name, rows = c["name"], {}
        for cat, ps in groups.items():
            mine = [p["results"][name] for p in ps]
            base = [p["results"][BASE] for p in ps]
            pooled = (sum(r["new_tokens"] for r in mine) / sum(r["seconds"] for r in mine)) / (
                sum(r["new_tokens"] for r in base) / sum(r["seconds"] for r in base))
            spec_bench = sum(r["tokens_per_second"] for r in mine) / sum(r["tokens_per_second"] for r in base)
            rows[cat] = {"speedup": pooled if cat != "overall" else c["overall_speedup"], "spec_bench": spec_bench}
        out[name] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    args = ap.parse_args()
    for name, rows in formula(json.loads(Path(args.report).read_text())).items():
        cells = ", ".join(f"{cat} {r['speedup']:.2f}x / {r['spec_bench']:.2f}x" for cat, r in rows.items())
        print(f"{name}: {cells}")


if __name__ == "__main__":
    main()
