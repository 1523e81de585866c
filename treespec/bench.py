"""Side-by-side benchmark: transformers' ``generate``, its prompt lookup, and treespec.

    prompts, _ = load_prompts("gsm8k", tokenizer, num_prompts=50)   # treespec.prompts
    result = run_bench(model, prompts, configs, max_new_tokens=256)
    print(format_table(to_json(result)))

    prompts, _ = load_bench_prompts("spec-bench", tokenizer, num_prompts=10)  # 10 per category
    result = run_bench(model, prompts, configs, max_new_tokens=256, tokenizer=tokenizer)

Every configuration runs on prompt i before any runs on prompt i+1, so drift in machine
load (another job, thermal throttling) spreads over all of them alike. Times are wall
seconds around one ``generate`` call, prompt tokenisation excluded. Under greedy decoding
every output is checked token for token against ``model.generate``'s.

A multi-turn prompt (:class:`~treespec.prompts.Prompt` with several turns: Spec-Bench's
MT-bench questions) runs as a conversation in every configuration: turn 1, then turn 2
templated after *that configuration's own* answer to turn 1, and so on; each turn may
generate ``max_new_tokens``, and its tokens and seconds are the sum over turns (as Spec-Bench
counts them). Under greedy decoding every configuration answers turn 1 as HF generate does,
so turn 2's prompt is the same for all and is compared token for token too; where a
configuration's answer differs (a bf16 near-tie), the difference is judged at its first
token, in the turn where it happened, and later turns are not compared.

Figures, per configuration:
    tokens_per_second         total generated tokens / total wall seconds
    median_tokens_per_second  median over prompts of that prompt's tokens / seconds
    speedup                   tokens_per_second / the HF generate baseline's
    median_speedup            median over prompts of the per-prompt ratio
    speedup_vs_same_path      tokens_per_second / the same-path baseline's: HF generate on plain
                              or on packed weights, whichever ran faster (``same_path_baseline``)
    speedup_vs_best_baseline  tokens_per_second / the fastest configuration's without speculation
                              (``best_baseline``; treespec without a draft is among them)
    mean_accepted_length      tokens committed per verify forward, bonus included (tau)
    acceptance_rate_by_position[d-1]  share of verify steps that accepted >= d drafts
    categories[c]             tokens/s, speedup and tau over the prompts of category c, and
                              ``spec_bench_speedup``: Spec-Bench's own ratio (evaluation/speed.py),
                              the mean of per-question tokens/s over the baseline's mean
    overall_speedup           mean of the categories' speedups (one weight per category)
    overall_spec_bench_speedup  Spec-Bench's "Overall": its ratio over every question pooled

This module never prints: progress goes to ``callback``, details to ``logging``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from .config import TreeConfig
from .divergence import NEAR_TIE_TOLERANCE, Divergence, classify_divergence, fp32_reference, worst_greedy_shortfall
from .drafters.base import Drafter
from .engine import generate as ts_generate
from .machine import machine_info
from .pack_choice import PackingChoice
from .prompts import Prompt
from .sampling import SamplingParams

__all__ = ["BenchConfig", "BenchResult", "ConfigResult", "BenchProgress", "run_bench", "format_table", "to_json",
           "header_lines", "save_plots"]

log = logging.getLogger(__name__)

HF_GENERATE = "hf-generate"
HF_LOOKUP = "hf-prompt-lookup"
TREESPEC = "treespec"
TREESPEC_AR = "treespec-ar"


# ---- configurations ---------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """One way to generate.

    kind:   ``"hf-generate"`` (the baseline; always runs first), ``"hf-prompt-lookup"``
            (assisted generation with ``prompt_lookup_num_tokens=lookup_tokens``, greedy
            only) or ``"treespec"`` (``drafter`` with ``tree``).
    fast:   runs inside the benchmark's fast path (e.g. oneDNN-packed weights), when it
            has one. Plain ``hf-generate`` never does: it is the baseline a user has
            without treespec; ``hf-generate+fast`` is the same with the fast path. treespec's
            configurations run there where packing pays (``PackingChoice.pack``).
    """

    name: str
    kind: str
    drafter: Drafter | None = None
    tree: TreeConfig | None = None
    lookup_tokens: int = 3
    draft_name: str | None = None
    tree_name: str | None = None
    fast: bool = True
    compiled: bool = False  # hf-generate: static cache + torch.compile (transformers' own path)

    def __post_init__(self):
        if self.kind not in (HF_GENERATE, HF_LOOKUP, TREESPEC):
            raise ValueError(f"unknown configuration kind {self.kind!r}")
        if self.kind == TREESPEC and (self.drafter is None or self.tree is None):
            raise ValueError(f"treespec configuration {self.name!r} needs a drafter and a tree")
        if self.kind == HF_LOOKUP and self.lookup_tokens < 1:
            raise ValueError(f"prompt lookup needs lookup_tokens >= 1, got {self.lookup_tokens}")

    @classmethod
    def hf_generate(cls, fast: bool = False) -> "BenchConfig":
        return cls(f"{HF_GENERATE}+fast" if fast else HF_GENERATE, HF_GENERATE, fast=fast)

    @classmethod
    def hf_generate_compiled(cls) -> "BenchConfig":
        """HF generate with a static cache and ``torch.compile`` of the forward (transformers
        compiles on CPU only when asked): the first call compiles (a minute or more)."""
        return cls(f"{HF_GENERATE}+compile", HF_GENERATE, fast=False, compiled=True)

    @classmethod
    def treespec_ar(cls, fast: bool = True) -> "BenchConfig":
        """treespec without speculation (every tree is the root alone): autoregressive
        decoding through treespec's runner, on the weights treespec runs on (``fast``: the
        fast path), a baseline for speculation."""
        from .drafters.none import NoDrafter

        return cls(TREESPEC_AR, TREESPEC, NoDrafter(), TreeConfig.chain(1), draft_name="none", tree_name="root only",
                   fast=fast)

    @classmethod
    def hf_lookup(cls, k: int = 3) -> "BenchConfig":
        return cls(f"{HF_LOOKUP}-{k}", HF_LOOKUP, lookup_tokens=k)

    @classmethod
    def treespec(cls, drafter: Drafter, tree: TreeConfig, draft_name: str, tree_name: str,
                 fast: bool = True) -> "BenchConfig":
        return cls(f"{draft_name}/{tree_name}", TREESPEC, drafter, tree,
                   draft_name=draft_name, tree_name=tree_name, fast=fast)

    def describe(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "fast": self.fast}
        if self.kind == HF_LOOKUP:
            d["prompt_lookup_num_tokens"] = self.lookup_tokens
        if self.kind == TREESPEC:
            d.update(draft=self.draft_name, drafter=repr(self.drafter), tree=self.tree_name,
                     tree_config=self.tree.describe(), tree_tokens_per_verify=self.tree.max_tree_tokens)
        return d

    @property
    def speculates(self) -> bool:
        from .drafters.none import NoDrafter

        return self.kind == HF_LOOKUP or (self.kind == TREESPEC and not isinstance(self.drafter, NoDrafter))


# ---- running ----------------------------------------------------------------------------


@dataclass
class BenchProgress:
    """``stage`` is ``"warmup"`` or ``"prompts"``; ``done`` of ``total`` finished."""

    stage: str
    done: int
    total: int
    config: str | None = None


@dataclass
class RunRecord:
    """One configuration on one prompt (every turn of it: tokens concatenated, seconds summed)."""

    tokens: list[int]
    seconds: float
    metrics: dict | None = None  # SpecMetrics.summary() plus steps/accepted, treespec only
    turn_prompts: list[list[int]] = field(default_factory=list)  # what each turn was given
    turn_lengths: list[int] = field(default_factory=list)  # tokens of each turn's answer

    def turn_tokens(self, t: int) -> list[int]:
        start = sum(self.turn_lengths[:t])
        return self.tokens[start:start + self.turn_lengths[t]]

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ConfigResult:
    config: BenchConfig
    runs: list[RunRecord] = field(default_factory=list)
    mismatches: list[int] = field(default_factory=list)  # prompt indices, greedy only
    first_diff: dict[int, int] = field(default_factory=dict)  # prompt -> first differing token
    divergences: dict[int, Divergence] = field(default_factory=dict)  # prompt -> fp32 judgement
    skipped: str | None = None

    @property
    def unexplained(self) -> list[int]:
        """Prompts whose greedy output left HF generate's other than at a rounding near-tie."""
        return [i for i in self.mismatches if not (i in self.divergences and self.divergences[i].near_tie)]


