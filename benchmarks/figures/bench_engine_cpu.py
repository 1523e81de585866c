"""The engine benchmark: model-free and draft-model drafting against HF generate.

    python benchmarks/figures/bench_engine_cpu.py                  # 5 GSM8K test questions, 128 new tokens

Runs in one process, side by side on the same prompts (all configurations on question i
before question i+1), greedy, each output checked token for token against HF generate:

    HF generate (baseline)                 HF prompt lookup (prompt_lookup_num_tokens=3)
    treespec NgramDrafter, chain-3         treespec NgramDrafter, tree preset cpu
    treespec ModelDrafter, chain-3 and cpu-tiny, draft = the target's first 6 layers with
        its final norm and output head (``layers:6``: SmolLM2-135M is the smallest model
        with its vocabulary, so the draft model is an early exit of the target)

on SmolLM2-135M-Instruct. Writes ``benchmarks/results/cpu-engine-gsm8k.json`` and PNGs.
Other options are passed on to ``treespec bench``.

Feeds docs/benchmarks.md, "Model-free and draft-model drafting".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from treespec.cli import main as treespec_main  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=6)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args, extra = p.parse_known_args(argv)
    d = f"layers:{args.draft_layers}"
    configs = ["ngram@chain-3", "ngram@cpu", f"{d}@chain-3", f"{d}@cpu-tiny"]
    stem = "cpu-engine-gsm8k"
    return treespec_main([
        "bench", "--model", "smollm2-135m-instruct", "--dataset", "gsm8k",
        "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
        *[a for c in configs for a in ("--config", c)],
        "--out", str(args.out_dir / f"{stem}.json"), "--plot-dir", str(args.out_dir), "--plot-prefix", f"{stem}-",
        *extra,
    ])


if __name__ == "__main__":
    sys.exit(main())
