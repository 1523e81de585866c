"""Where the time of one verify forward goes: torch.profiler over repeated forwards of q
tree tokens after a prompt, through treespec's runner, split into

    linear (decoder)   the 30 layers' q/k/v/o and MLP projections
    LM head            the output projection (all q rows: verification reads every node)
    attention          treespec's backend.run per layer (SDPA over the gathered pages)
    KV write / gather  the paged cache's scatter of new K/V and gather of each layer's pages
    plan               per-forward index and mask building (make_batch)
    rest               wall time minus the above: norms, RoPE, activations, residual adds,
                       transformers' Python per layer and the dispatcher

    python benchmarks/micro/profile_verify.py [--dtype bfloat16] [--q 16] [--pack both] [--weights gguf]

With ``--pack no`` the script also runs against an older checkout (copy ``benchmarks/__init__.py``,
``benchmarks/timing.py`` and ``benchmarks/micro/`` into it): the "before" column of docs/benchmarks.md.

The library is not instrumented: this script wraps the cache, backend and LM head methods
in ``record_function`` labels for the duration of the profile.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks.timing import command, machine_line, median_ms  # noqa: E402
from treespec import attention  # noqa: E402
from treespec.machine import machine_info  # noqa: E402
from treespec.kv_cache import PagedKVCache  # noqa: E402
from treespec.mask import causal_mask  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.runner import ModelRunner  # noqa: E402

LABELS = {"kv write": (PagedKVCache, "write"), "kv gather": (PagedKVCache, "gather"),
          "attention": (attention.TorchBackend, "run")}


@contextlib.contextmanager
def labelled(model):
    """record_function labels around the cache, the backend, make_batch and the LM head."""
    saved = []

    def wrap(owner, name, label):
        fn = getattr(owner, name)
        saved.append((owner, name, fn))

        @functools.wraps(fn)
        def inner(*a, **kw):
            with record_function(label):
                return fn(*a, **kw)
        setattr(owner, name, inner)

    for label, (owner, name) in LABELS.items():
        wrap(owner, name, label)
    wrap(attention, "make_batch", "plan")
    import treespec.runner as runner_module
    wrap(runner_module, "make_batch", "plan")
    head = model.get_output_embeddings()
    hook_pre = head.register_forward_pre_hook(lambda m, a: setattr(m, "_ts_rf", record_function("lm head").__enter__()))
    hook_post = head.register_forward_hook(lambda m, a, o: m._ts_rf.__exit__(None, None, None))
    try:
        yield
    finally:
        hook_pre.remove()
        hook_post.remove()
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def breakdown(run, model, repeats: int) -> dict:
    """Milliseconds per forward by category (profiled) and the unprofiled wall time."""
    wall = median_ms(run, repeats)
    with labelled(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            run()
    total = {e.key: e.cpu_time_total / 1000 / repeats for e in prof.key_averages()}
    linear_all = total.get("aten::linear", 0.0) + total.get("mkldnn::_linear_pointwise", 0.0)
    head = total.get("lm head", 0.0)
    out = {"linear (decoder)": linear_all - head, "LM head": head, "attention": total.get("attention", 0.0),
           "kv write": total.get("kv write", 0.0), "kv gather": total.get("kv gather", 0.0),
           "plan": total.get("plan", 0.0)}
    # attention includes its gather: report the gather separately
    out["attention"] -= out["kv gather"]
    out["rest"] = max(wall - sum(out.values()), 0.0)
    out["wall"] = wall
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--pack", choices=["both", "yes", "no"], default="both")
    p.add_argument("--q", type=int, nargs="+", default=[1, 16], help="tree tokens per forward")
    p.add_argument("--prefix", type=int, default=160)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--weights", choices=["dense", "gguf", "int4", "int8"], default="dense",
                   help="the target's linear layers (treespec.models.load's weights=)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load(args.model, dtype=getattr(torch, args.dtype), weights=args.weights)
    runner = ModelRunner(model, "torch")
    packed = None
    if args.pack != "no":
        from treespec.packing import PackedLinears  # imported here: older checkouts have no packing

        packed = PackedLinears(model)
    modes = {"both": ["plain", "packed"], "yes": ["packed"], "no": ["plain"]}[args.pack]
    prompt = torch.randint(100, 10000, (args.prefix,), generator=torch.Generator().manual_seed(0))
    cache = runner.new_cache([args.prefix + 64])
    seq = cache.add_sequence()
    results = {}
    with runner.attached():
        runner.forward(cache, [seq], [prompt], [torch.arange(args.prefix)], [causal_mask(args.prefix)],
                       logits_rows=[[args.prefix - 1]])
        cache.commit(seq, torch.arange(args.prefix))
        for q in args.q:
            def run():
                runner.forward(cache, [seq], [prompt[:q]], [torch.arange(args.prefix, args.prefix + q)],
                               [causal_mask(q)])
            for m in modes:
                with packed if m == "packed" else contextlib.nullcontext():
                    run()  # warm this shape up
                    results[f"{m} q={q}"] = breakdown(run, model, args.repeats)
    info = machine_info()
    print(f"{machine_line(args.model, args.dtype, f'{args.prefix} cached tokens')}; "
          f"ms per forward (median wall; categories from torch.profiler)")
    cats = list(next(iter(results.values())))
    print(f"{'':18}" + "".join(f"{c:>17}" for c in cats))
    for name, r in results.items():
        print(f"{name:18}" + "".join(f"{r[c]:17.1f}" for c in cats))
    out = args.out or ROOT / "benchmarks" / "results" / f"profile_verify-{args.dtype}.json"
    out.write_text(json.dumps({
        "command": command(__file__, argv),
        "model": args.model, "dtype": args.dtype, "prefix": args.prefix, "machine": info, "ms": results,
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
