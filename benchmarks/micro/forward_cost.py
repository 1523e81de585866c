"""What a verify forward costs on this machine: one target forward of q new tokens after a
prompt, through treespec's runner, for q = 1, 2, 3, 4, 6, 8, 12, 16, 24, 32 (median of
repeats), next to one HF generate decode step in the same dtype. This is the curve that
decides which tree pays off: a tree of q-1 drafted tokens must commit more than
cost(q) / cost(1) tokens.

    python benchmarks/micro/forward_cost.py [--dtype bfloat16] [--pack | --no-pack] [--repeats 9]

Each q is timed with and without oneDNN-packed weights in alternation (``--pack both``, the
default), so that machine drift falls on both alike; the HF decode step is timed plain and
packed too.

Feeds docs/benchmarks.md, "CPU fast path: the cost of a verify forward" (and the older
"What limited the speedup on the Intel machine").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402

from benchmarks.timing import Timer, command, machine_line  # noqa: E402
from treespec.machine import machine_info  # noqa: E402
from treespec.mask import causal_mask  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears  # noqa: E402
from treespec.runner import ModelRunner  # noqa: E402

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def hf_step_ms(model, ids, repeats: int) -> float:
    """Median decode step of HF generate: (33 tokens - 1 token) / 32, per repeat."""
    steps = []
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        for _ in range(max(repeats // 3, 1)):
            with Timer() as long:
                model.generate(ids, max_new_tokens=33, min_new_tokens=33, do_sample=False)
            with Timer() as one:
                model.generate(ids, max_new_tokens=1, do_sample=False)
            steps.append((long.ms - one.ms) / 32)
    return statistics.median(steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--pack", choices=["both", "yes", "no"], default="both",
                   help="time plain weights, oneDNN-packed weights, or both in alternation")
    p.add_argument("--prefix", type=int, default=160, help="cached tokens before the new ones")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda (packing is CPU only: use --pack no)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default: results/forward_cost-DTYPE.json)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, _ = load(args.model, dtype=dtype)
    model = model.to(args.device)
    runner = ModelRunner(model, "auto")
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    packed = PackedLinears(model) if args.pack != "no" else None
    modes = {"both": ["plain", "packed"], "yes": ["packed"], "no": ["plain"]}[args.pack]
    prompt = torch.randint(100, 10000, (args.prefix,), generator=torch.Generator().manual_seed(0)).to(model.device)
    cache = runner.new_cache([args.prefix + 64])
    seq = cache.add_sequence()
    times = {m: {q: [] for q in SIZES} for m in modes}
    with runner.attached():
        runner.forward(cache, [seq], [prompt], [torch.arange(args.prefix)], [causal_mask(args.prefix)],
                       logits_rows=[[args.prefix - 1]])
        cache.commit(seq, torch.arange(args.prefix))
        for rep in range(args.repeats + 1):  # the first round warms every shape up, untimed
            for q in SIZES:
                for m in modes:
                    with packed if m == "packed" else contextlib.nullcontext(), Timer(sync) as t:
                        runner.forward(cache, [seq], [prompt[:q]], [torch.arange(args.prefix, args.prefix + q)],
                                       [causal_mask(q)])
                    if rep:
                        times[m][q].append(t.ms)
    hf = {}
    ids = prompt[None]
    for m in modes:
        with packed if m == "packed" else contextlib.nullcontext():
            hf[m] = hf_step_ms(model, ids, args.repeats)

    info = machine_info()
    print(machine_line(args.model, args.dtype, f"{args.prefix} cached tokens"))
    head = "q    " + "".join(f"{m + ' ms':>12}{'x cost(1)':>11}" for m in modes)
    print(head)
    rows = []
    for q in SIZES:
        row = {"q": q}
        line = f"{q:<5}"
        for m in modes:
            ms = statistics.median(times[m][q])
            row[f"{m}_ms"] = ms
            line += f"{ms:12.1f}{ms / statistics.median(times[m][1]):11.2f}"
        rows.append(row)
        print(line)
    print("HF generate decode step: " + ", ".join(f"{m} {hf[m]:.1f} ms" for m in modes))
    out = args.out or ROOT / "benchmarks" / "results" / f"forward_cost-{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": command(__file__, argv),
        "model": args.model, "dtype": args.dtype, "prefix": args.prefix, "repeats": args.repeats,
        "machine": info, "hf_decode_step_ms": hf, "rows": rows,
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
