"""The draft head's compiled pass on a CPU, two ways, side by side: its weights inputs of the
graph, read through oneDNN's packed copies (the opaque ``packed_linear`` call, how the compiled
passes ran before), against its weights frozen into the graph so that inductor generates the
products (how ``compile_passes=True`` runs them now, ``drafters/graphs.py``).

    python benchmarks/micro/head_pass_frozen.py --threads 2 --entries 8 --keys 320

One pass of ``--entries`` entries attending over ``--keys`` keys of a 2,048-entry row, the
shipped head (bf16) on the shipped target; each variant compiled first (its seconds printed),
then the two timed round-robin (``--rounds`` rounds of ``--calls`` calls); printed: the median
milliseconds a call, and the largest difference of each variant's log-probabilities from the
eager pass's. Feeds docs/runtime.md, "Fixed-shape verify" (the draft head's passes, compiled).
Run it with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import treespec  # noqa: E402
from benchmarks.timing import command, machine_line  # noqa: E402
from treespec.compiled import compile_fixed  # noqa: E402
from treespec.drafters import graphs  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears  # noqa: E402

ROW = 2048


def inputs(head, n: int, keys: int) -> tuple:
    """A row of random K/V, ``n`` new entries after ``keys - n - 4`` cached ones and 4 earlier
    tree entries (half of them seen), the arguments of ``graphs.head_pass``."""
    g = torch.Generator().manual_seed(0)
    c, dtype = head.config, next(head.parameters()).dtype
    k = torch.randn(ROW, c.num_kv_heads, c.head_dim, generator=g).to(dtype)
    v = torch.randn(ROW, c.num_kv_heads, c.head_dim, generator=g).to(dtype)
    cos, sin = head.rope_table(ROW)
    cached = keys - n - 4
    tokens = torch.randint(0, c.vocab_size, (n,), generator=g)
    hidden = torch.randn(n, c.hidden_size, generator=g).to(dtype)
    positions = torch.arange(cached, cached + n)
    slots = torch.arange(keys - n, keys)
    mask = torch.zeros(n, keys, dtype=torch.bool)
    mask[:, :cached] = True
    mask[:, cached: keys - n] = torch.rand(n, 4, generator=g) > 0.5
    mask[torch.arange(n), slots] = True
    return k, v, cos, sin, tokens, hidden, positions, slots, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--entries", type=int, default=8)
    ap.add_argument("--keys", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load("smollm2-135m-instruct", dtype=torch.bfloat16, weights="gguf")
    head = treespec.load_draft("smollm2-135m-instruct-eagle", model).head
    x = inputs(head, args.entries, args.keys)
    with torch.inference_mode():
        eager = graphs.head_pass(head, *x)[1]
    packed = PackedLinears(head)
    variants = {"packed, an input of the graph": compile_fixed(graphs.head_pass),
                "frozen into the graph": graphs._compiled_pass(torch.device("cpu"))}
    times, compile_s, diff = {name: [] for name in variants}, {}, {}
    with packed, torch.inference_mode():
        for name, fn in variants.items():
            t0 = time.perf_counter()
            diff[name] = float((fn(head, *x)[1] - eager).abs().max())
            compile_s[name] = time.perf_counter() - t0
        for _ in range(args.rounds):
            for name, fn in variants.items():
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    fn(head, *x)
                    times[name].append(time.perf_counter() - t0)
    print(machine_line("bfloat16", "packed"))
    print(f"one head pass: {args.entries} entries over {args.keys} keys (row of {ROW}), {args.threads} threads")
    rows = {}
    for name in variants:
        ms = 1e3 * statistics.median(times[name])
        rows[name] = {"median_ms": round(ms, 3), "compile_s": round(compile_s[name], 1),
                      "max_logp_diff_vs_eager": round(diff[name], 4)}
        print(f"  {name:32} {ms:6.3f} ms a call  (compiled in {compile_s[name]:5.1f} s; "
              f"log-probs within {diff[name]:.3f} of eager)")
    if args.out:
        res = {"command": command("benchmarks/micro/head_pass_frozen.py", sys.argv[1:]),
               "machine": machine_line("bfloat16", "packed"), "variants": rows}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