@dataclass
class BenchResult:
    prompt_lengths: list[int]  # of each prompt's first turn
    results: list[ConfigResult]
    sampling: SamplingParams
    max_new_tokens: int
    seed: int | None
    notes: list[str] = field(default_factory=list)
    dtype: str = "float32"
    fast_path: str | None = None
    categories: list[str | None] = field(default_factory=list)  # each prompt's, where it has one
    turns: list[int] = field(default_factory=list)  # each prompt's number of user turns
    packing: PackingChoice | None = None  # the start-up choice of weights for treespec

    @property
    def baseline(self) -> ConfigResult:
        return self.results[0]

    @property
    def treespec_mismatches(self) -> int:
        """Prompts on which a treespec configuration's greedy output differs from HF's."""
        return sum(len(r.mismatches) for r in self.results if r.config.kind == TREESPEC)

    @property
    def treespec_unexplained(self) -> int:
        """Of those, the ones that are not rounding near-ties (must be 0)."""
        return sum(len(r.unexplained) for r in self.results if r.config.kind == TREESPEC)


def _generation_config(model, max_new_tokens: int, sp: SamplingParams, lookup: int | None, compiled: bool = False,
                       **options):
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
    return GenerationConfig(**kw)


def _run_one(model, cfg: BenchConfig, prompt: list[int], max_new_tokens: int, sp: SamplingParams,
             seed: int | None, backend: str, fast_path=None, auto_profile=None, options=None, tokenizer=None) -> RunRecord:
    with fast_path if (fast_path is not None and cfg.fast) else contextlib.nullcontext():
        return _run_one_inner(model, cfg, prompt, max_new_tokens, sp, seed, backend, auto_profile, options or {},
                              tokenizer)


