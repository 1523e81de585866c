"""What a verify forward costs on this machine: one target forward of q new tokens after a
prompt, through treespec's runner, for q = 1, 2, 3, 4, 6, 8, 12, 16, 24, 32 (median of
repeats), next to one HF generate decode step. This is the curve that decides which tree
pays off: a tree of q-1 drafted tokens must commit more than cost(q) / cost(1) tokens.

    python benchmarks/forward_cost.py [--model smollm2-135m-instruct] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from treespec.mask import causal_mask  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.runner import ModelRunner  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prefix", type=int, default=160, help="cached tokens before the new ones")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "forward_cost.json")
    args = p.parse_args(argv)
    model, _ = load(args.model)
    runner = ModelRunner(model, "torch")
    prompt = torch.randint(100, 10000, (args.prefix,), generator=torch.Generator().manual_seed(0))
    cache = runner.new_cache([args.prefix + 64])
    seq = cache.add_sequence()
    rows = []
    with runner.attached():
        runner.forward(cache, [seq], [prompt], [torch.arange(args.prefix)], [causal_mask(args.prefix)],
                       logits_rows=[[args.prefix - 1]])
        cache.commit(seq, torch.arange(args.prefix))
        for q in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                runner.forward(cache, [seq], [prompt[:q]], [torch.arange(args.prefix, args.prefix + q)], [causal_mask(q)])
                times.append(time.perf_counter() - t)
            rows.append({"q": q, "ms": 1000 * statistics.median(times)})
    ids = prompt[None]
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=33, do_sample=False, min_new_tokens=33)
        hf = (time.perf_counter() - t)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        hf_prefill = time.perf_counter() - t
    hf_step = 1000 * (hf - hf_prefill) / 32
    base = rows[0]["ms"]
    print(f"{args.model}, {args.prefix} cached tokens, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    print(f"HF generate decode step: {hf_step:.1f} ms")
    print("q (tokens in the forward)   ms    x cost(1)")
    for r in rows:
        print(f"{r['q']:>4}                     {r['ms']:6.1f}   {r['ms'] / base:5.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "prefix": args.prefix, "hf_decode_step_ms": hf_step,
                                    "threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
