"""Regenerate the pictures in docs/images: ``python docs/make_figures.py`` from the repo root.

Deterministic (seeded), headless (matplotlib's Agg canvas), and small (dpi 100).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from treespec import PRESETS  # noqa: E402
from treespec.builder import Frontier, build_dynamic_trees  # noqa: E402
from treespec.viz import save_tree_png  # noqa: E402

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


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for path in (eagle1(), cpu_example()):
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
