"""What `run.py` hands an engine and what it makes of the answer, with no engine needed:
the request a peer script reads (:func:`llama_request`, :func:`vllm_request`) and the peer's
rows merged into a `treespec bench` report (:func:`merge_peers`), figured as the bench figures
its own rows.

A peer row is a configuration of kind ``peer`` (``treespec.bench.PEER``) named
``peer:ENGINE[+VARIANT]``: tokens/s, speedup over the report's HF generate (pooled and the
median over prompts), over its best and same-path baselines, per Spec-Bench category where
the report has them; and, per prompt, whether the output equals HF generate's and the
engine's own plain run's; where the engine counts its speculation (vLLM), the mean acceptance
length and the acceptance by position. Another engine's arithmetic (llama.cpp on the GGUF's
quantized weights, vLLM with its own CPU kernels) is not HF's: a difference is counted, never
judged and never an error.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from treespec.bench import PEER

PREFIX = "peer:"
NGRAM_LOOKUP = (1, 3)  # vllm+ngram's prompt_lookup_min and _max: treespec's NgramDrafter's n-gram lengths
COMMAND_NOTE = "peer rows added by: "  # the note that names the command, replaced when it runs again


@dataclass(frozen=True)
class PeerSettings:
    """How the engine runs: the bench's own budget and threads, greedy."""

    max_new_tokens: int
    threads: int                # the bench's torch threads: llama.cpp's n_threads and n_threads_batch
    eos_token_ids: tuple[int, ...]  # HF generate stops at these (the model's generation_config); so does the peer
    lookup_tokens: int = 3      # llama.cpp+lookup: LlamaPromptLookupDecoding(num_pred_tokens=K); 0: not run
    repack: bool = False        # llama.cpp's repacked (AMX) weights: off, they crashed on multi-token batches here
    warmup: bool = True         # one untimed generate per configuration first, as the bench does


@dataclass(frozen=True)
class PeerRun:
    """One configuration on one prompt, every turn: tokens concatenated, seconds summed."""

    tokens: list[int]
    seconds: float
    turn_lengths: list[int]
    # the engine's own count of its speculation where it keeps one (vLLM): ``drafts`` (steps that
    # drafted), ``accepted`` (drafted tokens accepted), ``accepted_per_position``; None: not counted
    spec: dict | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def llama_names(s: PeerSettings) -> list[str]:
    """The llama.cpp configurations, plain first (the others are compared with it)."""
    return [f"{PREFIX}llama.cpp"] + ([f"{PREFIX}llama.cpp+lookup"] if s.lookup_tokens else [])


def llama_request(gguf: str, s: PeerSettings, prompts: dict[int, dict[str, list[int]]], warmup_ids: list[int]) -> dict:
    """The JSON `llama_peer.py` reads: the GGUF, the settings, each configuration, and per
    prompt (by its index in the report) the token ids each configuration is given (the same
    for a first turn; a later turn follows that configuration's own answers)."""
    configs = [{"name": n, "lookup_tokens": s.lookup_tokens if n.endswith("+lookup") else None}
               for n in llama_names(s)]
    return {
        "gguf": gguf, "threads": s.threads, "max_new_tokens": s.max_new_tokens,
        "eos_token_ids": list(s.eos_token_ids), "repack": s.repack, "configs": configs,
        # as run_bench warms up: the first prompt's first 16 ids, 16 new tokens at most
        "warmup": {"ids": list(warmup_ids[:16]), "max_new_tokens": min(16, s.max_new_tokens)} if s.warmup else None,
        "prompts": [{"index": i, "ids": {n: list(ids[n]) for n in llama_names(s)}} for i, ids in prompts.items()],
    }


