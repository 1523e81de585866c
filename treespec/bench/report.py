"""A benchmark's figures as plain JSON (:func:`to_json`: the fields the package docstring
lists, the files under benchmarks/results/) and the lines above its table
(:func:`header_lines`)."""

from __future__ import annotations

import statistics

from ..machine import machine_info
from .configs import HF_GENERATE, TREESPEC
from .results import BenchResult, ConfigResult, RunRecord


def _config_figures(r: ConfigResult, base: ConfigResult) -> dict:
    d = r.config.describe()
    if r.warmup_seconds is not None:
        d["warmup_seconds"] = r.warmup_seconds
    if r.skipped:
        d["skipped"] = r.skipped
        return d
    tokens = sum(len(x.tokens) for x in r.runs)
    seconds = sum(x.seconds for x in r.runs)
    btokens = sum(len(x.tokens) for x in base.runs)
    bseconds = sum(x.seconds for x in base.runs)
    tps = tokens / seconds if seconds > 0 else 0.0
    btps = btokens / bseconds if bseconds > 0 else 0.0
    ratios = [x.tokens_per_second / b.tokens_per_second for x, b in zip(r.runs, base.runs) if b.tokens_per_second > 0]
    d.update(
        num_prompts=len(r.runs), total_tokens=tokens, total_seconds=seconds, tokens_per_second=tps,
        median_tokens_per_second=statistics.median(x.tokens_per_second for x in r.runs),
        speedup=tps / btps if btps > 0 else None,
        median_speedup=statistics.median(ratios) if ratios else None,
        mismatches=len(r.mismatches), first_mismatch=r.mismatches[0] if r.mismatches else None,
        near_ties=len(r.mismatches) - len(r.unexplained), unexplained=len(r.unexplained),
        divergences={str(i): d.describe() for i, d in r.divergences.items()},
        mean_accepted_length=None, acceptance_rate_by_position=None,
    )
    if r.config.kind == TREESPEC:
        ms = [x.metrics for x in r.runs]
        acc = [a for m in ms for a in m["accepted"]]
        steps = sum(m["num_request_steps"] for m in ms)
        depth = max((len(m["acceptance_counts"]) for m in ms), default=0)
        counts = [sum(m["acceptance_counts"][j] for m in ms if j < len(m["acceptance_counts"])) for j in range(depth)]
        # Positions the tree could draft but never got accepted are real zeros, not gaps.
        depth = max(depth, r.config.tree.depth)
        counts += [0] * (depth - len(counts))
        split = {k: sum(m[k] for m in ms) for k in ("prefill_seconds", "draft_seconds", "verify_seconds")}
        engine_total = sum(m["total_seconds"] for m in ms)
        d.update(
            mean_accepted_length=(sum(acc) + len(acc)) / max(len(acc), 1),
            acceptance_rate_by_position=[c / max(steps, 1) for c in counts] if r.config.speculates else None,
            num_steps=sum(m["num_steps"] for m in ms),
            tree_tokens=sum(m["tree_tokens"] for m in ms),
            mean_tree_size=sum(m["mean_tree_size"] * m["num_request_steps"] for m in ms) / max(steps, 1),
            **split,
            other_seconds=max(engine_total - sum(split.values()), 0.0),
            compile_seconds=sum(m.get("compile_seconds", 0.0) for m in ms),  # inside the timed calls
            time_split={k.replace("_seconds", ""): v / engine_total if engine_total > 0 else 0.0
                        for k, v in split.items()},
        )
    return d