def _run_prompt(model, cfg: BenchConfig, prompt: Prompt, max_new_tokens: int, sp: SamplingParams, seed: int | None,
                backend: str, fast_path=None, auto_profile=None, options=None, tokenizer=None) -> RunRecord:
    """Every turn of ``prompt``, turn t+1 templated after this configuration's own answers to
    turns 1..t (templating outside the timed calls), as one record."""
    records, given = [], []
    for t in range(prompt.num_turns):
        ids = list(prompt.ids) if t == 0 else prompt.next_turn(tokenizer, [r.tokens for r in records])
        given.append(ids)
        records.append(_run_one(model, cfg, ids, max_new_tokens, sp, seed, backend, fast_path, auto_profile,
                                options, tokenizer))
    return _merge_turns(records, given)


def _merge_turns(records: list[RunRecord], given: list[list[int]]) -> RunRecord:
    """One record of a conversation's turns: tokens concatenated, seconds and counters summed."""
    if len(records) == 1:
        r = records[0]
        return RunRecord(r.tokens, r.seconds, r.metrics, given, [len(r.tokens)])
    metrics = None
    if records[0].metrics is not None:
        ms = [r.metrics for r in records]
        metrics = {k: sum(m[k] for m in ms) for k in ("num_steps", "num_generated", "prefill_seconds", "draft_seconds",
                                                      "verify_seconds", "total_seconds", "num_request_steps",
                                                      "tree_tokens")}
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


def _run_one_inner(model, cfg: BenchConfig, prompt: list[int], max_new_tokens: int, sp: SamplingParams,
                   seed: int | None, backend: str, auto_profile, options: dict, tokenizer) -> RunRecord:
    if cfg.kind == TREESPEC:
        t0 = time.perf_counter()
        out = ts_generate(
            model, cfg.drafter, cfg.tree, prompt, max_new_tokens=max_new_tokens,
            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
            seed=seed, attention_backend=backend, auto_profile=auto_profile, tokenizer=tokenizer, **options,
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
                            compiled=cfg.compiled, **options)
    ids = torch.tensor([prompt], device=model.device)  # [1, L]
    if seed is not None:
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                             **({"tokenizer": tokenizer} if gc.stop_strings else {}))
    seconds = time.perf_counter() - t0
    return RunRecord(out[0, ids.shape[1]:].tolist(), seconds)


def run_bench(
    model,
    prompts: Sequence[Sequence[int] | Prompt],
    configs: Sequence[BenchConfig],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = 0,
    warmup: bool = True,
    attention_backend: str = "auto",
    callback: Callable[[BenchProgress], None] | None = None,
    fast_path=None,
    near_tie_tolerance: float | None = None,
    auto_profile=None,
    options: dict | None = None,
    tokenizer=None,
    packing=None,
    journal: str | Path | None = None,
) -> BenchResult:
    """Run every configuration on every prompt (configurations inner, prompts outer).

    Args:
        model:    the target, a transformers causal LM.
        prompts:  token ids per prompt, or :class:`~treespec.prompts.Prompt` values (a
                  category each; several turns, each after the configuration's own answer).
        configs:  the configurations; an HF generate baseline is put first if missing.
                  Prompt lookup is skipped (with a note) when sampling.
        seed:     prompt i is sampled with seed ``seed + i`` in every configuration.
        warmup:   one untimed generate per configuration on a short prompt first (first
                  calls run several times slower: allocations, kernel selection).
        fast_path: a context manager (e.g. :class:`~treespec.packing.PackedLinears`) that
                  every configuration with ``fast=True`` runs inside; plain HF generate runs
                  outside it, ``BenchConfig.hf_generate(fast=True)`` inside: the faster of the
                  two is the same-path baseline.
        near_tie_tolerance: greedy differences from HF generate are judged in fp32
                  (:mod:`treespec.divergence`); default by the model's dtype.
        auto_profile: the :class:`~treespec.auto.AutoProfile` that ``auto`` trees start
                  from (each auto configuration learns into its own copy, across its
                  warm-up and prompts); None: a fresh one each (cost curve from the disk cache,
                  calibrations the draft's own or else the prior).
        options:  generation options (GenerationConfig fields: ``repetition_penalty``, ...),
                  given to every configuration alike, HF's baselines included.
        tokenizer: for ``stop_strings`` among the options (transformers needs it too), and
                  to template a multi-turn prompt's later turns.
        packing:  the :class:`~treespec.pack_choice.PackingChoice` behind the ``fast`` flags.
        journal:  a JSONL file each finished prompt is appended to, from which a stopped run
                  with the same settings resumes (:class:`_Journal`).
    """
    # long: the docstring is the argument reference of the benchmark's entry (twenty of them); the code is
    # forty lines, the per-prompt work in _bench_prompt and the journal's in _Journal
    sp = SamplingParams(temperature, top_k, top_p, min_p)
    gen = dict(options=dict(options or {}), tokenizer=tokenizer)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    prompts = _as_prompts(prompts, tokenizer)
    callback = callback or (lambda progress: None)
    results, notes = _results(configs, sp, gen["options"], any(p.num_turns > 1 for p in prompts))
    active = [r for r in results if r.skipped is None]
    profiles = _auto_profiles(model, active, auto_profile)
    dtype = next(model.parameters()).dtype
    judge = _Judge(NEAR_TIE_TOLERANCE.get(dtype, 1.0) if near_tie_tolerance is None else near_tie_tolerance, gen)

    book = None
    if journal is not None:
        book = _Journal(Path(journal), _journal_key(model, prompts, active, sp, max_new_tokens, seed, gen["options"],
                                                    dtype, packing, attention_backend, judge.tolerance))
        book.restore(active, notes)
    done = len(book.done) if book is not None else 0
    if warmup and done < len(prompts):  # first calls run several times slower (allocations, kernel selection)
        for i, r in enumerate(active):
            _run_one(model, r.config, list(prompts[0].ids[:16]), min(16, max_new_tokens), sp, seed, attention_backend,
                     fast_path, profiles.get(r.config.name), **gen)
            callback(BenchProgress("warmup", i + 1, len(active), r.config.name))

    def run(cfg: BenchConfig, prompt: Prompt, s: int | None) -> RunRecord:
        return _run_prompt(model, cfg, prompt, max_new_tokens, sp, s, attention_backend, fast_path,
                           profiles.get(cfg.name), **gen)

    for i, prompt in enumerate(prompts):
        if i >= done:
            _bench_prompt(model, i, prompt, None if seed is None else seed + i, active, run, judge if sp.greedy else None,
                          callback, len(prompts))
            if book is not None:
                book.append(i, {r.config.name: r.runs[i] for r in active},
                            {r.config.name: r.divergences[i] for r in active if i in r.divergences})
        callback(BenchProgress("prompts", i + 1, len(prompts), None))
    return BenchResult([len(p.ids) for p in prompts], results, sp, max_new_tokens, seed, notes,
                       dtype=str(dtype).removeprefix("torch."), fast_path=getattr(fast_path, "description", None),
                       categories=[p.category for p in prompts], turns=[p.num_turns for p in prompts], packing=packing)