@dataclass(frozen=True)
class VllmSettings:
    """What vLLM runs besides the bench's budget and threads (PeerSettings)."""

    model: str                  # the bench's target as a Hugging Face folder
    dtype: str                  # the report's dtype (bfloat16 or float32)
    head: str | None = None     # an EAGLE-3 head folder: the +eagle3-K rows; None: none
    eagle_chains: tuple[int, ...] = (3, 5)  # vllm+eagle3-K: the head drafting chains of K tokens
    ngram_tokens: int = 3       # vllm+ngram-K: vLLM's n-gram lookup drafting K tokens; 0: not run


def vllm_configs(v: VllmSettings) -> list[dict]:
    """The vLLM configurations, plain first: each a name and vLLM's ``speculative_config``."""
    out = [{"name": f"{PREFIX}vllm", "speculative_config": None}]
    if v.head:
        out += [{"name": f"{PREFIX}vllm+eagle3-{k}",
                 "speculative_config": {"method": "eagle3", "model": v.head, "num_speculative_tokens": k}}
                for k in v.eagle_chains]
    if v.ngram_tokens:
        lo, hi = NGRAM_LOOKUP
        out.append({"name": f"{PREFIX}vllm+ngram-{v.ngram_tokens}",
                    "speculative_config": {"method": "ngram", "num_speculative_tokens": v.ngram_tokens,
                                           "prompt_lookup_max": hi, "prompt_lookup_min": lo}})
    return out


def vllm_request(v: VllmSettings, s: PeerSettings, config: dict, prompts: dict[int, list[int]],
                 warmup_ids: list[int]) -> dict:
    """The JSON `vllm_peer.py` reads: one configuration (an entry of :func:`vllm_configs`), the
    model folder, dtype and settings, and per prompt (by its index in the report) its token ids."""
    return {
        "model": v.model, "dtype": v.dtype, "threads": s.threads, "max_new_tokens": s.max_new_tokens,
        "eos_token_ids": list(s.eos_token_ids), "config": config,
        "warmup": {"ids": list(warmup_ids[:16]), "max_new_tokens": min(16, s.max_new_tokens)} if s.warmup else None,
        "prompts": [{"index": i, "ids": list(ids)} for i, ids in prompts.items()],
    }


def add_spec(a: dict | None, b: dict | None) -> dict | None:
    """Two speculation counts (:class:`PeerRun`'s ``spec``) summed; None if either is None."""
    if a is None or b is None:
        return None
    pa, pb = a["accepted_per_position"], b["accepted_per_position"]
    n = max(len(pa), len(pb))
    per = [x + y for x, y in zip(pa + [0] * (n - len(pa)), pb + [0] * (n - len(pb)))]
    return {"drafts": a["drafts"] + b["drafts"], "accepted": a["accepted"] + b["accepted"],
            "accepted_per_position": per}


def _tau(spec: dict | None) -> float | None:
    """The mean acceptance length as vLLM figures it: 1 + accepted / drafting steps."""
    return None if spec is None or not spec["drafts"] else 1 + spec["accepted"] / spec["drafts"]


def _pooled_spec(rs: list[PeerRun]) -> dict | None:
    total = {"drafts": 0, "accepted": 0, "accepted_per_position": []}
    for r in rs:
        total = add_spec(total, r.spec)
    return total