def _category_figures(res: BenchResult, r: ConfigResult) -> dict:
    """Per category (in the order the prompts bring them): tokens/s and speedup over HF
    generate (total tokens / total seconds over the category's prompts, as everywhere
    here), tau, and Spec-Bench's own speedup (mean per-question tokens/s over the baseline's,
    which weighs each question alike where the pooled rate weighs each second alike); overall,
    the mean of the categories' speedups and Spec-Bench's "Overall" (its ratio over every
    question)."""
    cats = {}
    for c in dict.fromkeys(c for c in res.categories if c is not None):
        idx = [i for i, x in enumerate(res.categories) if x == c]
        tps = _rate([r.runs[i] for i in idx])
        btps = _rate([res.baseline.runs[i] for i in idx])
        acc = [a for i in idx if r.runs[i].metrics is not None for a in r.runs[i].metrics["accepted"]]
        cats[c] = dict(num_prompts=len(idx), tokens_per_second=tps, speedup=tps / btps if btps > 0 else None,
                       spec_bench_speedup=spec_bench_ratio(r.runs, res.baseline.runs, idx),
                       mean_accepted_length=(sum(acc) + len(acc)) / len(acc) if acc else None)
    speedups = [v["speedup"] for v in cats.values()]
    overall = sum(speedups) / len(speedups) if speedups and None not in speedups else None
    every = [i for i, x in enumerate(res.categories) if x is not None]
    return {"categories": cats, "overall_speedup": overall,
            "overall_spec_bench_speedup": spec_bench_ratio(r.runs, res.baseline.runs, every)}


def spec_bench_ratio(runs, base_runs, idx: list[int]) -> float | None:
    """Spec-Bench's speedup over the prompts ``idx`` (its evaluation/speed.py): the mean of each
    prompt's tokens/s over the mean of the baseline's; None where a prompt took no time."""
    rates = [[len(x[i].tokens) / x[i].seconds if x[i].seconds > 0 else None for i in idx] for x in (runs, base_runs)]
    if not idx or None in rates[0] or None in rates[1] or sum(rates[1]) <= 0:
        return None
    return sum(rates[0]) / sum(rates[1])


def _rate(runs: list[RunRecord]) -> float:
    seconds = sum(x.seconds for x in runs)
    return sum(len(x.tokens) for x in runs) / seconds if seconds > 0 else 0.0


def _prompt_figures(res: BenchResult) -> list[dict]:
    base = res.baseline
    out = []
    for i, n in enumerate(res.prompt_lengths):
        per = {}
        for r in res.results:
            if r.skipped:
                continue
            x = r.runs[i]
            b = base.runs[i]
            e = dict(new_tokens=len(x.tokens), seconds=x.seconds, tokens_per_second=x.tokens_per_second,
                     speedup=x.tokens_per_second / b.tokens_per_second if b.tokens_per_second > 0 else None)
            if res.sampling.greedy and r is not base:
                e["matches_hf_generate"] = i not in r.mismatches
                if i in r.first_diff:
                    e["first_differing_token"] = r.first_diff[i]
            if x.metrics is not None:
                e.update(num_steps=x.metrics["num_steps"], mean_accepted_length=x.metrics["mean_accepted_length"],
                         draft_seconds=x.metrics["draft_seconds"], verify_seconds=x.metrics["verify_seconds"],
                         prefill_seconds=x.metrics["prefill_seconds"])
            per[r.config.name] = e
        extra = {"category": res.categories[i]} if res.categories and res.categories[i] is not None else {}
        if res.turns and res.turns[i] > 1:
            extra["turns"] = res.turns[i]
        out.append({"index": i, "prompt_tokens": n, **extra, "results": per})
    return out


