"""``treespec bench``: HF generate, HF prompt lookup and treespec configurations side by side
on the same prompts, as a table, JSON and plots (the figures in docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from .bench_progress import journal_line, progress_display, resume_hint
from .common import (DEFAULT_DRAFT, DEFAULT_SPEC, DEFAULT_TREE, DRAFT_HELP, UserError, add_auto_profile, add_dataset,
                     add_model, add_runtime, add_sampling, auto_profile, generation_options, log, portable)

# The configurations run when none is asked for: generate's default (the hybrid with auto
# trees), the hybrid's chain-3 and the head alone with auto, the three to compare on a new
# machine (docs/benchmarks.md has what they measured).
DEFAULT_BENCH_CONFIGS = (f"{DEFAULT_SPEC}@auto", f"{DEFAULT_SPEC}@chain-3", f"{DEFAULT_DRAFT}@auto")

# Where a run's report (and its journal, beside it) go unless --out says otherwise, under the
# current folder: a long run always leaves its results, and a stopped one a way to resume.
REPORT_DIR = "treespec-bench"


def add_arguments(p):
    p.description = (
        "Run HF generate, HF prompt lookup and treespec configurations side by side on the same prompts (all "
        "configurations on prompt i before prompt i+1). Greedy outputs are checked token for token against HF "
        "generate; a difference is judged in fp32 at its first token and every later one (a rounding near-tie, "
        "possible in bf16, or unexplained) and an unexplained treespec difference exits with status 1. Where "
        "oneDNN packs the weights (and not --no-pack), HF generate also runs on packed weights, and the faster of plain and packed HF generate "
        "is the same-path baseline; treespec and treespec without speculation (treespec-ar) run on the weights the "
        "start-up measurement chose (--pack: packed), as the header says.")
    add_model(p)
    p.add_argument("--draft", action="append", default=None,
                   help=f"draft to run (repeatable): {DRAFT_HELP} (default: {DEFAULT_SPEC})")
    p.add_argument("--tree", action="append", default=None,
                   help=f"tree to run with each draft (repeatable): preset or JSON file (default: {DEFAULT_TREE})")
    p.add_argument("--chain", type=int, default=None, metavar="K",
                   help="also run each draft with a chain of K (default: 3 for ngram, 2 for others; 0: none)")
    p.add_argument("--config", action="append", default=None, metavar="DRAFT@TREE",
                   help="run exactly these draft/tree pairs instead of --draft x (chain + --tree) (repeatable). "
                        "With none of --config, --draft, --tree, --chain: "
                        + ", ".join(DEFAULT_BENCH_CONFIGS) + " (generate's default, the fastest fixed tree with it, the head alone; "
                        "docs/benchmarks.md)")
    p.add_argument("--lookup-tokens", type=int, default=3, metavar="K",
                   help="HF prompt lookup's prompt_lookup_num_tokens (default: %(default)s, as ngram's chain-3)")
    p.add_argument("--no-hf-lookup", action="store_true", help="skip HF prompt lookup")
    p.add_argument("--no-treespec-ar", action="store_true",
                   help="skip the treespec-ar baseline (treespec without a draft, on treespec's weights); "
                        "HF generate on packed weights stays")
    p.add_argument("--hf-compile", action="store_true",
                   help="also run HF generate with a static cache and torch.compile (compiles for a minute or more "
                        "first; on the CPUs measured it was slower than plain HF generate, docs/benchmarks.md)")
    p.add_argument("--compile", action="store_true",
                   help="also run each treespec configuration with its verify forward compiled on fixed shapes "
                        "(fixed_shapes='compile'; the warm-up compiles: up to 8 minutes for the default on 2 cores, "
                        "less from inductor's on-disk cache in a later process, not with dense weights)")
    add_dataset(p)
    add_sampling(p, seed=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one untimed generate per configuration first (default: on)")
    add_runtime(p)
    p.add_argument("--wide", action="store_true",
                   help="the whole table: medians over prompts, acceptance by draft position, full configuration "
                        "and category names (default: fits 100 columns)")
    p.add_argument("--out", default=None,
                   help=f"write the results as JSON here, and the printed report beside it as .txt (default: "
                        f"{REPORT_DIR}/DATE-TIME.json under the current folder); the paths are printed at the end")
    p.add_argument("--journal", default=None, metavar="FILE.jsonl",
                   help="append each finished prompt to this file, and resume from it: the same command run again "
                        "after a stop reads back the prompts it holds and runs the rest (a file written with other "
                        "settings is refused). Default: the report's path with .jsonl, printed at the start, resumed "
                        "from where a stopped run left it and removed once the report is written; Ctrl-C prints the "
                        "command that resumes")
    p.add_argument("--plot-dir", default=None, help="write PNG plots into this folder")
    p.add_argument("--plot-prefix", default=None,
                   help="file name prefix of the PNGs (default: the --out file's name and '-', e.g. r- for r.json; "
                        "else bench-)")
    add_auto_profile(p)


def bench_pairs(args) -> list[tuple[str, str]]:
    """The treespec (draft spec, tree spec) pairs to run, in order."""
    if args.config:
        if args.draft or args.tree or args.chain is not None:
            raise UserError("--config gives the exact draft/tree pairs: drop --draft, --tree and --chain")
        pairs = []
        for c in args.config:
            draft, sep, tree = c.rpartition("@")
            if not sep or not draft or not tree:
                raise UserError(f"--config {c!r} must look like DRAFT@TREE, e.g. ngram@chain-3")
            pairs.append((draft, tree))
        return pairs
    if not (args.draft or args.tree or args.chain is not None):
        return [tuple(c.rsplit("@", 1)) for c in DEFAULT_BENCH_CONFIGS]
    drafts = args.draft or [DEFAULT_SPEC]
    trees = args.tree or [DEFAULT_TREE]
    pairs = []
    for d in drafts:
        k = args.chain if args.chain is not None else (3 if d == "ngram" else 2)
        if k < 0:
            raise UserError(f"--chain must be >= 0, got {k}")
        for t in ([f"chain-{k}"] if k else []) + trees:
            if (d, t) not in pairs:
                pairs.append((d, t))
    return pairs


def run(args):
    from ..prompts import dataset_file, load_bench_prompts
    from .loading import check, load

    pairs = bench_pairs(args)
    sp, trees = check(args, [t for _, t in pairs], [d for d, _ in pairs],
                      then=[lambda: dataset_file(args.dataset)])  # missing data fails before the model loads
    profile = auto_profile(args)
    if profile is not None and not any(cfg.auto for cfg, _ in trees.values()):
        log.warning("--auto-profile is for auto trees: none of the configurations uses it")

    from ..bench import format_report, run_bench, to_json

    # keep_packed: HF generate runs on packed weights too, whichever weights treespec runs on,
    # so that the same-path baseline is the faster of plain and packed HF generate.
    loaded = load(args, [d for d, _ in pairs], prompts=lambda tok: load_bench_prompts(
        args.dataset, tok, args.num_prompts, prompt_field=args.prompt_field, raw=args.raw), keep_packed=True)
    prompts, fmt = loaded.prompts
    out, journal = output_paths(args)
    print(journal_line(args, journal), file=sys.stderr, flush=True)
    progress = progress_display()
    try:
        res = run_bench(loaded.model, prompts, _configs(args, loaded, pairs, trees), max_new_tokens=args.max_new_tokens,
                        temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=args.seed,
                        warmup=args.warmup, attention_backend=args.backend, verify_graphs=args.cuda_graphs,
                        callback=progress, fast_path=loaded.fast,
                        auto_profile=profile, options=generation_options(args), tokenizer=loaded.tokenizer,
                        packing=loaded.packing, journal=journal)
    except KeyboardInterrupt:
        progress.close()
        print(resume_hint(args, journal, len(prompts)), file=sys.stderr, flush=True)
        raise
    progress.close()
    data = to_json(res, command="treespec " + shlex.join(portable(a) for a in args.argv), model=args.model,
                   dataset=portable(args.dataset), prompt_format=fmt)
    report = format_report(data, wide=args.wide)
    sys.stdout.write(report)
    _write(args, data, report, out)
    if args.journal is None:
        journal.unlink(missing_ok=True)  # the report holds it all; a default journal is only for resuming
    bad = [c for c in data["configs"] if c["kind"] == "treespec" and c.get("unexplained")]
    if bad:
        print("treespec: error: greedy output differs from HF generate other than at a rounding near-tie: "
              + "; ".join(f"{c['name']} on {c['unexplained']} prompt(s)" for c in bad), file=sys.stderr)
        return 1
    return 0


def _configs(args, loaded, pairs: list[tuple[str, str]], trees: dict) -> list:
    """The configurations to run, in order: the baselines the flags keep, then each pair."""
    from ..bench import BenchConfig

    fast = loaded.packing.pack  # treespec's configurations on the packed weights, where they pay
    configs = [BenchConfig.hf_generate()]
    if loaded.fast is not None:
        # Decoding without speculation: HF generate on the packed weights (beside plain), and
        # treespec's own one-token decoding on the weights treespec runs on.
        configs += [BenchConfig.hf_generate(fast=True)] + ([] if args.no_treespec_ar else
                                                           [BenchConfig.treespec_ar(fast=fast)])
    if args.hf_compile:
        configs.append(BenchConfig.hf_generate_compiled())
    if not args.no_hf_lookup:
        configs.append(BenchConfig.hf_lookup(args.lookup_tokens))
    for d, t in pairs:
        drafter, dname = loaded.drafters[d]
        cfg, tname = trees[t]
        if not any(c.drafter is drafter and c.tree_name == tname for c in configs):  # both default drafts may
            configs.append(BenchConfig.treespec(drafter, cfg, dname, tname, fast=fast))  # fall back to one
    if args.compile:
        configs += [c.compiled_twin() for c in configs if c.kind == "treespec"]
    return configs


def output_paths(args, now: float | None = None) -> tuple[Path, Path]:
    """(report, journal): ``--out``, else a new file under :data:`REPORT_DIR` named by the time
    (``-2``, ``-3``, ... where one of that second exists); ``--journal``, else the report's path
    with ``.jsonl``."""
    out = Path(args.out) if args.out else None
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        name, n = stamp, 1
        while any((Path(REPORT_DIR) / f"{name}{ext}").exists() for ext in (".json", ".txt", ".jsonl")):
            n += 1
            name = f"{stamp}-{n}"
        out = Path(REPORT_DIR) / f"{name}.json"
    if args.journal:
        return out, Path(args.journal)
    return out, out.with_suffix(".jsonl" if out.suffix != ".jsonl" else ".journal.jsonl")


def _write(args, data: dict, report: str, out: Path) -> None:
    """The report as JSON at ``out`` and as printed beside it (.txt), the plots where asked;
    each path printed."""
    from ..bench import save_plots

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    # The table as printed, beside the JSON: a clean text record (no progress bars).
    out.with_suffix(".txt").write_text(f"$ {data['command']}\n{report}")
    print(f"wrote {out} and {out.with_suffix('.txt')}")
    if args.plot_dir:
        prefix = (args.plot_prefix if args.plot_prefix is not None
                  else f"{Path(args.out).stem}-" if args.out else "bench-")
        for path in save_plots(data, args.plot_dir, prefix):
            print(f"wrote {path}")