def merge_peers(data: dict, engine: dict, runs: dict[str, list[PeerRun]], hf_tokens: list[list[int]] | None,
                command: str | None = None) -> dict:
    """``data`` (a bench report) with the peer's rows in place of any earlier ones of the same
    names: a configuration per entry of ``runs`` (name -> one run per prompt, in the
    report's order; the first name is the engine's plain run), each prompt's results, and a
    note per row saying how often its output matched. ``engine``: ``engine``, ``version``,
    ``settings`` (kept in each row), ``descriptions`` (name -> what the table's legend
    says of that row) and optionally ``arithmetic`` (what its notes say it computes on).
    Rows whose runs carry the engine's speculation counts get tau and the acceptance by
    position from them (vLLM's figures: over the steps that drafted). ``hf_tokens``: HF
    generate's output per prompt, None where unknown.
    ``command``: the command that added the rows, said in a note."""
    if data["settings"]["temperature"] != 0:
        raise ValueError("peer rows are for greedy reports (temperature 0): this one sampled")
    n = len(data["prompts"])
    bad = [name for name, rs in runs.items() if len(rs) != n or not name.startswith(PREFIX)]
    if bad:
        raise ValueError(f"peer rows {bad}: need names starting with {PREFIX!r} and one run for each of {n} prompts")
    out = {**data, "configs": [c for c in data["configs"] if c["name"] not in runs],
           "prompts": [{**p, "results": {k: v for k, v in p["results"].items() if k not in runs}}
                       for p in data["prompts"]],
           "notes": [x for x in data["notes"]
                     if not x.startswith(COMMAND_NOTE) and not any(x.startswith(f"{name}:") for name in runs)]}
    plain = next(iter(runs))
    for name, rs in runs.items():
        same_hf = None if hf_tokens is None else [r.tokens == list(h) for r, h in zip(rs, hf_tokens)]
        same_plain = None if name == plain else [r.tokens == p.tokens for r, p in zip(rs, runs[plain])]
        out["configs"].append(_row(out, name, engine, rs, same_hf, same_plain))
        for i, (p, r) in enumerate(zip(out["prompts"], rs)):
            p["results"][name] = _prompt_entry(out, i, r, hf_tokens, same_plain)
        out["notes"].append(_note(name, same_hf, same_plain, plain, engine.get("arithmetic", "")))
    if command is not None:
        out["notes"].append(COMMAND_NOTE + command)
    return out


def _row(data: dict, name: str, engine: dict, rs: list[PeerRun], same_hf, same_plain) -> dict:
    base = _baseline_runs(data, data["configs"][0]["name"])  # HF generate, the baseline of every speedup
    tokens, seconds = sum(len(r.tokens) for r in rs), sum(r.seconds for r in rs)
    tps = tokens / seconds if seconds > 0 else 0.0
    row = {
        "name": name, "kind": PEER, "fast": False, "engine": engine["engine"], "version": engine["version"],
        "description": engine["descriptions"][name], "settings": engine.get("settings", {}),
        "num_prompts": len(rs), "total_tokens": tokens, "total_seconds": seconds, "tokens_per_second": tps,
        "median_tokens_per_second": statistics.median(r.tokens_per_second for r in rs),
        "mismatches": None if same_hf is None else same_hf.count(False),
        "first_mismatch": None if same_hf is None or all(same_hf) else same_hf.index(False),
        "differs_from_plain": None if same_plain is None else same_plain.count(False),
        "mean_accepted_length": None, "acceptance_rate_by_position": None,
    }
    spec = _pooled_spec(rs)
    if spec is not None and spec["drafts"]:
        row["mean_accepted_length"] = _tau(spec)
        row["acceptance_rate_by_position"] = [a / spec["drafts"] for a in spec["accepted_per_position"]]
    for key, field in (("speedup", None), ("speedup_vs_best_baseline", "best_baseline"),
                       ("speedup_vs_same_path", "same_path_baseline")):
        other = data["configs"][0]["name"] if field is None else data.get(field)
        if other is None:
            continue
        pooled, median = _ratios(rs, _baseline_runs(data, other))
        row[key], row["median_" + key] = pooled, median
    if data.get("categories"):
        row.update(_category_figures(data, rs, base))
    return row


def _baseline_runs(data: dict, name: str) -> list[tuple[int, float]]:
    """(tokens, seconds) per prompt of the report's configuration ``name``."""
    return [(p["results"][name]["new_tokens"], p["results"][name]["seconds"]) for p in data["prompts"]]