def to_json(res: BenchResult, **extra) -> dict:
    """Everything as plain JSON types: ``machine``, ``settings``, ``configs``, ``prompts``,
    ``mismatches`` (treespec prompts differing from HF generate), ``notes``; where the prompts
    have categories (Spec-Bench), ``categories`` (their names, in order) and in each config
    ``categories`` (name -> tokens/s, speedup, Spec-Bench's speedup, tau), ``overall_speedup``
    and ``overall_spec_bench_speedup``; the names of the
    ``same_path_baseline`` and the ``best_baseline``; ``settings.packing``, the start-up packing
    choice; ``extra`` keys (e.g. ``command``, ``model``, ``dataset``) are merged at the top level."""
    base = res.baseline
    sp = res.sampling
    configs = [_config_figures(r, base) for r in res.results]
    categories = list(dict.fromkeys(c for c in res.categories if c is not None))
    if categories:
        for c, r in zip(configs, res.results):
            if not c.get("skipped"):
                c.update(_category_figures(res, r))
    ran = [(c, r) for c, r in zip(configs, res.results) if not c.get("skipped")]
    # The fastest way to decode without speculation that ran here (plain HF generate, HF
    # generate on the fast path, treespec with root-only trees): speculation's own share.
    best = max((x for x in ran if not x[1].config.speculates), key=lambda x: x[0]["tokens_per_second"])
    # The same-path baseline: HF generate on plain or on packed weights, whichever ran faster
    # here (packing can slow HF's one-token decode while it speeds treespec's tree forwards).
    same = max((x for x in ran if x[1].config.kind == HF_GENERATE and not x[1].config.compiled),
               key=lambda x: x[0]["tokens_per_second"])
    _ratios_to(ran, best, "best_baseline")
    _ratios_to(ran, same, "same_path")
    return {
        **extra,
        "machine": machine_info(),
        "settings": {"max_new_tokens": res.max_new_tokens, "temperature": sp.temperature, "top_k": sp.top_k,
                     "top_p": sp.top_p, "min_p": sp.min_p, "seed": res.seed, "num_prompts": len(res.prompt_lengths),
                     "dtype": res.dtype, "fast_path": res.fast_path,
                     "packing": None if res.packing is None else {**res.packing.to_json(),
                                                                  "summary": res.packing.describe()}},
        "best_baseline": best[0]["name"],
        "same_path_baseline": same[0]["name"],
        **({"categories": categories} if categories else {}),
        "configs": configs,
        "prompts": _prompt_figures(res),
        "mismatches": res.treespec_mismatches,
        "unexplained_mismatches": res.treespec_unexplained,
        "notes": list(res.notes),
    }


def _ratios_to(ran: list[tuple[dict, ConfigResult]], base: tuple[dict, ConfigResult], key: str) -> None:
    """Each configuration's ``speedup_vs_{key}`` (tokens/s over ``base``'s) and its median over
    prompts, ``median_speedup_vs_{key}``."""
    btps, bruns = base[0]["tokens_per_second"], base[1].runs
    for c, r in ran:
        c[f"speedup_vs_{key}"] = c["tokens_per_second"] / btps if btps > 0 else None
        ratios = [x.tokens_per_second / b.tokens_per_second for x, b in zip(r.runs, bruns) if b.tokens_per_second > 0]
        c[f"median_speedup_vs_{key}"] = statistics.median(ratios) if ratios else None


def header_lines(data: dict) -> list[str]:
    """What the ratios rest on, for the lines above the table: the weights treespec ran on
    with the start-up timings that chose them, and the same-path baseline with this run's
    HF generate rates on plain and packed weights."""
    lines = []
    packing = data["settings"].get("packing")
    if packing is not None:
        lines.append(f"packing: {packing['summary']}")
    rates = {c["name"]: c["tokens_per_second"] for c in data["configs"] if not c.get("skipped")}
    same = data.get("same_path_baseline")
    plain, packed = rates.get(HF_GENERATE), rates.get(f"{HF_GENERATE}+fast")
    if same is not None and plain is not None and packed is not None:
        lines.append(f"same-path baseline: {same}, HF generate on {'packed' if same != HF_GENERATE else 'plain'} "
                     f"weights, the faster here ({packed:.1f} tok/s packed, {plain:.1f} plain)")
    elif same is not None:
        lines.append(f"same-path baseline: {same} (HF generate did not run on packed weights)")
    compiled = [c for c in data["configs"] if c.get("compiled") and c.get("warmup_seconds") is not None]
    if compiled:
        lines.append("compiled: the untimed warm-up compiled for " + ", ".join(
            f"{c['warmup_seconds']:.0f} s ({c['name']})" for c in compiled))
        late = [c for c in compiled if c.get("compile_seconds")]
        lines.append("  and inside the timed calls (rows or trees the warm-up did not reach; counted in tok/s): " + (
            ", ".join(f"{c['compile_seconds']:.1f} s ({c['name']})" for c in late) if late else "none"))
    return lines