def _bench_prompt(model, i: int, prompt: Prompt, seed: int | None, active: list[ConfigResult], run, judge, callback,
                  total: int) -> None:
    """Prompt ``i`` through every configuration in turn (the baseline first); greedy (a
    ``judge``), each output that leaves the baseline's is judged."""
    base = active[0]
    for r in active:
        callback(BenchProgress("prompts", i, total, r.config.name))
        rec = run(r.config, prompt, seed)
        r.runs.append(rec)
        log.info("prompt %d %s: %d tokens, %.1f tokens/s", i, r.config.name, len(rec.tokens), rec.tokens_per_second)
        if judge is not None and r is not base and rec.tokens != base.runs[i].tokens:
            judge(model, r, i, base.runs[i], rec)


def _journal_key(model, prompts: list[Prompt], active: list[ConfigResult], sp: SamplingParams, max_new_tokens: int,
                 seed: int | None, options: dict, dtype, packing, backend: str, tolerance: float) -> dict:
    """What a journal's records depend on: a resumed run must match it in every field."""
    text = [[[int(t) for t in p.ids], p.category, list(p.turns), p.chat] for p in prompts]
    digest = hashlib.sha256(json.dumps(text).encode()).hexdigest()
    drafters = [r.config.drafter for r in active if r.config.drafter is not None]
    return {
        # The model and drafts by their weights (where they were loaded from may move; a head
        # retrained under the same name is another run).
        "model": type(model).__name__,
        "weights": [_fingerprint(model)] + [_fingerprint(m) for d in drafters for m in d.modules()],
        "configs": [{**r.config.describe(), "fast": r.config.fast} for r in active],
        "prompts": f"{len(prompts)} prompts, sha256 {digest[:16]}",
        "max_new_tokens": max_new_tokens, "sampling": dataclasses.asdict(sp), "seed": seed,
        "options": {k: repr(v) for k, v in sorted(options.items())}, "dtype": str(dtype).removeprefix("torch."),
        "packed": None if packing is None else bool(packing.pack), "threads": torch.get_num_threads(),
        "attention_backend": backend, "near_tie_tolerance": tolerance,
        # Timings of one machine only: another CPU or library version starts a new journal.
        "machine": {k: v for k, v in machine_info().items()
                    if k in ("cpu", "cpu_id", "cpu_count", "torch", "transformers", "treespec", "cuda")},
    }


