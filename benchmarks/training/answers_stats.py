"""What capture folders' answers files hold: conversations, answer tokens, and the answers that
stop short of their own length limit without an end of sequence (cut at their batch's limit by
captures decoded before 2026-12-04). Reads answers files only.

    python benchmarks/training/answers_stats.py benchmarks/data/captures/cap-all runs/cap-chat \\
        benchmarks/data/captures/cap-magpie:1336      # FOLDER:N: its first N conversations

Feeds docs/training.md ("Self-distillation at scale": the cut share; "Which prompts": answer tokens).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

EOS = 2  # SmolLM2's end of sequence


def main() -> None:
    for arg in sys.argv[1:]:
        folder, _, n = arg.partition(":")
        cfg = json.loads((Path(folder) / "capture.json").read_text())
        rows = [json.loads(line) for f in sorted(Path(folder).glob("answers-*.jsonl.gz")) for line in gzip.open(f, "rt")]
        rows = [r for r in rows if not n or r["index"] < int(n)]
        cut = sum(r["answer"][-1] != EOS and len(r["answer"]) < min(cfg["max_new_tokens"],
                                                                     cfg["max_length"] - r["prompt_len"]) for r in rows)
        tokens = sum(len(r["answer"]) for r in rows)
        print(f"{arg}: {len(rows)} conversations, {tokens} answer tokens, {cut} cut short ({cut / len(rows):.1%})")


if __name__ == "__main__":
    main()
