"""The verify cost curve on a GPU, with nothing downloaded (the GPU machine has no network):
one target forward of a tree of q tokens after a prefix of 1,536 cached tokens, for
q = 1 .. 128, through each attention backend that runs there (torch, split, flex, and
FlashInfer when it imports), median milliseconds over repeats. The target has a real model's shape,
Llama-3.1-8B's by default (hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads,
vocab 128256; its rope scaling left out, which changes no cost), built with random weights
directly on the GPU in bf16.

    python benchmarks/micro/verify_cost_gpu.py --out DIR/verify_cost.json [--layers 32] [--prefix 1536]

At every size the script also checks each backend's tree logits against those of the same
weights in fp32 (a copy of the model, the torch backend, its own cache of the same prompt
prefilled in fp32, the same tree): a backend passes when its error is at most 1.25 times the
torch backend's own bf16 error (plus 0.1% of the logits' scale): kernels that sum in another
order err about alike. The torch backend's logits under a wrong mask (each node seeing only
the prefix and itself) are reported beside it, to show what a masking bug would do, and the
check fails where that bound would not catch it (a wrong mask's error under the bound, q >= 2);
a backend that fails makes the script exit 1 after writing its JSON. The fp32 copy needs room:
at Llama-3.1-8B's shape the run peaked at 46 GiB of GPU memory (``--layers`` makes it smaller).
The first call of each size is reported apart (``first_ms``): for flex it holds the kernel's
compilation. ``hf_ms`` is the same model's own HF forward of q causal
tokens after the same prefix (a DynamicCache cropped back after each call): the cost of a
forward without treespec's runner, its paged cache or a tree.

``fixed`` and ``fixed-graphs`` are the decoding loop's verify on fixed shapes
(:class:`~treespec.fixed_shape.FixedShapeVerify`, ``fixed_shapes=True`` and ``"graphs"``): the
tree padded to its bucket (1, 4, ..., 64; larger trees are not timed there), every layer over
the row's whole length (a power of two: 2,048 positions after 1,536), eager and replayed from a
CUDA graph a bucket (CUDA only; its first call captures). Their logits are checked as a
backend's. Issue 47 asks a captured verify of 32 tokens to cost at most 1.25 times a captured
one-token forward: the summary prints that ratio.

Feeds docs/benchmarks.md, "The first run (H200, 2026-12-04)"; run by
benchmarks/figures/gpu_check.sh. ``--shape tiny --device cpu`` runs the same code in
seconds on a CPU (tests/gpu/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402

from benchmarks.timing import Timer, command  # noqa: E402
from treespec import Tree  # noqa: E402
from treespec.attention import flashinfer_available, flashinfer_problem, flex_problem  # noqa: E402
from treespec.fixed_shape import BUCKETS, FixedShapeVerify, fixed_row_tokens  # noqa: E402
from treespec.machine import machine_info  # noqa: E402
from treespec.mask import causal_mask  # noqa: E402
from treespec.runner import ModelRunner  # noqa: E402

SHAPES = {
    # Llama-3.1-8B's config.json, less rope_scaling (positions here stay far below 8k)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=131072),
    # a few MB: the script end to end on a CPU, in the tests
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096),
}
SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# A backend passes when its error against the fp32 logits is at most this many times the torch
# backend's (bf16 kernels that sum in another order err about alike), plus a floor of this
# share of the logits' scale (in fp32 the torch backend's own error is zero).
MAX_ERROR_VS_TORCH = 1.25
ERROR_FLOOR = 1e-3


def random_model(shape: str, layers: int | None, dtype: torch.dtype, device: str):
    """A Llama of ``shape`` with random weights, allocated and initialised on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = LlamaConfig(**kw, tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval()


def random_tree(q: int, vocab: int, g: torch.Generator) -> Tree:
    """q nodes, each under a uniformly drawn earlier node; distinct tokens (siblings must differ)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, q)]
    return Tree(parents, torch.randperm(vocab, generator=g)[:q])


FIXED = ("fixed", "fixed-graphs")  # the loop's verify on fixed shapes, eager and captured


def available_backends(device: str, dtype: torch.dtype) -> list[str]:
    """The backends that run here for a model in ``dtype`` (split: anywhere; FlashInfer: fp16/bf16
    only), then the fixed-shape verify (captured: CUDA only)."""
    names = ["torch", "split"]
    if flex_problem(device) is None:
        names.append("flex")
    if torch.device(device).type == "cuda" and flashinfer_problem(dtype, None) is None and flashinfer_available():
        names.append("flashinfer")
    return names + ["fixed"] + (["fixed-graphs"] if torch.device(device).type == "cuda" else [])


def runs_at(backend: str, q: int) -> bool:
    """Whether ``backend`` is timed at ``q`` tree tokens (the fixed shapes: up to the largest bucket)."""
    return backend not in FIXED or q <= BUCKETS[-1]


class Bench:
    """One model, one cache holding the prefix, a runner per backend; forwards of a tree at
    positions prefix .. prefix+q-1 (reserved, never committed: every forward overwrites them)."""

    def __init__(self, model, backends: list[str], prefix: int, max_q: int):
        self.runners = {b: ModelRunner(model, b) for b in backends if b not in FIXED}
        ref = self.runners["torch"]
        self.device = ref.device
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.prefix = prefix
        self.cache = ref.new_cache([prefix + max_q])
        self.seq = self.cache.add_sequence()
        g = torch.Generator().manual_seed(0)
        self.prompt = prompt = torch.randint(0, ref.vocab_size, (prefix,), generator=g)
        with ref.attached():
            ref.forward(self.cache, [self.seq], [prompt.to(self.device)], [torch.arange(prefix)],
                        [causal_mask(prefix)], logits_rows=[[prefix - 1]])
        self.cache.commit(self.seq, torch.arange(prefix))
        self.fixed = {}  # name -> (its FixedShapeVerify, its sequence): a rows cache of its own, same prefix
        if any(b in FIXED for b in backends):
            rows_cache, seqs = ref.new_rows_cache(1, fixed_row_tokens(prefix, min(max_q, BUCKETS[-1]), "graphs"), 16)
            with ref.attached():
                ref.forward(rows_cache, seqs, [prompt.to(self.device)], [torch.arange(prefix)], [causal_mask(prefix)],
                            logits_rows=[[prefix - 1]])
            rows_cache.commit(seqs[0], torch.arange(prefix))
            for b in (b for b in backends if b in FIXED):  # tree K/V past the prefix, never committed
                self.fixed[b] = FixedShapeVerify(ref, rows_cache, seqs, graphs=b == "fixed-graphs"), seqs[0]

    def forward(self, backend: str, tree: Tree, mask: torch.Tensor | None = None) -> torch.Tensor:
        if backend in self.fixed:
            verify, seq = self.fixed[backend]
            with self.runners["torch"].attached():
                return verify.forward([seq], [tree], [self.prefix]).logits[0]
        runner = self.runners[backend]
        with runner.attached():
            out = runner.forward(self.cache, [self.seq], [tree.tokens.to(self.device)],
                                 [tree.position_ids(self.prefix)],
                                 [tree.attention_mask() if mask is None else mask])
        return out.logits[0]  # [q, V]

    def timed(self, backend: str, tree: Tree) -> tuple[float, torch.Tensor]:
        with Timer(self.sync) as t:
            logits = self.forward(backend, tree)
        return t.ms, logits


def check_size(bench: Bench, backends: list[str], tree: Tree, row: dict, reference: Bench | None) -> bool:
    """The first (untimed-for-the-median) call of each backend at this size, and the logits check
    against ``reference`` (the model in fp32; None: the model is fp32, its torch backend is it)."""
    first = {}
    backends = [b for b in backends if runs_at(b, tree.num_nodes)]
    for b in backends:
        row[f"{b}_first_ms"], first[b] = bench.timed(b, tree)
    ref = (reference.forward("torch", tree) if reference is not None else first["torch"]).float()
    scale = float(ref.abs().max())
    row["max_abs_logit"] = scale
    wrong = bench.forward("torch", tree, torch.eye(tree.num_nodes, dtype=torch.bool)).float()
    row["wrong_mask_max_abs_error"] = float((wrong - ref).abs().max())
    torch_error = float((first["torch"].float() - ref).abs().max())
    bound = MAX_ERROR_VS_TORCH * torch_error + ERROR_FLOOR * scale
    row["error_bound"] = bound
    # A bound a wrong mask would pass is no check (q = 1: the only mask there is is right).
    ok = tree.num_nodes == 1 or row["wrong_mask_max_abs_error"] > bound
    row["bound_catches_wrong_mask"] = ok
    for b in backends:
        error = float((first[b].float() - ref).abs().max())
        row[f"{b}_max_abs_error"] = error
        row[f"{b}_argmax_agree"] = float((first[b].float().argmax(-1) == ref.argmax(-1)).float().mean())
        if b != "torch":
            row[f"{b}_ok"] = error <= bound
            ok &= row[f"{b}_ok"]
    return ok


class HFForward:
    """The model's own forward (HF's attention, a DynamicCache holding ``prompt``, the bench's
    prefix) of q causal tokens, cropped back to the prefix after each call."""

    def __init__(self, model, prompt: torch.Tensor, sync):
        from transformers import DynamicCache

        self.model, self.sync = model, sync
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(prompt.to(model.device)[None], past_key_values=self.cache, use_cache=True, logits_to_keep=1)

    def timed(self, q: int) -> float:
        ids = torch.arange(q, device=self.model.device)[None] % self.model.config.vocab_size
        with torch.inference_mode(), Timer(self.sync) as t:
            self.model(ids, past_key_values=self.cache, use_cache=True)
        self.cache.crop(-q)  # a negative count: the tokens to drop, in every transformers 5
        return t.ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's; 32 for 8B)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefix", type=int, default=1536, help="cached tokens before the tree")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="tree sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=10, help="timed forwards per size and backend (after the first)")
    p.add_argument("--backends", default=None, help="comma-separated (default: every one that runs here)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF forward timing")
    p.add_argument("--out", type=Path, required=True, help="JSON file (rewritten after every round)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*past_key_values.*is deprecated")  # transformers >= 5.2x
    sizes = [int(s) for s in args.sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    backends = args.backends.split(",") if args.backends else available_backends(args.device, dtype)
    if backends[0] != "torch":
        p.error("--backends must start with torch, the reference")

    t0 = time.perf_counter()
    model = random_model(args.shape, args.layers, getattr(torch, args.dtype), args.device)
    build_s = time.perf_counter() - t0
    bench = Bench(model, backends, args.prefix, max(sizes))
    reference = None
    if model.dtype != torch.float32:  # the same weights in fp32, for the logits check
        import copy

        reference = Bench(copy.deepcopy(model).float(), ["torch"], args.prefix, max(sizes))
    hf = None
    if not args.no_hf:
        try:  # a side figure: a transformers whose cache API differs must not cost the check
            hf = HFForward(model, bench.prompt, bench.sync)
            hf.timed(1)
        except Exception as err:  # noqa: BLE001
            print(f"HF forward timing skipped: {type(err).__name__}: {err}", flush=True)
            hf = None
    g = torch.Generator().manual_seed(1)
    trees = {q: random_tree(q, model.config.vocab_size, g) for q in sizes}
    result = {
        "command": command(__file__, argv), "machine": machine_info(), "shape": args.shape,
        "config": {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}, "dtype": args.dtype,
        "prefix": args.prefix, "repeats": args.repeats, "backends": backends, "build_seconds": build_s,
        "reference": "fp32" if model.dtype != torch.float32 else "the torch backend (the model is fp32)",
        "rounds_done": 0, "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    ok = True
    timed = backends + ([] if hf is None else ["hf"])
    times = {q: {b: [] for b in timed} for q in sizes}
    for q in sizes:  # the first round: compile, check, and the first call's time
        row = {"q": q}
        ok &= check_size(bench, backends, trees[q], row, reference)
        if hf is not None:
            row["hf_first_ms"] = hf.timed(q)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        save()
    for rep in range(args.repeats):  # backends alternate within a size, so drift falls on all alike
        for q, row in zip(sizes, result["rows"]):
            for b in (b for b in timed if runs_at(b, q)):
                times[q][b].append(hf.timed(q) if b == "hf" else bench.timed(b, trees[q])[0])
                row[f"{b}_ms"] = statistics.median(times[q][b])
        result["rounds_done"] = rep + 1
        save()
    result["ok"] = ok
    if args.device.startswith("cuda"):
        result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    save()
    print(f"{args.shape}, {model.config.num_hidden_layers} layers, {args.dtype}, prefix {args.prefix}, "
          f"median of {args.repeats}")
    print("q     " + "".join(f"{b + ' ms':>14}" for b in timed) + "".join(f"{b + ' err':>12}" for b in backends)
          + f"{'wrong err':>12}")
    for row in result["rows"]:
        print(f"{row['q']:<6}" + "".join(f"{row.get(b + '_ms', float('nan')):14.2f}" for b in timed)
              + "".join(f"{row.get(b + '_max_abs_error', float('nan')):12.4f}" for b in backends)
              + f"{row['wrong_mask_max_abs_error']:12.4f}")
    print("err: max |logit - reference| (" + result["reference"] + "); wrong: the torch backend under a wrong mask")
    for b in (b for b in FIXED if b in backends):  # issue 47: 32 tokens at most 1.25x one
        by_q = {row["q"]: row.get(f"{b}_ms") for row in result["rows"]}
        if by_q.get(1) and by_q.get(32):
            result[f"{b}_32_over_1"] = by_q[32] / by_q[1]
            print(f"{b}: a forward of 32 tree tokens costs {by_q[32] / by_q[1]:.2f}x one of 1 token")
    save()
    print("logits check: " + ("every backend's error is the torch backend's size" if ok
                              else "FAILED (see *_ok in the JSON)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
