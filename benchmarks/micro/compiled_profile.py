"""Where a compiled fixed-shape verify forward's time goes: ``torch.profiler`` over ten forwards
of a q-token chain after 128 cached tokens, SmolLM2-135M in bf16 on packed weights, 2 threads;
the table of operations by self time.

    python benchmarks/micro/compiled_profile.py dense 32     # or: gguf 8
    python benchmarks/micro/compiled_profile.py gguf 16 all [module-guards] [kernels]

``all``: every bucket compiled first, as in decoding, so that each call's guard lookup
(``TorchDynamo Cache Lookup``) walks six graphs; ``module-guards``: with dynamo's guards on the
model's modules kept (``treespec.compiled.SKIP_MODULE_GUARDS = False``), as before they were
dropped; ``kernels``: each of inductor's generated C++ kernels a row of its own
(``torch._inductor.config.cpp.enable_kernel_profile``; the graph compiles again for it), so
that the table says which products and fused operations the forward's time goes to.

Feeds docs/benchmarks.md, "Compiled, round three" (attention, linears, the guard lookup) and
docs/runtime.md, "Fixed-shape verify" (the guard lookup with and without the module guards).
Run it with nothing else on the cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.micro.fixed_shape_cost import chain, prefilled  # noqa: E402
from treespec import compiled  # noqa: E402
from treespec.fixed_shape import BUCKETS, FixedShapeVerify  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.packing import PackedLinears  # noqa: E402
from treespec.runner import ModelRunner  # noqa: E402


def main(argv=None) -> int:
    args = argv or sys.argv[1:] or ["dense", "32"]
    weights, q = args[:2]
    q = int(q)
    if "module-guards" in args[2:]:
        compiled.SKIP_MODULE_GUARDS = False
    if "kernels" in args[2:]:
        import torch._inductor.config as inductor
        inductor.cpp.enable_kernel_profile = True
    torch.set_num_threads(2)
    model, _ = load("smollm2-135m-instruct", dtype=torch.bfloat16, weights=weights)
    model.requires_grad_(False)
    runner = ModelRunner(model, "torch")
    with runner.attached(), PackedLinears(model), torch.inference_mode():
        cache, seq = prefilled(runner, 128, q, "compile")
        verify = FixedShapeVerify(runner, cache, [seq], compile=True)
        tree = chain(q, runner.vocab_size)
        if "all" in args[2:]:
            verify.precompile(BUCKETS[-1], capture=False)
        for _ in range(4):  # the first compiles
            verify.forward([seq], [tree], [128])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                verify.forward([seq], [tree], [128])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    lookup = [e for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup"]
    if lookup:
        print(f"guard lookup: {lookup[0].cpu_time_total / lookup[0].count / 1e3:.2f} ms a call "
              f"(module guards {'kept' if not compiled.SKIP_MODULE_GUARDS else 'dropped'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
