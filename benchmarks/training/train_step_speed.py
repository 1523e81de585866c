"""Time one training step of the EAGLE-3 head (forward + backward of the training-time-test
loss, 3 steps, batch of 8 captured conversations) in fp32 and under bf16 autocast, in
alternation, on one capture's conversations.

    python benchmarks/training/train_step_speed.py --capture runs/cap-val --threads 1

Feeds docs/training.md, "What it does" (step 5, bf16 autocast).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402

from benchmarks.timing import Timer, machine_line  # noqa: E402
from treespec.drafters.eagle import EagleHead  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.train.capture import load_shards  # noqa: E402
from treespec.train.trainer import _collate, ttt_loss  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    recs = load_shards(args.capture, eagle3=True, greedy_only=True)[:8]
    model, _ = load(args.model)
    head = EagleHead.for_target(model, eagle3=True, draft_vocab_size=4096).float()
    batch = _collate(recs, list(range(len(recs))))
    tokens = int(batch["lengths"].sum())
    times = {"float32": [], "bf16 autocast": []}
    for _ in range(args.repeats):
        for name in times:
            with Timer() as t:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name != "float32"):
                    loss, _ = ttt_loss(head, batch, 3)
                loss.backward()
            times[name].append(t.seconds)
            head.zero_grad()
    print(machine_line(f"{tokens} tokens per step"))
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:14s} median {m:.2f} s/step, {tokens / m:.0f} tok/s")
    print(f"bf16 autocast speedup: {statistics.median(times['float32']) / statistics.median(times['bf16 autocast']):.2f}x")


if __name__ == "__main__":
    main()