def _ratios(rs: list[PeerRun], base: list[tuple[int, float]]) -> tuple[float | None, float | None]:
    """tokens/s over ``base``'s, pooled (total tokens / total seconds) and the median of the
    per-prompt ratios, as the bench figures its own rows."""
    btps = _rate(base)
    pooled = _rate([(len(r.tokens), r.seconds) for r in rs]) / btps if btps > 0 else None
    ratios = [r.tokens_per_second / (t / s) for r, (t, s) in zip(rs, base) if s > 0 and t > 0]
    return pooled, statistics.median(ratios) if ratios else None


def _rate(runs: list[tuple[int, float]]) -> float:
    seconds = sum(s for _, s in runs)
    return sum(t for t, _ in runs) / seconds if seconds > 0 else 0.0


def _category_figures(data: dict, rs: list[PeerRun], base: list[tuple[int, float]]) -> dict:
    """Per category: pooled tokens/s and speedup, Spec-Bench's ratio (the mean of per-question
    tokens/s over the baseline's mean); overall: the mean of the categories' speedups and
    Spec-Bench's ratio over every question (treespec.bench.report's figures, from the JSON)."""
    cats = {}
    cat_of = [p.get("category") for p in data["prompts"]]
    mine = [(len(r.tokens), r.seconds) for r in rs]
    for c in data["categories"]:
        idx = [i for i, x in enumerate(cat_of) if x == c]
        btps = _rate([base[i] for i in idx])
        tps = _rate([mine[i] for i in idx])
        cats[c] = dict(num_prompts=len(idx), tokens_per_second=tps, speedup=tps / btps if btps > 0 else None,
                       spec_bench_speedup=_spec_bench_ratio(mine, base, idx),
                       mean_accepted_length=_tau(_pooled_spec([rs[i] for i in idx])))
    speedups = [v["speedup"] for v in cats.values()]
    overall = sum(speedups) / len(speedups) if speedups and None not in speedups else None
    every = [i for i, x in enumerate(cat_of) if x is not None]
    return {"categories": cats, "overall_speedup": overall,
            "overall_spec_bench_speedup": _spec_bench_ratio(mine, base, every)}


def _spec_bench_ratio(mine, base, idx: list[int]) -> float | None:
    rates = [[t / s if s > 0 else None for t, s in (x[i] for i in idx)] for x in (mine, base)]
    if not idx or None in rates[0] or None in rates[1] or sum(rates[1]) <= 0:
        return None
    return sum(rates[0]) / sum(rates[1])


def _prompt_entry(data: dict, i: int, r: PeerRun, hf_tokens, same_plain) -> dict:
    b = data["prompts"][i]["results"][data["configs"][0]["name"]]
    e = dict(new_tokens=len(r.tokens), seconds=r.seconds, tokens_per_second=r.tokens_per_second,
             speedup=r.tokens_per_second / b["tokens_per_second"] if b["tokens_per_second"] > 0 else None)
    if hf_tokens is not None:
        hf = list(hf_tokens[i])
        e["matches_hf_generate"] = r.tokens == hf
        if r.tokens != hf:
            e["first_differing_token"] = next((k for k, (a, b) in enumerate(zip(r.tokens, hf)) if a != b),
                                              min(len(r.tokens), len(hf)))
    if same_plain is not None:
        e["matches_plain"] = same_plain[i]
    if r.spec is not None:
        e.update(spec=dict(r.spec), mean_accepted_length=_tau(r.spec))
    if len(r.turn_lengths) > 1:
        e["turn_lengths"] = list(r.turn_lengths)
    return e


def _note(name: str, same_hf, same_plain, plain: str, arithmetic: str) -> str:
    parts = []
    if same_hf is not None:
        on = f", {arithmetic}" if arithmetic else ""
        parts.append(f"output equal to hf-generate's on {sum(same_hf)} of {len(same_hf)} prompt(s) (another engine's "
                     f"arithmetic{on}: a difference is not judged)")
    if same_plain is not None:
        parts.append(f"equal to {plain}'s own on {sum(same_plain)} of {len(same_plain)}")
    return f"{name}: " + ("; ".join(parts) if parts else "output not compared (no HF generate tokens)")
