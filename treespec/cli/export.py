"""``treespec export``: check that a serving engine reads an EAGLE-3 head folder as treespec
does, then print its command line (vLLM, SGLang) or Python call (EAGLE reference)."""

from __future__ import annotations

from .common import DEFAULT_DRAFT, UserError

# treespec.export.ENGINES, spelled out: importing export loads torch, and this module is
# imported to build `export --help` (tests/cli/test_cli_startup.py checks the two agree).
EXPORT_ENGINES = ("vllm", "sglang", "eagle")


def add_arguments(p):
    p.description = ("Check that the engine reads the head folder correctly (its loading rules, "
                     "treespec/export.py), then print its command line (vLLM, SGLang) or Python call (EAGLE "
                     "reference) with the tree mapped to the engine's parameters. See docs/serving.md.")
    p.add_argument("--to", required=True, choices=EXPORT_ENGINES, help="the serving engine")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="EAGLE-3 head: shipped name or folder (default: %(default)s)")
    p.add_argument("--tree", default="chain-2", metavar="PRESET|TREE.json",
                   help="tree preset or JSON tree file (default: %(default)s, which every engine runs)")
    # Not add_model: this --model names the target as the serving engine loads it, and has no default.
    p.add_argument("--model", default=None,
                   help="the target as the engine loads it, HF id or folder (default: the shipped head's target)")
    p.add_argument("--vllm-token-tree", action="store_true", default=None,
                   help="the vLLM you serve with accepts speculative_token_tree, which a static tree needs (vLLM "
                        "0.32.0 refuses it; default: ask the vLLM installed here, and without one, refuse)")


def run(args):
    from ..export import export_head
    from .loading import check

    if args.tree == "auto":
        raise UserError("--tree auto chooses each step's tree at run time from this machine's costs; a serving "
                        "engine takes one fixed tree: give a preset or a JSON tree file")
    _, trees = check(args, [args.tree], [args.draft])
    out = export_head(args.to, args.draft, trees[args.tree][0], model=args.model, token_tree=args.vllm_token_tree)
    print(out.command)
    for note in out.notes:
        print(f"# {note}")
    return 0
