"""One draft level of the EAGLE head, eager against compiled (issue 29, item 1): the lean
single-request pass (K/V written into the request's cache row, fp32 SDPA over it under a
two-part mask, RoPE from a table), the draft output layer and its log-softmax, as one
function of its tensors; the compiled variants run that function through inductor.

    python benchmarks/micro/head_compile.py --threads 2 --rows 8 --context 300

Each variant runs round-robin with the others (--rounds rounds of --calls calls) on the same
inputs; printed: median microseconds a call, and the largest difference of its log-probs
from eager's (inductor fuses a product with its one consumer, the residual add for one, a
bf16 rounding fewer: the 0.18 here). Timing: run it with nothing else on the cores.

Feeds docs/benchmarks.md, "The draft's share of a step": on one fixed shape the compiled level
is faster than the eager one on packed weights; in decoding, where every call has other
shapes, it was not (the library's compiled level of commit 721654e, taken out after).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import treespec  # noqa: E402
from benchmarks.timing import machine_line  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears  # noqa: E402


def level(head, tokens, hidden, cos, sin, fk, fv, start: int, kv: int, mask):
    """One lean head pass over ``n`` entries at the end of a ``kv``-entry cache row, then the
    draft's log-probs: what RowPasses.run_one and the step's logits do."""
    n = tokens.shape[0]

    def attend(q, k, v):
        fk[start + kv - n: start + kv] = k.to(fk.dtype)
        fv[start + kv - n: start + kv] = v.to(fv.dtype)
        keys = fk[start: start + kv].transpose(0, 1).to(torch.float32)[None]
        values = fv[start: start + kv].transpose(0, 1).to(torch.float32)[None]
        out = F.scaled_dot_product_attention(q.to(torch.float32).transpose(0, 1)[None], keys, values,
                                             attn_mask=mask, scale=head.config.head_dim ** -0.5,
                                             enable_gqa=keys.shape[1] != q.shape[1])
        return out[0].transpose(0, 1).to(q.dtype)

    h = head(tokens, hidden, None, attend, (cos, sin))
    return h, head.logits(h).float().log_softmax(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--variants", default="eager,packed,inductor,freezing,freezing+cpp")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(machine_line(args.threads))
    model, _ = load("smollm2-135m-instruct", dtype=dtype)
    drafter = treespec.load_draft("smollm2-135m-instruct-eagle", model)
    head = drafter.head.eval()
    c = head.config
    g = torch.Generator().manual_seed(0)
    n, kv = args.rows, args.context + args.rows
    tokens = torch.randint(0, c.vocab_size, (n,), generator=g)
    hidden = torch.randn(n, c.hidden_size, generator=g).to(dtype)
    cos, sin = (t[kv - n: kv] for t in head.rope_table(kv + 1))
    fk = torch.randn(kv + 64, c.num_kv_heads, c.head_dim, generator=g).to(dtype)
    fv = torch.randn(kv + 64, c.num_kv_heads, c.head_dim, generator=g).to(dtype)
    mask = torch.ones(n, kv, dtype=torch.bool)
    mask[:, kv - n:] = torch.rand(n, n, generator=g) < 0.5
    mask[:, kv - n:] |= torch.eye(n, dtype=torch.bool)
    mask = mask[None, None]
    inputs = (tokens, hidden, cos, sin, fk, fv, 16, kv, mask)

    def eager(*a):
        return level(head, *a)

    variants = {}
    for name in args.variants.split(","):
        if name == "eager":
            variants[name] = eager
        elif name == "packed":
            packed = PackedLinears(head)

            def run_packed(*a, _p=packed):
                with _p:
                    return level(head, *a)

            variants[name] = run_packed
        else:
            import torch._inductor.config as ic

            torch._dynamo.reset()
            ic.freezing = "freezing" in name
            ic.cpp_wrapper = "+cpp" in name
            ic.emulate_precision_casts = "+casts" in name

            def compiled(*a):  # a new code object: dynamo's cache does not carry settings over
                return level(head, *a)

            fn = torch.compile(compiled, dynamic=True)
            t0 = time.perf_counter()
            with torch.inference_mode():
                fn(*inputs)
            print(f"{name}: first call (compile) {time.perf_counter() - t0:.1f} s")
            variants[name] = fn
    with torch.inference_mode():
        ref = eager(*inputs)[1]
        times = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, fn in variants.items():
                fn(*inputs)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn(*inputs)
                times[v].append((time.perf_counter() - t0) / args.calls)
        for v, fn in variants.items():
            diff = (fn(*inputs)[1] - ref).abs().max().item()
            print(f"{v:14} {1e6 * statistics.median(times[v]):8.0f} us a level   max |dlogp| {diff:.3g}")


if __name__ == "__main__":
    main()
