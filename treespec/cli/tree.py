"""``treespec tree show``: a preset's (or JSON file's) shape as a PNG, or with a prompt the
tree a draft proposes at the first step, labelled with its tokens, with the path the target
accepts greedily highlighted."""

from __future__ import annotations

import textwrap
from pathlib import Path

from .common import DEFAULT_DRAFT, UserError, add_model, add_runtime
from .prompt_source import add_prompt_source, prompt_ids


def add_arguments(p):
    tsub = p.add_subparsers(dest="tree_command", required=True)
    s = tsub.add_parser(
        "show", help="draw a tree preset, or the tree a draft proposes on a prompt",
        description="Draw a preset's (or JSON file's) shape. With --prompt or --chat: load the model and draft, "
                    "draw the tree the draft proposes at the first step, labelled with decoded tokens, and "
                    "highlight the path the model accepts (greedy).",
        formatter_class=p.formatter_class,  # the defaults shown, as every command's
    )
    s.add_argument("tree", metavar="PRESET|CONFIG.json", help="a preset name or a JSON tree file")
    s.add_argument("--out", required=True, help="PNG file to write")
    add_prompt_source(s, "plain text prompt: draw the tree drafted for it",
                      "a user message (chat template applied): draw the tree drafted for it")
    add_model(s, help="target, with --prompt/--chat (default: %(default)s)")
    s.add_argument("--draft", default=DEFAULT_DRAFT, help="draft, with --prompt/--chat (default: %(default)s)")
    s.add_argument("--dpi", type=int, default=100, help="resolution of the PNG")
    # float32 on the CPU on plain weights unless asked: one step needs no speed, and the
    # tree drawn follows the draft's scores, which bf16 would move.
    add_runtime(s, device="cpu", dtype="float32", pack=False)


def run(args):
    """``tree show``, the one ``tree`` command."""
    from .loading import check

    drawn = args.prompt is not None or args.chat is not None
    _, trees = check(args, [args.tree], [args.draft] if drawn else [])
    from ..config import PRESETS
    from ..viz import save_tree_png

    cfg, name = trees[args.tree]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if drawn:
        return _show_drafted(args, cfg, name, out)
    about = PRESETS[name].description if name in PRESETS and args.tree == name else str(args.tree)
    if cfg.kind == "static":
        shape = cfg.static_tree()
        title = f"{name}: {cfg.describe()}\n" + "\n".join(textwrap.wrap(about, 80)) + "\nnode labels are indices"
    else:
        shape = _example_dynamic(cfg)
        title = (f"{name}: {cfg.describe()}\nan example: the shape is chosen each step from the draft's "
                 f"scores\n(here a seeded random draft); use --prompt to draw a real one")
    save_tree_png(shape, out, title=title, dpi=args.dpi)
    print(f"wrote {out} ({shape.num_drafted} drafted nodes, depth {shape.max_depth})")
    return 0


def _show_drafted(args, cfg, name, out) -> int:
    from ..drafters import RecordingDrafter
    from ..engine import stream
    from ..viz import save_tree_png
    from .loading import load

    loaded = load(args, [args.draft], prompts=lambda tok: prompt_ids(tok, args, args.model))
    tok = loaded.tokenizer
    drafter, draft_name = loaded.drafters[args.draft]
    rec = RecordingDrafter(drafter)
    tokens = {}
    with loaded.packed():
        gen = stream(loaded.model, rec, cfg, loaded.prompts, max_new_tokens=cfg.depth + 2,
                     attention_backend=args.backend)
        try:
            for step in gen:
                tokens[step.step] = step.tokens[0]
                if step.step == 1 or step.finished[0]:
                    break
        finally:
            gen.close()
    if not rec.trees or 1 not in tokens:
        raise UserError(f"{args.model} ended its reply at the first token: there is no tree to draw")
    (drafted,), (depth,) = rec.trees[0]
    drafted = drafted.prune(max_depth=depth, max_nodes=cfg.num_nodes + drafter.extra_nodes)  # as the engine verified it
    # The committed tokens are the accepted drafts then the bonus: follow them down the tree.
    path, node = [0], 0
    children = {}
    for i, p in enumerate(drafted.parents.tolist()[1:], start=1):
        children.setdefault(p, []).append(i)
    for t in tokens[1][:-1]:
        node = next(c for c in children.get(node, []) if int(drafted.tokens[c]) == t)
        path.append(node)
    labels = [_token_label(tok, int(t)) for t in drafted.tokens.tolist()]
    shown = args.prompt if args.prompt is not None else args.chat
    title = (f"{name} ({cfg.describe()}) drafted by {draft_name} at the first step\n"
             f"prompt: {shown[:60]!r}{'...' if len(shown) > 60 else ''}\n"
             f"highlighted: the path {args.model} accepts greedily ({len(path) - 1} of {drafted.num_drafted} drafted "
             f"tokens, then bonus {_token_label(tok, tokens[1][-1])})")
    save_tree_png(drafted, out, labels=labels, highlight=path, title=title, dpi=args.dpi)
    print(f"wrote {out} ({drafted.num_drafted} drafted nodes, {len(path) - 1} accepted)")
    if drafted.num_drafted == 0:
        print(f"{draft_name} proposed no tokens at the first step on this prompt")
    return 0


def _example_dynamic(cfg):
    """A dynamic config's tree drafted by a seeded random Markov draft: one example of the
    shapes it takes (the real shape follows the draft's scores each step)."""
    import torch

    from ..builder import build_dynamic_trees

    V = max(cfg.top_k * 3, 12)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g).mul(2.5).log_softmax(-1)  # [V, V]
    (example,) = build_dynamic_trees(torch.tensor([0]), table[0][None], lambda f: (table[f.tokens], None), cfg)
    return example


def _token_label(tok, t: int) -> str:
    s = tok.decode([t])
    piece = tok.convert_ids_to_tokens(t)
    if isinstance(piece, str) and piece[:1] in ("\u2581", "\u0120") and not s.startswith(" "):
        s = " " + s  # SentencePiece drops a lone token's leading space; it starts a word
    s = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in s)  # \n, \x0e: no font draws those
    return s.replace(" ", "·") if s.strip() else repr(s)
