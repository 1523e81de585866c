"""Throughput of the capture's batched decoding, on an idle machine (nothing else on the cores).

    python benchmarks/training/capture_speed.py decode --requests 32 --new-tokens 200
    python benchmarks/training/capture_speed.py shard --batch-size 64

``decode``: the target answers ``--requests`` prompts of the capture plan (from index 9000,
past any shipped head's training prefix) for ``--new-tokens`` tokens in one batch, features
recorded, as the capture does. ``shard``: the plan's first shard (64 conversations, a fifth
sampled at 0.8) captured into a temporary folder, per-batch times printed. bf16 and packed
weights where the CPU has native bf16, as ``treespec capture`` runs.

Feeds docs/training.md, "Throughput and wall time of the full capture"; docs/runtime.md,
"The CPU fast path: bf16 and packed weights".
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402

from benchmarks.timing import Timer  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears, default_dtype, packing_supported  # noqa: E402
from treespec.threads import default_threads  # noqa: E402
from treespec.train.capture import CaptureConfig, capture_plan, capture_shards  # noqa: E402
from treespec.train.data import tokenize_example  # noqa: E402
from treespec.train.records import feature_ids, generated_records  # noqa: E402

# The module, not treespec.train.capture the attribute: that is the trainer's capture function.
capture_mod = importlib.import_module("treespec.train.capture")

DATA = "gsm8k-train[:7400],stdlib-code[:3100],chat-train[:3750]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["decode", "shard"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads or default_threads())
    model, tok = load("smollm2-135m-instruct", dtype=default_dtype())  # as `treespec capture --dtype auto`
    fast = PackedLinears(model) if packing_supported(model) else None
    with fast if fast is not None else torch.inference_mode():
        if args.what == "decode":
            cfg = CaptureConfig(data=DATA, out_dir="unused")
            plan = capture_plan(cfg)[9000: 9000 + args.requests]
            prompts = []
            for _, ex in plan:
                ids, plen = tokenize_example(tok, ex, answer="")
                prompts.append(ids[:plen])
            fids = feature_ids(model, "both")
            generated_records(model, prompts, fids, 4, tok.eos_token_id)  # warm-up
            with Timer() as t:
                recs = generated_records(model, prompts, fids, args.new_tokens, tok.eos_token_id)
            dt = t.seconds
            gen = sum(r["tokens"].numel() - r["prompt_len"] for r in recs)
            print(f"{args.requests} requests, {args.new_tokens} new tokens: {gen} tokens in {dt:.1f} s, "
                  f"{gen / dt:.1f} tok/s ({dt / args.new_tokens * 1000:.0f} ms a step)")
        else:
            inner = capture_mod.generated_records

            def timed(model, prompts, *a, **k):
                with Timer() as t:
                    recs = inner(model, prompts, *a, **k)
                temps = k.get("temperature")
                sampled = sum(x > 0 for x in temps) if isinstance(temps, list) else (len(prompts) if temps else 0)
                print(f"  batch of {len(prompts)} ({sampled} sampled): {t.seconds:.1f} s")
                return recs

            capture_mod.generated_records = timed
            with tempfile.TemporaryDirectory() as out:
                cfg = CaptureConfig(data=DATA, out_dir=out, max_examples=64, sample_share=0.2,
                                    sample_temperature=0.8, batch_size=args.batch_size)
                s = capture_shards(model, tok, cfg)
            print(f"first shard, batch size {args.batch_size}: {s['generated_tokens']} tokens in "
                  f"{s['seconds']:.1f} s, {s['tokens_per_second']:.1f} tok/s")


if __name__ == "__main__":
    main()
