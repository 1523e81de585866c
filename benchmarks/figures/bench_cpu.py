"""The shipped pair against HF generate and prompt lookup on GSM8K test, in one command.

Run from the repository root (installed or not):

    python benchmarks/figures/bench_cpu.py                    # 50 GSM8K test questions: 7 configs x 50 x 256 tokens, long
    python benchmarks/figures/bench_cpu.py --num-prompts 10   # a quicker look

It runs, in one process and side by side on the same prompts (every configuration on
question i before question i+1):

    HF generate (greedy, the baseline)     HF prompt lookup (prompt_lookup_num_tokens=3)
    treespec ngram chain-3                 treespec ngram, tree preset cpu
    treespec EAGLE head chain-4            treespec EAGLE head, presets cpu and cpu-tiny

on SmolLM2-135M-Instruct (``smollm2-135m-instruct``, fetched on first use) with its shipped
EAGLE-3 head (``smollm2-135m-instruct-eagle``), the first N questions of GSM8K test
(packaged with treespec, ``treespec.data``; chat template), 256 new tokens, greedy; each output is
checked token for token against HF generate's. It writes

    benchmarks/results/cpu-<model>-gsm8k.json                     machine, command, per-config and per-prompt figures
    benchmarks/results/cpu-<model>-gsm8k-acceptance_by_position.png
    benchmarks/results/cpu-<model>-gsm8k-tokens_per_second.png

and prints the table. Keep the machine otherwise idle while it runs: the figures are wall
times. ``--model`` and ``--head`` swap the pair (e.g. ``--model
shared/models/stories260K.gguf --head DIR`` for a smoke test); any other option is passed on
to ``treespec bench`` (``--threads 2``, ``--no-warmup``, ...). The exit status is ``treespec bench``'s: 1 when a treespec output
differs from HF generate's.

Feeds no docs table now: the CPU sections of docs/benchmarks.md come from
benchmarks/figures/cpu_figures.sh and the commands they show.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from treespec.cli import main as treespec_main  # noqa: E402

PROMPT_LOOKUP_TOKENS = 3  # the same draft length as treespec's ngram chain-3


def bench_argv(model: str, head: str, num_prompts: int, max_new_tokens: int, out_dir: Path) -> list[str]:
    """The ``treespec bench`` arguments of the published CPU run."""
    stem = f"cpu-{Path(model).name}-gsm8k"
    configs = ["ngram@chain-3", "ngram@cpu", f"{head}@chain-4", f"{head}@cpu", f"{head}@cpu-tiny"]
    return [
        "bench", "--model", model, "--dataset", "gsm8k", "--num-prompts", str(num_prompts),
        "--max-new-tokens", str(max_new_tokens), "--lookup-tokens", str(PROMPT_LOOKUP_TOKENS),
        *[a for c in configs for a in ("--config", c)],
        "--out", str(out_dir / f"{stem}.json"), "--plot-dir", str(out_dir), "--plot-prefix", f"{stem}-",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="other options are passed on to treespec bench")
    p.add_argument("--num-prompts", type=int, default=50, help="first N GSM8K test questions (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--head", default="smollm2-135m-instruct-eagle", help="EAGLE head name or directory")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args, extra = p.parse_known_args(argv)
    return treespec_main(bench_argv(args.model, args.head, args.num_prompts, args.max_new_tokens, args.out_dir) + extra)


if __name__ == "__main__":
    sys.exit(main())
