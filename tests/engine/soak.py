"""Soak test: many requests of mixed lengths through ``treespec.generate`` on the shipped pair.

    python tests/engine/soak.py                 # 1,000 requests (tens of minutes on 2 cores)
    python tests/engine/soak.py --requests 30   # a quick look
    python tests/engine/soak.py --out benchmarks/results/soak.json
    python tests/engine/soak.py --requests 60 --prefix-cache-mb 16  # with a shared PrefixCache

SmolLM2-135M-Instruct with its shipped EAGLE-3 head, prompts from the packaged GSM8K test and
HumanEval sets (one to three questions joined, so prompt lengths vary about tenfold), in
batches of 1 to ``--max-batch`` requests, each batch greedy or sampled (temperature 0.7,
top-p 0.9, a seed) and with its own ``max_new_tokens`` in ``--min-new..--max-new`` and its own
tree. It checks, and exits 1 when any check fails:

- every request ends: it holds ``max_new_tokens`` tokens, or fewer ending in EOS, and its
  metrics agree with its tokens;
- the model's attention implementation (``model.config._attn_implementation``) is back to
  what it was after every batch, including after an exception raised in the middle of a
  generation and after a KeyboardInterrupt raised inside a stream (both injected every
  ``--fault-every`` batches: from inside the target's forward, and from the code consuming
  ``treespec.stream``);
- no KV cache outlives its generation (every ``PagedKVCache`` is garbage once its batch is
  done), and the largest cache any batch allocated stays within what its requests need;
- the process's resident memory (RSS) does not grow: RSS after the run is within
  ``--rss-tolerance-mb`` of RSS after the warm-up batches;
- greedy output still equals HF generate's on a fixed prompt after every injected fault;
- with ``--prefix-cache-mb``, the prefix cache (shared by every generation of the run; every third
  batch asks earlier prompts again, each followed by its answer, as a conversation's next turn
  begins: not longer than the others, so that the RSS check still compares like with like)
  stays within its budget, its accounting balances (``PrefixCache.check``) and no page stays
  held after a batch or a fault.

It prints a short summary and, with ``--out``, writes it as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

import treespec  # noqa: E402
from treespec import runner as ts_runner  # noqa: E402
from treespec.prompts import encode_prompt  # noqa: E402
from treespec.data import load_dataset  # noqa: E402
from treespec.kv_cache import PagedKVCache  # noqa: E402
from treespec.models import load  # noqa: E402

TREES = ("chain-2", "chain-2", "chain-1", "cpu-tiny")  # chain-2 most often: the recommended tree
FAULT_STEP = 3  # the injected fault fires at this target forward of the generation (prefill is 1)


class InjectedFault(RuntimeError):
    """The exception the soak raises in the middle of a generation."""


def rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# Every KV cache made, weakly held: one still alive after its batch is a leak.
LIVE_CACHES: "weakref.WeakSet[PagedKVCache]" = weakref.WeakSet()
_cache_init = PagedKVCache.__init__


def _tracked_init(self, *args, **kwargs):
    _cache_init(self, *args, **kwargs)
    LIVE_CACHES.add(self)


def cache_bytes(cache: PagedKVCache) -> int:
    return sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))


class FaultyForward:
    """Replaces ``ModelRunner.forward`` for one generation: raises ``exc`` at call ``at``."""

    def __init__(self, exc: BaseException, at: int = FAULT_STEP):
        self.exc, self.at, self.calls = exc, at, 0
        self.real = ts_runner.ModelRunner.forward

    def __enter__(self):
        fault = self

        def forward(runner, *args, **kwargs):
            fault.calls += 1
            if fault.calls == fault.at:
                raise fault.exc
            return fault.real(runner, *args, **kwargs)

        ts_runner.ModelRunner.forward = forward
        return self

    def __exit__(self, *exc):
        ts_runner.ModelRunner.forward = self.real
        return False


def make_prompts(tok, n: int, rng: random.Random) -> list[list[int]]:
    """``n`` chat prompts of one to three GSM8K/HumanEval questions each."""
    texts = [r["question"] for r in load_dataset("gsm8k-test")] + [r["prompt"] for r in load_dataset("humaneval")]
    return [encode_prompt(tok, "\n\n".join(rng.sample(texts, rng.choice((1, 1, 2, 3)))), chat=True)
            for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--max-batch", type=int, default=8, help="batches hold 1..N requests (default: %(default)s)")
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--fault-every", type=int, default=25, metavar="N",
                   help="inject the faults after every N batches (default: %(default)s; 0: never)")
    p.add_argument("--warmup-batches", type=int, default=5, help="batches before the RSS baseline")
    p.add_argument("--rss-tolerance-mb", type=float, default=64.0)
    p.add_argument("--prefix-cache-mb", type=float, default=0.0,
                   help="a PrefixCache of this many MB shared by every generation (default: none, as the "
                        "documented 1,000-request run had; tests/engine/test_soak.py gives 4)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)
    if args.requests < 1 or not 1 <= args.min_new <= args.max_new or args.max_batch < 1:
        p.error("need --requests >= 1, 1 <= --min-new <= --max-new and --max-batch >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    PagedKVCache.__init__ = _tracked_init

    t_load = time.perf_counter()
    model, tok = load("smollm2-135m-instruct")
    draft = treespec.load_draft("smollm2-135m-instruct-eagle", model)
    load_seconds = time.perf_counter() - t_load
    attn = model.config._attn_implementation
    eos = {model.generation_config.eos_token_id} if isinstance(model.generation_config.eos_token_id, int) \
        else set(model.generation_config.eos_token_id or ())
    prompts = make_prompts(tok, args.requests, rng)
    lengths = sorted(len(x) for x in prompts)

    # The fixed greedy check: HF generate's reference, compared after every fault.
    probe = prompts[0]
    ids = torch.tensor([probe])
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                               do_sample=False)[0, len(probe):].tolist()

    failures: list[str] = []
    pcache = treespec.PrefixCache(max_bytes=int(args.prefix_cache_mb * 2**20)) if args.prefix_cache_mb > 0 else None
    history: list[list[int]] = []  # earlier prompts, each followed by its answer: how next turns begin

    def check(ok: bool, what: str):
        if not ok:
            failures.append(what)
            print(f"FAIL: {what}", file=sys.stderr)

    def check_clean(where: str):
        check(model.config._attn_implementation == attn,
              f"{where}: attention implementation is {model.config._attn_implementation!r}, not {attn!r}")
        gc.collect()
        check(len(LIVE_CACHES) == 0, f"{where}: {len(LIVE_CACHES)} KV cache(s) still alive")
        if pcache is not None:
            try:
                pcache.check()
            except AssertionError as err:
                check(False, f"{where}: the prefix cache's accounting does not balance: {err}")
            held = pcache.stats()["pages_in_use"]
            check(held == 0, f"{where}: {held} prefix cache page(s) still held")

    def inject_faults(where: str) -> dict:
        counts = {"exception": 0, "interrupt_inside": 0, "interrupt_consumer": 0}
        batch = prompts[:2]
        try:  # an exception from inside the target's forward, in the middle of a generation
            with FaultyForward(InjectedFault("injected")):
                treespec.generate(model, draft, "chain-2", batch, max_new_tokens=16, prefix_cache=pcache)
            check(False, f"{where}: the injected exception did not surface")
        except InjectedFault:
            counts["exception"] += 1
        check_clean(f"{where}, after an exception mid-generation")
        try:  # Ctrl-C arriving during a forward inside a stream
            with FaultyForward(KeyboardInterrupt()):
                for _ in treespec.stream(model, draft, "cpu-tiny", batch, max_new_tokens=16, temperature=0.7, seed=1,
                                         prefix_cache=pcache):
                    pass
            check(False, f"{where}: the injected KeyboardInterrupt did not surface")
        except KeyboardInterrupt:
            counts["interrupt_inside"] += 1
        check_clean(f"{where}, after a KeyboardInterrupt inside a stream")
        try:  # Ctrl-C in the code reading the stream, between two steps
            steps = treespec.stream(model, draft, "chain-2", batch, max_new_tokens=16, prefix_cache=pcache)
            for i, _ in enumerate(steps):
                if i == 1:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            counts["interrupt_consumer"] += 1
            del steps  # dropped unfinished, as a program handling Ctrl-C drops it: Python closes it
        check_clean(f"{where}, after a KeyboardInterrupt while consuming a stream")
        out = treespec.generate(model, draft, "chain-2", probe, max_new_tokens=16)
        check(out.sequences[0] == reference, f"{where}: greedy output differs from HF generate after the faults")
        return counts

    faults = {"exception": 0, "interrupt_inside": 0, "interrupt_consumer": 0}
    rss = []
    done = batches = generated = greedy = sampled = hit_tokens = 0
    cache_peak = {"bytes": 0}
    real_new_cache = ts_runner.ModelRunner.new_cache

    def new_cache(runner, tokens_per_seq, page_size=16):
        cache = real_new_cache(runner, tokens_per_seq, page_size)
        cache_peak["bytes"] = max(cache_peak["bytes"], cache_bytes(cache))
        # What the requests need: their pages, one spare page each, nothing more.
        per_token = 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * torch.tensor(
            [], dtype=runner.dtype).element_size()
        pages = sum(-(-int(n) // page_size) + 1 for n in tokens_per_seq)
        cache_peak["bound"] = max(cache_peak.get("bound", 0), pages * page_size * per_token)
        check(cache_bytes(cache) <= pages * page_size * per_token,
              f"a KV cache of {cache_bytes(cache)} bytes for {list(tokens_per_seq)} tokens")
        return cache

    ts_runner.ModelRunner.new_cache = new_cache
    t0 = time.perf_counter()
    rss_start = rss_mb()
    baseline = None
    try:
        while done < args.requests:
            n = min(rng.randint(1, args.max_batch), args.requests - done)
            batch = prompts[done:done + n]
            if pcache is not None and history and batches % 3 == 2:  # next turns of earlier conversations
                batch = [rng.choice(history) for _ in batch]
            max_new = rng.randint(args.min_new, args.max_new)
            tree = rng.choice(TREES)
            sample = rng.random() < 0.5
            kw = dict(temperature=0.7, top_p=0.9, seed=rng.randrange(2**31)) if sample else {}
            out = treespec.generate(model, draft, tree, batch, max_new_tokens=max_new, prefix_cache=pcache, **kw)
            history = (history + [p + s for p, s in zip(batch, out.sequences)])[-20:]
            hit_tokens += out.metrics.hit_tokens
            check(len(out.sequences) == n, f"batch {batches}: {len(out.sequences)} outputs for {n} requests")
            for i, (seq, m) in enumerate(zip(out.sequences, out.metrics.requests)):
                ended = len(seq) == max_new or (0 < len(seq) < max_new and seq[-1] in eos)
                check(ended, f"batch {batches} request {i}: {len(seq)} tokens of {max_new}, last {seq[-1:]}")
                check(m.num_generated == len(seq), f"batch {batches} request {i}: metrics say "
                      f"{m.num_generated} tokens, the output holds {len(seq)}")
                generated += len(seq)
            done += n
            batches += 1
            greedy += 0 if sample else n
            sampled += n if sample else 0
            check_clean(f"batch {batches}")
            rss.append(rss_mb())
            if batches == args.warmup_batches:
                baseline = rss[-1]
            if args.fault_every and batches % args.fault_every == 0:
                for k, v in inject_faults(f"faults after batch {batches}").items():
                    faults[k] += v
            if batches % 10 == 0 or done == args.requests:
                print(f"{done}/{args.requests} requests, {batches} batches, RSS {rss[-1]:.0f} MB, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
        if not any(faults.values()) and args.fault_every:  # a short run still tries every fault once
            for k, v in inject_faults("faults at the end").items():
                faults[k] += v
    finally:
        ts_runner.ModelRunner.new_cache = real_new_cache
        PagedKVCache.__init__ = _cache_init
    seconds = time.perf_counter() - t0
    gc.collect()
    rss_end = rss_mb()
    baseline = baseline if baseline is not None else rss[0]
    growth = rss_end - baseline
    check(growth <= args.rss_tolerance_mb,
          f"RSS grew {growth:.0f} MB after the warm-up ({baseline:.0f} -> {rss_end:.0f} MB)")

    summary = {
        "command": "python tests/engine/soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "requests": done, "batches": batches, "greedy_requests": greedy, "sampled_requests": sampled,
        "generated_tokens": generated, "seconds": round(seconds, 1), "load_seconds": round(load_seconds, 1),
        "tokens_per_second": round(generated / seconds, 2) if seconds > 0 else None,
        "prompt_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]},
        "max_new_tokens": [args.min_new, args.max_new], "max_batch": args.max_batch, "trees": sorted(set(TREES)),
        "faults_injected": faults,
        "rss_mb": {"before_first_batch": round(rss_start, 1), "after_warmup": round(baseline, 1),
                   "max": round(max(rss), 1), "end": round(rss_end, 1), "growth_after_warmup": round(growth, 1)},
        "kv_cache": {"largest_bytes": cache_peak["bytes"], "bound_bytes": cache_peak.get("bound", 0),
                     "alive_after_run": len(LIVE_CACHES)},
        "prefix_cache": None if pcache is None else {**pcache.stats(), "hit_tokens_in_batches": hit_tokens},
        "attn_implementation": {"expected": attn, "end": model.config._attn_implementation},
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "failures": failures,
    }
    print(f"soak: {done} requests in {batches} batches ({greedy} greedy, {sampled} sampled), {generated} tokens "
          f"in {seconds:.0f} s ({summary['tokens_per_second']} tok/s); prompts {lengths[0]}-{lengths[-1]} tokens")
    print(f"faults injected: {faults['exception']} exceptions mid-generation, {faults['interrupt_inside']} "
          f"KeyboardInterrupts inside a stream, {faults['interrupt_consumer']} while consuming one")
    print(f"RSS: {rss_start:.0f} MB before, {baseline:.0f} MB after warm-up, max {max(rss):.0f}, end {rss_end:.0f} "
          f"({growth:+.0f} MB); largest KV cache {cache_peak['bytes'] / 2**20:.1f} MB; "
          f"attention implementation {model.config._attn_implementation!r} (expected {attn!r})")
    if pcache is not None:
        st = pcache.stats()
        print(f"prefix cache: {st['bytes'] / 2**20:.1f} of {st['max_bytes'] / 2**20:.1f} MB, {st['pages']} pages; "
              f"{hit_tokens} prompt tokens served in batches, {st['evicted_pages']} pages evicted")
    print("soak: " + ("PASS" if not failures else f"FAIL ({len(failures)} check(s); first: {failures[0]})"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
