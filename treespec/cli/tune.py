"""``treespec tune``: run a model/draft pair with the auto tree on sample prompts and write
the profile it learnt (cost curve, calibrations) for ``generate``/``bench --auto-profile``."""

from __future__ import annotations

import shlex
from pathlib import Path
from types import SimpleNamespace

from .bars import Bars
from .common import (DEFAULT_DRAFT, UserError, add_auto_profile, add_dataset, add_model, add_runtime,
                     add_sampling, auto_profile, portable)


def add_arguments(p):
    p.description = ("Run the pair with the auto tree on sample prompts, learning the calibration of draft scores "
                     "online; write the profile (cost curve, calibrations, machine and model keys) as JSON for "
                     "generate/bench --auto-profile, and optionally pictures of the cost curve, the calibration and "
                     "the tree sizes chosen. See docs/trees.md, auto.")
    add_model(p)
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft spec as for generate (default: %(default)s)")
    p.add_argument("--tree", default="auto", help="an auto tree: 'auto' or a JSON file (default: %(default)s)")
    add_dataset(p)
    add_sampling(p, seed=0)
    add_runtime(p)
    add_auto_profile(p)
    p.add_argument("--refresh-costs", action="store_true", help="measure the cost curve again (else the disk cache's)")
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--plot-dir", default=None, help="write cost_curve, calibration and tree_sizes PNGs here")


def run(args):
    from ..prompts import dataset_file, load_prompts
    from .loading import check, load

    sp, trees = check(args, [args.tree], [args.draft], then=[lambda: dataset_file(args.dataset)])
    cfg, _ = trees[args.tree]
    if not cfg.auto:
        raise UserError(f"--tree {args.tree} is not an auto tree: tune learns the profile auto trees decide from")
    profile = auto_profile(args)

    from ..machine import machine_info
    from ..tune import save_tune_plots, tune

    loaded = load(args, [args.draft], prompts=lambda tok: load_prompts(
        args.dataset, tok, args.num_prompts, prompt_field=args.prompt_field, raw=args.raw))
    prompts, fmt = loaded.prompts
    drafter, draft_name = loaded.drafters[args.draft]
    bars = Bars("prompt")

    def progress(done, total):
        bars(SimpleNamespace(stage="tune", done=done, total=total))

    progress(0, len(prompts))  # the bar shows while the first prompt (and a cost curve) runs
    with loaded.packed():
        res = tune(loaded.model, drafter, prompts, cfg, max_new_tokens=args.max_new_tokens,
                   temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=args.seed,
                   attention_backend=args.backend, profile=profile, refresh_costs=args.refresh_costs,
                   callback=progress)
    bars.close()
    p = res.profile
    p.keys.update(model=args.model, draft=draft_name, dataset=portable(args.dataset), prompt_format=fmt,
                  machine=machine_info(), command="treespec " + shlex.join(portable(a) for a in args.argv))
    out = p.save(args.out)
    mean = sum(res.tree_sizes) / max(len(res.tree_sizes), 1)
    print(f"{args.model} + {draft_name}, {len(prompts)} prompt(s): {res.num_generated} tokens, "
          f"{res.num_generated / res.seconds if res.seconds else 0:.1f} tok/s, mean tree size {mean:.1f} nodes "
          f"({'greedy' if sp.greedy else 'sampling'} calibration: {p.calibration(sp.greedy).num_observed} nodes)")
    print(f"wrote {out}")
    if args.plot_dir:
        for path in save_tune_plots(p, res.tree_sizes, args.plot_dir, f"{Path(args.out).stem}-",
                                    title=f"{args.model} + {draft_name}"):
            print(f"wrote {path}")
    return 0