def _fingerprint(module) -> str:
    """A short digest of a module's parameters (names, shapes and sums): enough to tell two
    checkpoints apart, cheap next to a benchmark."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if t.is_floating_point() or t.dtype in (torch.int64, torch.int32, torch.bool):
                h.update(f"{name}{tuple(t.shape)}{float(t.double().sum()) if t.numel() else 0.0:.9e}".encode())
    return h.hexdigest()[:16]


class _Journal:
    """:func:`run_bench`'s journal: a header line with the run's settings (:func:`_journal_key`),
    then one line per finished prompt, in order (every configuration's record and judgement).
    Given the file of an earlier run with the same settings, its prompts are read back, not run
    again: their timings are that run's, and ``auto`` trees start the rest from their start-up
    profile again. A file of other settings is refused."""

    VERSION = 1

    def __init__(self, path: Path, key: dict):
        self.path, self.done = path, []
        key = json.loads(json.dumps(key))  # as it reads back (tuples become lists)
        if not path.exists() or path.stat().st_size == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"treespec_bench_journal": self.VERSION, "key": key}) + "\n")
            return
        raw = path.read_text()
        if not raw.endswith("\n"):  # a last record whole but for its newline: the next append starts a line
            with path.open("a") as f:
                f.write("\n")
        lines = raw.splitlines()
        try:
            head = json.loads(lines[0])
            old = head["key"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path} is not a treespec bench journal: give a new file or remove it") from None
        if head.get("treespec_bench_journal") != self.VERSION or old != key:
            diff = sorted(k for k in key.keys() | old.keys() if key.get(k) != old.get(k)) or ["version"]
            raise ValueError(f"{path} journals a run with other settings ({', '.join(diff)} differ): resume with the "
                             f"same command, or give a new journal file")
        for n, line in enumerate(lines[1:], start=2):
            try:
                rec = json.loads(line)
            except ValueError:
                if n == len(lines):  # the process stopped while writing it: that prompt runs again
                    log.warning("%s: line %d is cut short; its prompt runs again", path, n)
                    self._rewrite(lines[: n - 1])
                    break
                raise ValueError(f"{path}: line {n} is not JSON: give a new journal file") from None
            if rec.get("prompt") != len(self.done):
                raise ValueError(f"{path}: line {n} holds prompt {rec.get('prompt')}, expected {len(self.done)}")
            try:
                self.done.append(({c: RunRecord(**r) for c, r in rec["runs"].items()},
                                  {c: Divergence(**d) for c, d in rec["divergences"].items()}))
            except (KeyError, TypeError) as e:
                raise ValueError(f"{path}: line {n} is not a record this version of treespec reads ({e}): "
                                 f"give a new journal file") from None

    def restore(self, active: list[ConfigResult], notes: list[str]) -> None:
        """Put the journal's prompts back into the configurations' results, judgements too."""
        for i, (runs, divergences) in enumerate(self.done):
            for r in active:
                r.runs.append(runs[r.config.name])
                if r.config.name in divergences:
                    d = divergences[r.config.name]
                    r.mismatches.append(i)
                    r.first_diff[i] = d.position
                    r.divergences[i] = d
        if self.done:
            notes.append(f"resumed: the first {len(self.done)} prompt(s) were run by an earlier process with the same "
                         f"settings and read back from {self.path.name} (their timings are that run's)")

    def _rewrite(self, lines: list[str]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.path)  # whole or not at all

    def append(self, i: int, runs: dict[str, RunRecord], divergences: dict[str, Divergence]) -> None:
        # Without turn_prompts: only the judge reads them, while the prompt runs, and a long
        # prompt's ids (thousands for RAG) would be most of the file.
        rec = {"prompt": i, "runs": {c: {**dataclasses.asdict(r), "turn_prompts": []} for c, r in runs.items()},
               "divergences": {c: dataclasses.asdict(d) for c, d in divergences.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()


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
    from .auto import AutoProfile

    for r in active:
        if r.config.kind == TREESPEC:
            r.config.drafter.check_compatible(model)
    return {r.config.name: start.copy() if start is not None else AutoProfile.starting(r.config.drafter)
            for r in active if r.config.kind == TREESPEC and r.config.tree.auto}


class _Judge:
    """Records where a configuration left HF generate's greedy output on a prompt, and whether
    an fp32 copy of the model (made at the first difference) calls it a bf16 near-tie."""

    def __init__(self, tolerance: float, gen: dict):
        self.tolerance = tolerance
        self.options = gen["options"]  # the generation options every configuration ran with
        self.reference = None

    def __call__(self, model, r: ConfigResult, i: int, ref: RunRecord, got: RunRecord) -> None:
        # The first turn whose answers differ: earlier answers agree, so both runs were given
        # the same prompt for it; later turns' prompts differ and are not compared.
        t = next(t for t in range(len(got.turn_lengths)) if ref.turn_tokens(t) != got.turn_tokens(t))
        self.reference = self.reference if self.reference is not None else fp32_reference(model)
        d = classify_divergence(self.reference, got.turn_prompts[t], ref.turn_tokens(t), got.turn_tokens(t),
                                self.tolerance, self._processor(model, len(got.turn_prompts[t])))
        # What follows answers the run's own prefixes: every later token must be a greedy choice there.
        worst = max((self._worst(model, got, u, d.position + 1 if u == t else 0)
                     for u in range(t, len(got.turn_lengths))), key=lambda x: x[1], default=(None, 0.0))
        d = dataclasses.replace(d, position=sum(got.turn_lengths[:t]) + d.position,  # into the whole output
                                later_position=worst[0], later_shortfall=worst[1])
        r.mismatches.append(i)
        r.first_diff[i] = d.position
        r.divergences[i] = d
        log.warning("%s differs from HF generate on prompt %d at token %d: %s (fp32 shortfall %.3g, after it at most "
                    "%.3g, tolerance %.3g)", r.config.name, i, d.position, "near-tie" if d.near_tie else "UNEXPLAINED",
                    d.fp32_shortfall, d.later_shortfall, self.tolerance)

    def _worst(self, model, got: RunRecord, turn: int, start: int) -> tuple[int | None, float]:
        """The worst fp32 shortfall among turn ``turn``'s tokens from ``start`` on, and where it
        lies in the whole output."""
        tokens = got.turn_tokens(turn)
        j, short = worst_greedy_shortfall(self.reference, got.turn_prompts[turn], tokens,
                                          self._processor(model, len(got.turn_prompts[turn])), start)
        return (None if j < 0 else sum(got.turn_lengths[:turn]) + j), short

    def _processor(self, model, prompt_len: int):
        """The options' processors for a prompt of ``prompt_len`` tokens (None without options):
        a near-tie is judged on the scores greedy chose from."""
        opts = {k: v for k, v in self.options.items() if k != "stop_strings"}  # stops end a run; they rank nothing
        if not opts:
            return None
        from .processing import NodeProcessor, exact_generation_config

        cfg = exact_generation_config(model, eos_token_id=model.generation_config.eos_token_id, **opts)
        return NodeProcessor.build(model, cfg, prompt_len).processors


# ---- figures ----------------------------------------------------------------------------


def _config_figures(r: ConfigResult, base: ConfigResult) -> dict:
    d = r.config.describe()
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
    return lines


def _fmt(v, spec, suffix=""):
    return "-" if v is None else format(v, spec) + suffix


#: table width the default table and legend keep to (``wide=True`` lifts it)
TABLE_WIDTH = 100
_NAME_WIDTH = 24  # config names beyond this are abbreviated in the default table
#: Spec-Bench's categories as the default table heads them
_CATEGORY_HEADS = {"conversation": "conv", "translation": "transl", "summarization": "summ", "qa": "qa",
                   "math_reasoning": "math", "rag": "rag"}
_CATEGORY_MEANING = {"conversation": "MT-bench's 80, two turns each", "translation": "WMT14 DE-EN",
                     "summarization": "CNN/DailyMail", "qa": "question answering, Natural Questions",
                     "math_reasoning": "GSM8K", "rag": "retrieval-augmented generation, DPR"}


_TAU = ("mean accepted length: tokens committed per verify forward of the target, its own (bonus) token included; "
        "treespec only")


@dataclass(frozen=True)
class _Column:
    head: str
    cell: Callable[[dict], str]
    meaning: str
    wide_only: bool = False
    left: bool = False


def _mismatch_cell(c: dict, greedy: bool, wide: bool) -> str:
    if not greedy or c["kind"] == HF_GENERATE:
        return "-"
    n, bad = c["mismatches"], c.get("unexplained", c["mismatches"])
    if not n:
        return "0"
    if wide:
        return f"{n}: {c.get('near_ties', 0)} near-tie, {bad} unexplained"
    return f"{n} ({bad} unexpl.)" if bad else f"{n} near-tie"


def _main_columns(data: dict, wide: bool, max_positions: int) -> list[_Column]:
    """The columns of the main table, each with what it means (the legend's text)."""
    best = data.get("best_baseline", "-")
    greedy = data["settings"]["temperature"] == 0

    def accept(c):
        acc = c.get("acceptance_rate_by_position")
        return "-" if acc is None else " ".join(f"{a:.2f}" for a in acc[:max_positions]) + (
            " ..." if len(acc) > max_positions else "")

    def share(key):
        return lambda c: f"{100 * c['time_split'][key]:.0f}%" if c.get("time_split") else "-"

    return [
        _Column("tok/s", lambda c: _fmt(c["tokens_per_second"], ".1f"),
                "generated tokens / wall seconds, all prompts together (tokenisation excluded)"),
        _Column("med tok/s", lambda c: _fmt(c["median_tokens_per_second"], ".1f"),
                "median over prompts of a prompt's tokens / seconds", wide_only=True),
        _Column("speedup", lambda c: _fmt(c["speedup"], ".2f", "x"), f"tok/s over {HF_GENERATE}'s"),
        _Column("med speedup", lambda c: _fmt(c["median_speedup"], ".2f", "x"),
                "median over prompts of a prompt's speedup", wide_only=True),
        _Column("vs best", lambda c: _fmt(c.get("speedup_vs_best_baseline"), ".2f", "x"),
                f"tok/s over {best}'s, the fastest configuration without speculation here: what speculation "
                "itself adds"),
        _Column("tau", lambda c: _fmt(c["mean_accepted_length"], ".2f"), _TAU),
        _Column("nodes", lambda c: _fmt(c.get("mean_tree_size") if c.get("acceptance_rate_by_position") else None,
                                        ".1f"),
                "drafted tree nodes verified per step, mean (auto trees choose their size each step)"),
        _Column("accept by position", accept, f"share of verify steps that accepted at least d drafted tokens, "
                f"d = 1, 2, ... (first {max_positions})", wide_only=True, left=True),
        _Column("draft", share("draft"), "share of treespec's time spent drafting (the head, draft model or prompt "
                "lookup building each step's tree)"),
        _Column("verify", share("verify"), "share spent in the target's verify forwards (the rest: prefill and "
                "committing)"),
        _Column("mismatch", lambda c: _mismatch_cell(c, greedy, wide),
                "greedy only: prompts whose output differs from HF generate's, each judged in fp32 at its first "
                "differing token and at every later one on its own prefix: a rounding near-tie (bf16 or packed "
                "weights can round two logits level) or unexplained (a bug; bench exits with status 1); '-' not "
                "compared"),
    ]


def _category_columns(data: dict, wide: bool) -> tuple[list[_Column], str, str]:
    """The leaderboard's columns (speedup per category, mean accepted tokens, overall), and the
    legend's one entry for the category columns: its key and text."""
    heads = {cat: cat if wide else _CATEGORY_HEADS.get(cat, cat) for cat in data["categories"]}
    cols = [_Column(head, lambda c, cat=cat: _fmt(c["categories"][cat]["speedup"], ".2f", "x"), "")
            for cat, head in heads.items()]
    cols += [_Column("tau", lambda c: _fmt(c["mean_accepted_length"], ".2f"), _TAU),
             _Column("overall", lambda c: _fmt(c.get("overall_speedup"), ".2f", "x"),
                     "mean of the categories' speedups"),
             _Column("SB overall", lambda c: _fmt(c.get("overall_spec_bench_speedup"), ".2f", "x"),
                     "Spec-Bench's own Overall: the mean of every question's tokens/s over the baseline's mean "
                     "(evaluation/speed.py), which weighs short answers as much as long ones")]
    what = [f"{cat} ({_CATEGORY_MEANING.get(cat, 'an MT-bench category, two turns each')})"
            if head == cat else f"{head}: {cat} ({_CATEGORY_MEANING.get(cat, '')})" for cat, head in heads.items()]
    return cols, ", ".join(heads.values()), (
        f"speedup over {HF_GENERATE} per Spec-Bench category (tokens / seconds over its questions): " + "; ".join(what))


def _short_names(configs: list[dict], limit: int) -> tuple[dict[str, str], dict[str, str]]:
    """Names that fit ``limit`` characters: a long draft name becomes ``head`` (an EAGLE head)
    or ``draft`` (numbered if there are several); and the aliases used, alias -> draft."""
    aliases: dict[str, str] = {}  # draft -> alias
    names = {}
    for c in configs:
        name = c["name"]
        if c["kind"] == TREESPEC and len(name) > limit and c.get("draft") and c.get("tree"):
            base = c["draft"].removesuffix("+lookup")
            if base not in aliases and len(base) > 12:
                kind = "head" if "EAGLE" in c.get("drafter", "") else "draft"
                n = sum(a.rstrip("0123456789") == kind for a in aliases.values())
                aliases[base] = kind if n == 0 else f"{kind}{n + 1}"
            name = f"{aliases.get(base, base)}{c['draft'][len(base):]}/{c['tree']}"
        names[c["name"]] = name if len(name) <= limit else name[: limit - 1] + "~"
    return names, {a: d for d, a in aliases.items()}


def _config_meaning(data: dict, configs: list[dict], aliases: dict[str, str]) -> str:
    names = {c["name"] for c in configs}
    kinds = {c["kind"] for c in configs}
    parts = [f"{HF_GENERATE}: transformers' model.generate, eager weights, the baseline of every speedup"]
    if any(n.endswith("+fast") for n in names):
        parts.append(f"+fast: the same on {data['settings'].get('fast_path') or 'packed weights'}")
    if any(n.endswith("+compile") for n in names):
        parts.append("+compile: with a static cache and torch.compile")
    if TREESPEC_AR in names:
        parts.append(f"{TREESPEC_AR}: treespec without a draft (one token per forward, on treespec's weights): its "
                     "decoding without speculation")
    if HF_LOOKUP in kinds:
        fast = data["settings"].get("fast_path") and any(c["kind"] == HF_LOOKUP and c.get("fast") for c in configs)
        on = " (on the +fast weights)" if fast else ""
        parts.append(f"{HF_LOOKUP}-K: transformers' prompt lookup decoding, K tokens{on}")
    if any(c["kind"] == TREESPEC and c.get("draft") != "none" for c in configs):
        parts.append("DRAFT/TREE: treespec drafting with DRAFT (+lookup: prompt lookup grafted on) on trees TREE")
    parts += [f"{a} = {d}" for a, d in aliases.items()]
    return "; ".join(parts)


def _render(head: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    widths = [max(len(r[j]) for r in [head] + rows) for j in range(len(head))]

    def line(r):
        return "  ".join(f"{v:<{w}}" if j in left else f"{v:>{w}}" for j, (v, w) in enumerate(zip(r, widths))).rstrip()

    return [line(head), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [line(r) for r in rows]


def format_table(data: dict, max_positions: int = 5, *, wide: bool = False, legend: bool = True) -> str:
    """``to_json``'s ``configs`` as aligned plain text, within :data:`TABLE_WIDTH` columns
    unless ``wide``; and under it a legend that says what every column means.

    Where the prompts have categories (Spec-Bench), the leaderboard's table comes first: a
    row per configuration, speedup per category, mean accepted tokens and overall.
    ``wide`` adds the medians and acceptance by position, and keeps names unabbreviated.
    """
    configs = [c for c in data["configs"] if not c.get("skipped")]
    names, aliases = (({c["name"]: c["name"] for c in configs}, {}) if wide
                      else _short_names(configs, _NAME_WIDTH))
    meanings = {"config": _config_meaning(data, configs, aliases)}
    lines = []
    tables = [_main_columns(data, wide, max_positions)]
    if data.get("categories"):
        cols, key, text = _category_columns(data, wide)
        tables.insert(0, cols)
        meanings[key] = text
    for cols in tables:
        cols = [col for col in cols if wide or not col.wide_only]
        rows = [[names[c["name"]]] + [col.cell(c) for col in cols] for c in configs]
        lines += _render(["config"] + [col.head for col in cols], rows,
                         {0} | {j + 1 for j, col in enumerate(cols) if col.left}) + [""]
        for col in cols:
            if col.meaning:
                meanings.setdefault(col.head, col.meaning)
    lines.pop()
    lines += [f"{c['name']} skipped: {c['skipped']}" for c in data["configs"] if c.get("skipped")]
    return "\n".join(lines + (["", _legend(meanings)] if legend else []))


def _legend(meanings: dict[str, str]) -> str:
    """``head  meaning`` per column, wrapped to :data:`TABLE_WIDTH`; a long head (the
    categories' shared entry) as ``head: meaning``."""
    import textwrap

    w = max(len(h) for h in meanings if len(h) <= 18)
    return "\n".join(textwrap.fill(text, TABLE_WIDTH, subsequent_indent=" " * (w + 2), break_on_hyphens=False,
                                   initial_indent=f"{head:<{w}}  " if len(head) <= w else f"{head}: ")
                     for head, text in meanings.items())


def save_plots(data: dict, out_dir, prefix: str = "") -> list[Path]:
    """PNGs from ``to_json``'s output: acceptance rate by draft position per treespec
    configuration (``{prefix}acceptance_by_position.png``), tokens/s per configuration as
    bars (``{prefix}tokens_per_second.png``) and, where the prompts have categories
    (Spec-Bench), speedup per category as grouped bars (``{prefix}speedup_by_category.png``).
    Returns the paths written."""
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = [c for c in data["configs"] if not c.get("skipped")]
    title = f"{data.get('model', '')} {data.get('dataset', '')}, {data['settings']['num_prompts']} prompts, " \
            f"{data['settings']['max_new_tokens']} new tokens".strip()
    paths = []

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    spec = [c for c in configs if c.get("acceptance_rate_by_position")]
    for c in spec:
        acc = c["acceptance_rate_by_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{c['name']} (tau {c['mean_accepted_length']:.2f})")
    ax.set_xlabel("draft position d")
    ax.set_ylabel("share of steps accepting >= d drafts")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance rate by draft position\n" + title, fontsize=9)
    if spec:
        ax.legend(fontsize=7)
        ax.set_xticks(range(1, max(len(c["acceptance_rate_by_position"]) for c in spec) + 1))
    ax.grid(alpha=0.3)
    fig.set_layout_engine("tight")
    paths.append(out_dir / f"{prefix}acceptance_by_position.png")
    fig.savefig(paths[-1], format="png", dpi=100)

    fig = Figure(figsize=(max(6.4, 0.9 * len(configs) + 2), 4.0))
    ax = fig.add_subplot()
    names = [c["name"] for c in configs]
    tps = [c["tokens_per_second"] for c in configs]
    colors = ["#9aaabb" if c["kind"] != TREESPEC else "#4a6d8c" for c in configs]
    bars = ax.bar(range(len(names)), tps, color=colors)
    for b, c in zip(bars, configs):
        if c.get("speedup") is not None:
            ax.annotate(f"{c['speedup']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1.15 * max(tps, default=0) or 1)  # headroom: the speedup labels sit above the bars
    ax.set_ylabel("tokens/s (total tokens / total seconds)")
    ax.set_title("throughput, speedup over HF generate\n" + title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.set_layout_engine("tight")
    paths.append(out_dir / f"{prefix}tokens_per_second.png")
    fig.savefig(paths[-1], format="png", dpi=100)
    if data.get("categories"):
        paths.append(out_dir / f"{prefix}speedup_by_category.png")
        _category_plot(data, configs, title).savefig(paths[-1], format="png", dpi=100, bbox_inches="tight")
    return paths


def _category_plot(data: dict, configs: list[dict], title: str):
    """Spec-Bench's view: per category (and overall) a group of bars, one per configuration,
    the speedup over HF generate (a line at 1)."""
    from matplotlib.figure import Figure

    groups = list(data["categories"]) + ["overall"]
    shown = [c for c in configs if c["name"] != HF_GENERATE]
    fig = Figure(figsize=(min(max(7.0, 0.2 * len(groups) * (len(shown) + 1) + 2), 12.0), 4.2))
    ax = fig.add_subplot()
    width = 0.8 / max(len(shown), 1)
    for k, c in enumerate(shown):
        ys = [c["categories"][g]["speedup"] if g != "overall" else c.get("overall_speedup") for g in groups]
        xs = [j + (k - (len(shown) - 1) / 2) * width for j in range(len(groups))]
        bars = ax.bar(xs, [y or 0 for y in ys], width, label=c["name"])
        if len(shown) <= 4:  # values readable above the bars only when the groups are narrow
            for b, y in zip(bars, ys):
                if y is not None:
                    ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                                va="bottom", fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label=f"{HF_GENERATE} (1x)")
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    top = max([c.get("overall_speedup") or 0 for c in shown]
              + [v["speedup"] or 0 for c in shown for v in c["categories"].values()] + [1.0])
    ax.set_ylim(0, 1.15 * top)
    ax.set_ylabel(f"speedup over {HF_GENERATE}")
    ax.set_title("speedup by Spec-Bench category (overall: their mean)\n" + title, fontsize=9)
    ax.legend(fontsize=7, ncol=min(len(shown) + 1, 3), loc="upper center", bbox_to_anchor=(0.5, -0.08),
              frameon=False)  # below the axes: never over a bar
    ax.grid(axis="y", alpha=0.3)
    fig.set_layout_engine("tight")
    return fig
