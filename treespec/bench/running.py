"""Running a benchmark: :func:`run_bench` puts every configuration through prompt i before
any through prompt i+1, each configuration inside the fast path or not, each multi-turn
prompt as a conversation; it records, journals and judges as it goes."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..divergence import NEAR_TIE_TOLERANCE
from ..engine import generate as ts_generate
from ..prompts import Prompt
from ..sampling_args import SamplingParams
from .configs import HF_GENERATE, HF_LOOKUP, TREESPEC, BenchConfig, BenchSettings
from .journal import Journal, journal_key
from .judge import Judge
from .results import BenchProgress, BenchResult, ConfigResult, RunRecord

log = logging.getLogger(__name__)


def _generation_config(model, max_new_tokens: int, sp: SamplingParams, lookup: int | None, compiled: bool = False,
                       cache_len: int | None = None, **options):
    """A GenerationConfig holding exactly our settings: the model's own generation config may
    carry sampling defaults (top_k=50, ...) that would silently change the baseline."""
    from transformers import CompileConfig, GenerationConfig

    mg = model.generation_config
    eos = mg.eos_token_id
    pad = mg.pad_token_id if mg.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad if pad is not None else 0,
              bos_token_id=mg.bos_token_id, do_sample=not sp.greedy, **options)
    if not sp.greedy:
        kw.update(temperature=float(sp.temperature), top_k=sp.top_k or 0, top_p=sp.top_p if sp.top_p is not None else 1.0,
                  min_p=sp.min_p)
    if lookup is not None:
        kw["prompt_lookup_num_tokens"] = lookup
    if compiled:
        compile_config = CompileConfig(fullgraph=True, dynamic=False)
        compile_config._compile_all_devices = True  # transformers compiles only on GPUs unless told
        kw.update(cache_implementation="static", compile_config=compile_config)
        if cache_len is not None and hasattr(GenerationConfig(), "max_cache_len"):  # transformers >= 5.2x
            kw["max_cache_len"] = cache_len  # every call on one cache size: one compile
    return GenerationConfig(**kw)


def hf_cache_len(prompts: Sequence[Prompt], max_new_tokens: int) -> int:
    """A static cache length every call of the bench fits in (a later turn holds the earlier
    turns and answers: twice a turn's length counted for each), a power of two."""
    need = max(p.num_turns * (2 * len(p.ids) + max_new_tokens) for p in prompts)
    return 1 << (need - 1).bit_length()


def _warmup_prompt(cfg: BenchConfig, prompts: Sequence[Prompt], s: BenchSettings) -> list[int]:
    """The warm-up's prompt: the first prompt's first 16 tokens; for HF's compiled baseline as
    long as its static cache allows, so that the warm-up allocates that cache and compiles for
    it (transformers reuses a static cache that is long enough), also where transformers has no
    ``max_cache_len``."""
    ids = list(prompts[0].ids)
    if not (cfg.kind == HF_GENERATE and cfg.compiled):
        return ids[:16]
    n = s.hf_cache_len - min(16, s.max_new_tokens)
    return (ids * (n // len(ids) + 1))[:n]


def _run_one(model, cfg: BenchConfig, prompt: list[int], max_new_tokens: int, seed: int | None, s: BenchSettings,
             profile) -> RunRecord:
    with s.fast_path if (s.fast_path is not None and cfg.fast) else contextlib.nullcontext():
        return _run_one_inner(model, cfg, prompt, max_new_tokens, seed, s, profile)


def _run_prompt(model, cfg: BenchConfig, prompt: Prompt, seed: int | None, s: BenchSettings, profile) -> RunRecord:
    """Every turn of ``prompt``, turn t+1 templated after this configuration's own answers to
    turns 1..t (templating outside the timed calls), as one record."""
    records, given = [], []
    for t in range(prompt.num_turns):
        ids = list(prompt.ids) if t == 0 else prompt.next_turn(s.tokenizer, [r.tokens for r in records])
        given.append(ids)
        records.append(_run_one(model, cfg, ids, s.max_new_tokens, seed, s, profile))
    return _merge_turns(records, given)


def _merge_turns(records: list[RunRecord], given: list[list[int]]) -> RunRecord:
    """One record of a conversation's turns: tokens concatenated, seconds and counters summed."""
    if len(records) == 1:
        r = records[0]
        return RunRecord(r.tokens, r.seconds, r.metrics, given, [len(r.tokens)])
    metrics = None
    if records[0].metrics is not None:
        ms = [r.metrics for r in records]
        metrics = {k: sum(m.get(k, 0) for m in ms) for k in (
            "num_steps", "num_generated", "prefill_seconds", "draft_seconds", "verify_seconds", "total_seconds",
            "num_request_steps", "tree_tokens", "compile_seconds")}
        steps = metrics["num_request_steps"]
        acc = [a for m in ms for a in m["accepted"]]
        depth = max(len(m["acceptance_counts"]) for m in ms)
        counts = [sum(m["acceptance_counts"][j] for m in ms if j < len(m["acceptance_counts"])) for j in range(depth)]
        metrics.update(
            accepted=acc, acceptance_counts=counts, acceptance_rate_by_position=[c / max(steps, 1) for c in counts],
            mean_accepted_length=(sum(acc) + len(acc)) / max(len(acc), 1),
            mean_tree_size=sum(m["mean_tree_size"] * m["num_request_steps"] for m in ms) / max(steps, 1),
            tokens_per_second=metrics["num_generated"] / metrics["total_seconds"] if metrics["total_seconds"] else 0.0,
        )
    return RunRecord([t for r in records for t in r.tokens], sum(r.seconds for r in records), metrics, given,
                     [len(r.tokens) for r in records])


def _run_one_inner(model, cfg: BenchConfig, prompt: list[int], max_new_tokens: int, seed: int | None,
                   s: BenchSettings, profile) -> RunRecord:
    """One timed generate of ``prompt`` ``[L]`` by ``cfg``: treespec's, or HF's own."""
    sp = s.sampling
    if cfg.kind == TREESPEC:
        t0 = time.perf_counter()
        out = ts_generate(
            model, cfg.drafter, cfg.tree, prompt, max_new_tokens=max_new_tokens,
            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
            seed=seed, attention_backend=s.attention_backend, auto_profile=profile, tokenizer=s.tokenizer,
            fixed_shapes="compile" if cfg.compiled else "graphs" if s.verify_graphs else False, **s.options,
        )
        seconds = time.perf_counter() - t0
        m = out.metrics
        summary = m.summary()
        summary["accepted"] = list(m.requests[0].accepted)
        summary["acceptance_counts"] = list(m.acceptance_counts)
        summary["num_request_steps"] = m.num_request_steps
        summary["tree_tokens"] = m.tree_tokens
        return RunRecord(list(out.sequences[0]), seconds, summary)

    gc = _generation_config(model, max_new_tokens, sp, cfg.lookup_tokens if cfg.kind == HF_LOOKUP else None,
                            compiled=cfg.compiled, cache_len=s.hf_cache_len, **s.options)
    ids = torch.tensor([prompt], device=model.device)  # [1, L]
    if seed is not None:
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                             **({"tokenizer": s.tokenizer} if gc.stop_strings else {}))
    seconds = time.perf_counter() - t0
    return RunRecord(out[0, ids.shape[1]:].tolist(), seconds)


def run_bench(model, prompts: Sequence[Sequence[int] | Prompt], configs: Sequence[BenchConfig],
              settings: BenchSettings | None = None, *, callback: Callable[[BenchProgress], None] | None = None,
              **fields) -> BenchResult:
    """Run every configuration on every prompt (configurations inner, prompts outer).

    Args:
        model:    the target, a transformers causal LM.
        prompts:  token ids per prompt, or :class:`~treespec.prompts.Prompt` values (a
                  category each; several turns, each after the configuration's own answer).
        configs:  the configurations; an HF generate baseline is put first if missing.
                  Prompt lookup is skipped (with a note) when sampling.
        settings: how they run (:class:`~treespec.bench.BenchSettings`); ``fields``, its
                  fields by keyword (``max_new_tokens=256, journal="run.jsonl"``), replace
                  its values.
        callback: told of the progress (:class:`BenchProgress`): each warm-up, each
                  configuration starting a prompt, each finished prompt with its records.
    """
    s = _settings(settings, fields)
    prompts = _as_prompts(prompts, s.tokenizer)
    if s.hf_cache_len is None:
        s = dataclasses.replace(s, hf_cache_len=hf_cache_len(prompts, s.max_new_tokens))
    callback = callback or (lambda progress: None)
    results, notes = _results(configs, s.sampling, s.options, any(p.num_turns > 1 for p in prompts))
    active = [r for r in results if r.skipped is None]
    profiles = _auto_profiles(model, active, s.auto_profile)
    dtype = next(model.parameters()).dtype
    judge = Judge(NEAR_TIE_TOLERANCE.get(dtype, 1.0) if s.near_tie_tolerance is None else s.near_tie_tolerance,
                  s.options)
    book = None
    if s.journal is not None:
        book = Journal(Path(s.journal), journal_key(model, prompts, active, s, dtype, judge.tolerance))
        book.restore(active, notes)
    done = len(book.done) if book is not None else 0
    if s.warmup and done < len(prompts):  # first calls run several times slower (allocations, kernel selection)
        for i, r in enumerate(active):
            t0 = time.perf_counter()
            _run_one(model, r.config, _warmup_prompt(r.config, prompts, s), min(16, s.max_new_tokens), s.seed, s,
                     profiles.get(r.config.name))
            r.warmup_seconds = time.perf_counter() - t0
            callback(BenchProgress("warmup", i + 1, len(active), r.config.name))
    for i, prompt in enumerate(prompts):
        if i >= done:
            _bench_prompt(model, i, prompt, active, s, profiles, judge if s.sampling.greedy else None,
                          lambda name: callback(BenchProgress("prompts", i, len(prompts), name)))
            if book is not None:
                book.append(i, {r.config.name: r.runs[i] for r in active},
                            {r.config.name: r.divergences[i] for r in active if i in r.divergences})
        callback(BenchProgress("prompts", i + 1, len(prompts), None, runs={r.config.name: r.runs[i] for r in active},
                               resumed=i < done))
    return BenchResult([len(p.ids) for p in prompts], results, s.sampling, s.max_new_tokens, s.seed, notes,
                       dtype=str(dtype).removeprefix("torch."), fast_path=getattr(s.fast_path, "description", None),
                       categories=[p.category for p in prompts], turns=[p.num_turns for p in prompts],
                       packing=s.packing)


def _settings(settings: BenchSettings | None, fields: dict) -> BenchSettings:
    """``settings`` with ``fields`` (keywords of :func:`run_bench`) in place of its values."""
    known = {f.name for f in dataclasses.fields(BenchSettings) if f.init}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"run_bench() got unexpected keyword argument(s) {', '.join(unknown)}: it takes callback and "
                        f"BenchSettings' fields ({', '.join(sorted(known))})")
    return dataclasses.replace(settings, **fields) if settings is not None else BenchSettings(**fields)


def _bench_prompt(model, i: int, prompt: Prompt, active: list[ConfigResult], s: BenchSettings, profiles: dict, judge,
                  starting: Callable[[str], None]) -> None:
    """Prompt ``i`` through every configuration in turn (the baseline first), each one
    ``starting`` first; greedy (a ``judge``), each output that leaves the baseline's is judged."""
    seed = None if s.seed is None else s.seed + i
    base = active[0]
    for r in active:
        starting(r.config.name)
        rec = _run_prompt(model, r.config, prompt, seed, s, profiles.get(r.config.name))
        r.runs.append(rec)
        log.info("prompt %d %s: %d tokens, %.1f tokens/s", i, r.config.name, len(rec.tokens), rec.tokens_per_second)
        if judge is not None and r is not base and rec.tokens != base.runs[i].tokens:
            judge(model, r, i, base.runs[i], rec)


def _as_prompts(prompts, tokenizer) -> list[Prompt]:
    if not prompts:
        raise ValueError("run_bench needs at least one prompt")
    prompts = [p if isinstance(p, Prompt) else Prompt(tuple(p)) for p in prompts]
    if tokenizer is None and any(p.num_turns > 1 for p in prompts):
        raise ValueError("multi-turn prompts need tokenizer= (later turns are templated after the answers)")
    return prompts


def _results(configs: Sequence[BenchConfig], sp: SamplingParams, options: dict,
             multi_turn: bool) -> tuple[list[ConfigResult], list[str]]:
    """One result per configuration, plain HF generate first (the baseline of every ratio),
    prompt lookup skipped when sampling; and the notes that say what was skipped, the
    generation options and how multi-turn prompts ran."""
    plain = BenchConfig.hf_generate()
    configs = [plain] + [c for c in configs if c != plain]
    names = [c.name for c in configs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"configuration names must be unique, repeated: {', '.join(dup)}")
    notes = []
    results = [ConfigResult(c) for c in configs]
    if not sp.greedy:
        for r in results:
            if r.config.kind == HF_LOOKUP:
                r.skipped = "prompt lookup is benchmarked greedy only"
                notes.append(f"{r.config.name} skipped: {r.skipped}")
        notes.append("sampling: outputs are not compared token for token (same distribution, different draws)")
    if options:
        notes.append("generation options, for every configuration: "
                     + ", ".join(f"{k}={v!r}" for k, v in sorted(options.items())))
    if multi_turn:
        notes.append("multi-turn prompts: each turn after the configuration's own answers, up to max_new_tokens "
                     "each; tokens and seconds summed over turns")
    return results, notes


def _auto_profiles(model, active: list[ConfigResult], start) -> dict:
    """Each ``auto`` configuration's own profile (a copy of ``start``, else its drafter's),
    after checking every treespec drafter against the model."""
    from ..auto import AutoProfile

    for r in active:
        if r.config.kind == TREESPEC:
            r.config.drafter.check_compatible(model)
    return {r.config.name: start.copy() if start is not None else AutoProfile.starting(r.config.drafter)
            for r in active if r.config.kind == TREESPEC and r.config.tree.auto}
