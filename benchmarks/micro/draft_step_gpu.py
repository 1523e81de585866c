"""The EAGLE-3 drafter's step on a GPU, eager against a CUDA graph, with nothing downloaded
(the GPU machine has no network): a head of Llama-3.1-8B's shape (one decoder layer of hidden
4096, a 32,000-row draft vocabulary, the target's 128,256-row embedding) with random weights,
drafting one tree level of k tokens after a 1,536-token prefix: the head's forward over a
static KV buffer (SDPA under a boolean mask), its logits, log-softmax and top-k, as one level
of an EAGLE-2 tree needs. Median milliseconds per level, and per tree of ``--depth`` levels.

    python benchmarks/micro/draft_step_gpu.py --out DIR/draft_step.json [--k 8] [--depth 6]

Eager runs the level's operations one by one as treespec's EagleSession does; the graph
captures the same level once per shape (static buffers for tokens, states, positions, mask
and cache) and replays it. The graph's outputs are compared with eager's on the same inputs
(the same kernels, so they should agree to the last bit; the script exits 1 when the top-k
ids differ).

Then treespec's own drafter with the same head (``--session-steps``, 0 to skip): EAGLE-3
sessions after the same prefix drafting ``--tree`` trees and committing 1-4 tokens a step,
three ways: ``eager`` (the session's default pass on a GPU), ``static`` (the fixed-shape passes
of treespec.drafters.graphs over the drafter's row, uncaptured) and ``graphs`` (``cuda_graphs=True``: the same passes
replayed from CUDA graphs); two sessions each, the first whole (with graphs it captures every
shape), the second's median ms per proposal and per commit. The graphs' trees must equal the
static passes' bit for bit (exit 1 otherwise).

``--shape tiny --device cpu`` runs the eager half in seconds on a CPU (the graph needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's treespec and benchmarks.timing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.timing import command, median_ms  # noqa: E402
from treespec import TreeConfig  # noqa: E402
from treespec.drafters.base import DraftStart  # noqa: E402
from treespec.drafters.eagle import Eagle3Drafter, EagleHead, HeadConfig  # noqa: E402
from treespec.drafters.graphs import GraphedRow  # noqa: E402
from treespec.machine import machine_info  # noqa: E402

SHAPES = {
    # EAGLE-3 heads for Llama-3.1-8B (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                         vocab_size=128256, draft_vocab_size=32000, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                 vocab_size=1000, draft_vocab_size=500, rope_theta=10000.0),
}


def random_head(shape: str, dtype: torch.dtype, device: str) -> EagleHead:
    s = SHAPES[shape]
    c = HeadConfig(hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"], num_heads=s["num_heads"],
                   num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"], rms_norm_eps=1e-5,
                   rope_theta=s["rope_theta"], vocab_size=s["vocab_size"], eagle3=True,
                   draft_vocab_size=s["draft_vocab_size"], target_hidden_size=s["hidden_size"],
                   max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        head = EagleHead(c, embed, None)
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.02)
        torch.nn.init.normal_(embed.weight, std=0.02)
        head.d2t.copy_(torch.arange(c.draft_vocab_size) % 7)
    embed.to(dtype)
    return head.to(dtype).eval()


class Level:
    """One tree level's drafting on static buffers: ``run()`` reads the inputs' buffers and
    writes ``top_ids`` / ``top_logp`` / ``states``; the same code is run eagerly or captured."""

    def __init__(self, head: EagleHead, prefix: int, k: int, depth: int):
        c = head.config
        dev = head.d2t.device
        dtype = next(head.parameters()).dtype
        self.head, self.k = head, k
        self.capacity = prefix + k * depth
        g = torch.Generator(device="cpu").manual_seed(1)
        self.tokens = torch.randint(0, c.vocab_size, (k,), generator=g).to(dev)
        self.hidden = (0.5 * torch.randn(k, c.hidden_size, generator=g)).to(dev, dtype)
        self.positions = torch.full((k,), prefix, dtype=torch.int64, device=dev)
        self.slots = torch.arange(prefix, prefix + k, device=dev)  # where the level's keys go
        self.mask = torch.zeros(k, self.capacity, dtype=torch.bool, device=dev)
        self.mask[:, :prefix] = True
        self.mask[:, prefix:prefix + k] = torch.eye(k, dtype=torch.bool, device=dev)
        self.keys = (0.5 * torch.randn(self.capacity, c.num_kv_heads, c.head_dim, generator=g)).to(dev, dtype)
        self.values = (0.5 * torch.randn(self.capacity, c.num_kv_heads, c.head_dim, generator=g)).to(dev, dtype)
        self.rope = head.rope_table(self.capacity)
        self.scale = c.head_dim ** -0.5

    def _attend(self, q, k, v):
        self.keys.index_copy_(0, self.slots, k)
        self.values.index_copy_(0, self.slots, v)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], self.keys.transpose(0, 1)[None],
                                             self.values.transpose(0, 1)[None], attn_mask=self.mask[None, None],
                                             scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    def run(self):
        rope = (self.rope[0][self.positions], self.rope[1][self.positions])
        h = self.head(self.tokens, self.hidden, self.positions, self._attend, rope)
        logp = self.head.logits(h).float().log_softmax(-1)
        self.top_logp, ids = logp.topk(self.k, dim=-1)
        self.top_ids = self.head.draft_to_target(ids)
        self.states = h
        return self.top_ids, self.top_logp, self.states


COMMITS = (3, 1, 4, 2)  # tokens committed a step, in turn: several commit shapes, as decoding has


def session_rows(head: EagleHead, prefix: int, tree: str, steps: int, cuda: bool) -> tuple[list[dict], bool]:
    """treespec's EagleSession drafting ``steps`` trees after ``prefix`` random entries and
    committing 1-4 tokens a step, per variant (eager, static, graphs where CUDA), two sessions
    each: the first (``first_session_ms``: with graphs, it captures every shape) and a second,
    whose median ms per proposal and per commit are the figures (graphs captured by the first
    session serve it)."""
    c, dev = head.config, head.d2t.device
    dtype = next(head.parameters()).dtype
    cfg = TreeConfig.preset(tree)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(2)
    span = sum(COMMITS) * (steps // len(COMMITS) + 1)
    tokens = torch.randint(0, c.vocab_size, (prefix + span + 1,), generator=g).tolist()
    features = (0.5 * torch.randn(prefix + span, 3 * c.target_hidden_size, generator=g)).to(dev, dtype)
    rows, trees, ok = [], {}, True
    for variant in ("eager", "static", "graphs") if cuda else ("eager", "static"):
        # static: the graphed row's passes, uncaptured (the same row length, so the same sums)
        drafter = Eagle3Drafter(head, cuda_graphs=variant != "eager")
        drafter.graphed_row = GraphedRow(capture=variant == "graphs")
        times = []
        for _ in range(2):
            session = drafter.start(None, DraftStart([tokens[:prefix]], [tokens[prefix]], [features[:prefix]],
                                                     span + 8, cfg))
            propose, commit, drafted, pos = [], [], [], prefix
            for i in range(steps):
                sync()
                t0 = time.perf_counter()
                drafted.append(session.propose([0], [tokens[pos]], [cfg.depth])[0])
                sync()
                t1 = time.perf_counter()
                n = COMMITS[i % len(COMMITS)]
                session.commit([0], [tokens[pos + 1: pos + 1 + n]], [features[pos: pos + n]])
                sync()
                t2 = time.perf_counter()
                propose.append(1000 * (t1 - t0))
                commit.append(1000 * (t2 - t1))
                pos += n
            session.finish(0)
            times.append((propose, commit))
        trees[variant] = drafted  # the second session's
        (first_p, first_c), (propose, commit) = times
        rows.append({"tree": tree, "variant": variant, "steps": steps, "first_session_ms": sum(first_p) + sum(first_c),
                     "propose_ms": statistics.median(propose), "commit_ms": statistics.median(commit),
                     "nodes": statistics.mean(t.num_nodes for t in drafted)})
        if variant != "eager":
            rows[-1]["pass_shapes"] = sorted(drafter.graphed_row.passes.passes)
    if "graphs" in trees:
        same = all(torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
                   and torch.equal(a.scores, b.scores) for a, b in zip(trees["static"], trees["graphs"]))
        rows[-1]["trees_equal_static"] = same
        ok &= same
    return rows, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefix", type=int, default=1536)
    p.add_argument("--k", default="1,4,8", help="tokens per level (top-k), comma-separated")
    p.add_argument("--depth", type=int, default=6, help="levels per tree (the per-tree figure)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--tree", default="eagle2", help="the session part's tree preset")
    p.add_argument("--session-steps", type=int, default=30, help="the session part's steps a session (0: skip it)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    head = random_head(args.shape, getattr(torch, args.dtype), args.device)
    result = {"command": command(__file__, argv), "machine": machine_info(), "shape": args.shape,
              "dtype": args.dtype, "prefix": args.prefix, "depth": args.depth, "repeats": args.repeats, "rows": []}
    ok = True
    with torch.inference_mode():
        for k in (int(x) for x in args.k.split(",")):
            level = Level(head, args.prefix, k, args.depth)
            for _ in range(3):  # warm-up: allocator, cuBLAS handles, kernel selection
                level.run()
            eager_ids, eager_logp, _ = (t.clone() for t in level.run())
            row = {"k": k, "eager_ms": median_ms(level.run, args.repeats, sync=sync)}
            if cuda:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        level.run()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    level.run()
                graph.replay()
                sync()
                row["graph_ms"] = median_ms(graph.replay, args.repeats, sync=sync)
                row["ids_equal"] = bool(torch.equal(level.top_ids, eager_ids))
                row["max_abs_logp_diff"] = float((level.top_logp - eager_logp).abs().max())
                row["speedup"] = row["eager_ms"] / row["graph_ms"]
                ok &= row["ids_equal"]
            row["eager_tree_ms"] = args.depth * row["eager_ms"]
            if "graph_ms" in row:
                row["graph_tree_ms"] = args.depth * row["graph_ms"]
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    result["session"] = []
    if args.session_steps:
        with torch.inference_mode():
            result["session"], session_ok = session_rows(head, args.prefix, args.tree, args.session_steps, cuda)
        ok &= session_ok
    result["ok"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"EAGLE-3 head of {args.shape}'s shape, {args.dtype}, prefix {args.prefix}, median of {args.repeats}")
    print("k     eager ms/level   graph ms/level   speedup")
    for r in result["rows"]:
        print(f"{r['k']:<6}{r['eager_ms']:15.3f}{r.get('graph_ms', float('nan')):17.3f}{r.get('speedup', float('nan')):10.2f}")
    if result["session"]:
        print(f"treespec's EagleSession, {args.tree} trees, 1-4 tokens committed a step, median of the second "
              f"session's {args.session_steps} steps; the first session whole")
        print("variant   propose ms   commit ms   first session ms   nodes")
        for r in result["session"]:
            print(f"{r['variant']:<10}{r['propose_ms']:10.2f}{r['commit_ms']:12.2f}{r['first_session_ms']:19.1f}"
                  f"{r['nodes']:8.1f}")
        if "trees_equal_static" in result["session"][-1]:
            print("graphs' trees equal the static passes': " + str(result["session"][-1]["trees_equal_static"]))
    print("graph check: " + ("passed" if ok else "FAILED (top-k ids or trees differ)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
