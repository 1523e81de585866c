"""Regenerate the pictures in docs/images: ``python docs/make_figures.py`` from the repo root.

Deterministic (seeded), headless (matplotlib's Agg canvas), and small (dpi 100).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tests" / "meta"))  # the layer table the import test checks

from treespec import PRESETS  # noqa: E402
from treespec.builder import Frontier, build_dynamic_trees  # noqa: E402
from treespec.viz import save_tree_png  # noqa: E402
import layering  # noqa: E402

OUT = ROOT / "docs" / "images"

# A toy vocabulary, so that the dynamic tree reads like drafted text.
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "to", "red", "big", "it"]


def eagle1() -> Path:
    shape = PRESETS["eagle1"].config.static_tree()
    # Highlight the all-rank-0 branch: every node's most probable child.
    main = [0]
    while True:
        kids = [i for i in range(shape.num_nodes) if int(shape.parents[i]) == main[-1]]
        if not kids:
            break
        main.append(kids[0])
    path = OUT / "preset-eagle1.png"
    save_tree_png(
        shape, path, highlight=main,
        title="eagle1: EAGLE-1's static tree (25 drafted nodes, depth 5)\n"
        "node labels are indices; highlighted: the rank-0 branch",
    )
    return path


def cpu_example() -> Path:
    config = PRESETS["cpu"].config
    V = len(WORDS)
    g = torch.Generator().manual_seed(2024)
    # A Markov draft: the next-word distribution depends only on the current word.
    table = torch.randn(V, V, generator=g).mul(2.5).log_softmax(-1)  # [V, V]
    root_token = WORDS.index("the")
    root_logp = table[root_token][None]  # [1, V]

    def step(f: Frontier):
        return table[f.tokens], None  # [1, k, V]

    (tree,) = build_dynamic_trees(torch.tensor([root_token]), root_logp, step, config)
    # Highlight the path to the best-scoring deepest node, as if the target accepted it.
    deepest = torch.nonzero(tree.depth == tree.max_depth).flatten()
    best = int(deepest[tree.scores[deepest].argmax()])
    labels = [WORDS[t] for t in tree.tokens.tolist()]
    labels = [labels[0]] + [f"{w}\n{s:.1f}" for w, s in zip(labels[1:], tree.scores[1:].tolist())]
    path = OUT / "preset-cpu-example.png"
    save_tree_png(
        tree, path, labels=labels, highlight=tree.ancestors(best),
        title=f"cpu preset, {config.describe()}\nper node: word, cumulative draft log-prob; "
        "highlighted: the best deepest path",
    )
    return path


def architecture() -> Path:
    """The layers of tests/meta/layering.py as bands, bottom to top; each module (or package)
    a box in its layer's order, a package's listing its modules; an arrow from importer to
    imported, in the importer's colour, for each import not implied by a chain of others (the
    transitive reduction: about half the arrows, and what each box reaches is unchanged)."""
    import networkx as nx
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    graph = layering.import_graph()
    # One node per table entry (a package's modules together), one edge per importing pair.
    boxes = nx.DiGraph()
    subs: dict[str, list[str]] = {}
    for module in graph:
        entry = layering.entry_of(module)
        boxes.add_node(entry)
        if module.count(".") == 2:  # a package's submodule
            subs.setdefault(entry, []).append(module.rsplit(".", 1)[1])
    for a, b in graph.edges:
        if layering.entry_of(a) != layering.entry_of(b):
            boxes.add_edge(layering.entry_of(a), layering.entry_of(b))
    exceptions = {(layering.entry_of(a), layering.entry_of(b)) for a, b in layering.EXCEPTIONS}
    arrows = nx.transitive_reduction(boxes)

    left, right, band_h, box_h = 2.9, 15.8, 1.0, 0.42
    chars_per_unit = 18  # characters of a package's module list (fontsize 6.5) per unit of box width
    colours = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd", "#8c8c8c"]
    fig = Figure(figsize=(16, 1.05 * len(layering.LAYERS) + 0.6), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 16)
    ax.set_ylim(-0.15, len(layering.LAYERS) * band_h + 0.45)
    ax.axis("off")

    pos, width, height, level, listing = {}, {}, {}, {}, {}
    for i, layer in enumerate(layering.LAYERS):
        y = i * band_h
        ax.add_patch(FancyBboxPatch((0.1, y + 0.04), right - 0.05, band_h - 0.08, facecolor=colours[i], alpha=0.10,
                                    boxstyle="round,pad=0,rounding_size=0.08", edgecolor="none", zorder=0))
        ax.text(0.25, y + band_h / 2 + 0.12, f"{i}  {layer.name}", fontsize=12, weight="bold", va="center",
                color=colours[i])
        ax.text(0.25, y + band_h / 2 - 0.16, textwrap.fill(layer.purpose, 34), fontsize=7.5, va="center",
                color="#444")
        w = _box_widths(layer.modules, subs, right - left, chars_per_unit)
        gap = (right - left - sum(w)) / len(w)
        x = left + gap / 2
        for entry, wi in zip(layer.modules, w):
            pos[entry], width[entry], level[entry] = (x + wi / 2, y + band_h / 2), wi, i
            height[entry] = box_h
            if entry in subs:  # a package lists its modules under its name, wrapped to the box
                listing[entry] = textwrap.fill(" ".join(sorted(subs[entry])), int(wi * chars_per_unit))
                height[entry] = max(box_h, 0.25 + 0.1 * (listing[entry].count("\n") + 1))
            x += wi + gap

    for a, b in sorted(arrows.edges):  # a fixed order, so the PNG is the same bytes each run
        (xa, ya), (xb, yb) = pos[a], pos[b]
        colour = colours[level[a]]
        ha, hb = height[a] / 2, height[b] / 2
        if ya == yb:  # within a layer: an arc over the boxes between, higher the longer, inside the band
            rad = 2 * (0.08 + 0.025 * abs(xb - xa)) / abs(xb - xa)  # arc3 peaks rad * distance / 2 high
            start, end, rad = (xa, ya + ha), (xb, yb + hb), rad if xb < xa else -rad
        elif yb > ya:  # up the layers: only an import EXCEPTIONS allows
            start, end, rad = (xa, ya + ha), (xb, yb - hb), 0.0
        else:
            start, end, rad = (xa, ya - ha), (xb, yb + hb), 0.0
        style = dict(color="#d62728", ls="--", lw=1.2) if (a, b) in exceptions else dict(color=colour, lw=1.1)
        ax.add_patch(FancyArrowPatch(start, end, connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                                     mutation_scale=10, alpha=0.8, zorder=1, **style))

    for entry, (x, y) in pos.items():
        w, h = width[entry], height[entry]
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.06",
                                    facecolor="white", edgecolor=colours[level[entry]], lw=1.2, zorder=2))
        if entry in subs:
            ax.text(x, y + h / 2 - 0.11, f"{entry}/", ha="center", va="center", fontsize=10.5, weight="bold",
                    zorder=3)
            ax.text(x, y + h / 2 - 0.2, listing[entry], ha="center", va="top", fontsize=6.5, color="#333",
                    linespacing=1.25, zorder=3)
        else:
            ax.text(x, y, "treespec/__init__" if entry == layering.ROOT else entry, ha="center", va="center",
                    fontsize=10, zorder=3)

    ax.text(0.25, len(layering.LAYERS) * band_h + 0.2,
            "treespec's layers (tests/meta/layering.py): a module imports only lower layers, and the modules listed "
            "before it in its own.  Arrows: importer -> imported, those implied by a chain of others left out; "
            "dashed red: the one listed exception",
            fontsize=9.5, va="center")
    path = OUT / "architecture.png"
    fig.savefig(path)
    return path


def _box_widths(entries, subs: dict[str, list[str]], room: float, chars_per_unit: float) -> list[float]:
    """Each entry's box width in a band ``room`` wide: a module's fits its name (fontsize 10); a
    package's shares what the modules leave (a gap of at least 0.12 a box), up to what lists its
    modules on two lines, and at least 1.6."""
    name = {layering.ROOT: "treespec/__init__"}
    w = {e: max(0.85, 0.085 * len(name.get(e, e)) + 0.3) for e in entries if e not in subs}
    packages = [e for e in entries if e in subs]
    if packages:
        share = (room - sum(w.values()) - 0.12 * len(entries)) / len(packages)
        for e in packages:
            wanted = len(" ".join(subs[e])) / (2 * chars_per_unit) + 0.4  # words wrap short of the width
            w[e] = max(1.6, min(share, wanted, 4.5))
    return [w[e] for e in entries]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for path in (eagle1(), cpu_example(), architecture()):
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
