"""Pictures of draft trees, for docs and debugging.

matplotlib is imported inside the functions (it is slow to import and only these need it),
and only its object API is used (``matplotlib.figure.Figure``), never pyplot state, so
drawing works headless and never touches a user's open figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from .tree import Tree

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["tree_layout", "draw_tree", "save_tree_png"]

_NODE = "#dbe8f6"  # pale blue
_NODE_EDGE = "#4a6d8c"
_EDGE = "#9aaabb"
_HIGHLIGHT = "#f28e2b"  # orange: contrasts with the blue on screen and in grey print
_HIGHLIGHT_EDGE = "#a14f00"


def tree_layout(tree: Tree) -> tuple[list[float], list[float]]:
    """Top-down layered layout: ``(x, y)`` per node.

    Row ``y = -depth`` (root on top). Leaves sit at 0, 1, 2, ... in depth-first order with
    children in index order, so no edges cross; each parent is centred over its children.
    """
    n = tree.num_nodes
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(tree.parents.tolist()[1:], start=1):
        children[p].append(i)
    x = [0.0] * n
    next_leaf = 0.0
    stack = [(0, False)]  # iterative post-order: deep trees must not hit the recursion limit
    while stack:
        node, done = stack.pop()
        if done:
            x[node] = (x[children[node][0]] + x[children[node][-1]]) / 2
        elif not children[node]:
            x[node], next_leaf = next_leaf, next_leaf + 1
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(children[node]))
    y = [-float(d) for d in tree.depth.tolist()]
    return x, y


def _labels(tree: Tree, labels) -> list[str]:
    n = tree.num_nodes
    if labels is None:
        return [str(i) for i in range(n)]
    if isinstance(labels, Mapping):
        return [str(labels.get(i, i)) for i in range(n)]
    labels = list(labels)
    if len(labels) != n:
        raise ValueError(f"labels has {len(labels)} entries for a tree of {n} nodes")
    return [str(s) for s in labels]


def draw_tree(
    tree: Tree,
    ax: "Axes | None" = None,
    *,
    labels: Sequence[str] | Mapping[int, str] | None = None,
    highlight: Iterable[int] | None = None,
    title: str | None = None,
) -> "Figure":
    """Draw ``tree`` top-down: root on top, one row per depth.

    Args:
        tree:      the tree to draw.
        ax:        axes to draw into; a new figure sized to the tree when None.
        labels:    text per node (e.g. decoded tokens): a sequence of ``num_nodes`` strings
                   or a mapping ``{node: text}``; node indices where not given.
        highlight: node indices drawn in a contrasting colour (e.g. the accepted path);
                   an edge whose two ends are highlighted is drawn bold.
        title:     the axes title.
    Returns:
        The matplotlib Figure drawn on.
    """
    text = _labels(tree, labels)
    marked = _marked(tree, highlight)
    x, y = tree_layout(tree)
    width = max(x) + 1
    rows = tree.max_depth + 1
    if ax is None:
        ax = _new_axes(width, rows, title)
    _draw_edges(ax, tree, x, y, marked)
    _draw_nodes(ax, text, x, y, marked, width)
    _frame(ax, width, rows, title)
    fig = ax.figure
    if fig.get_layout_engine() is None:
        fig.set_layout_engine("tight")
    return fig


def _marked(tree: Tree, highlight: Iterable[int] | None) -> set[int]:
    marked = set() if highlight is None else {int(i) for i in highlight}
    bad = sorted(i for i in marked if not 0 <= i < tree.num_nodes)
    if bad:
        raise ValueError(f"highlight names nodes {bad} outside the tree's 0..{tree.num_nodes - 1}")
    return marked


def _new_axes(width: float, rows: int, title: str | None) -> "Axes":
    """Axes of a new figure sized to the tree: wide enough for the leaves and for the title's
    longest line (about 0.075 in/char)."""
    from matplotlib.figure import Figure

    title_w = 0.075 * max((len(s) for s in (title or "").splitlines()), default=0) + 0.6
    fig_w = min(max(0.62 * width + 1.2, title_w, 3.5), 24.0)
    fig = Figure(figsize=(fig_w, min(0.85 * rows + 0.9, 10.0)))
    return fig.add_subplot()


def _draw_edges(ax: "Axes", tree: Tree, x: list[float], y: list[float], marked: set[int]) -> None:
    """An edge from each node to its parent; bold where both ends are highlighted."""
    from matplotlib.collections import LineCollection

    plain, bold = [], []
    for i, p in enumerate(tree.parents.tolist()[1:], start=1):
        seg = [(x[p], y[p]), (x[i], y[i])]
        (bold if (i in marked and p in marked) else plain).append(seg)
    ax.add_collection(LineCollection(plain, colors=_EDGE, linewidths=1.2, zorder=1))
    ax.add_collection(LineCollection(bold, colors=_HIGHLIGHT_EDGE, linewidths=3.2, zorder=2))


def _draw_nodes(ax: "Axes", text: list[str], x: list[float], y: list[float], marked: set[int], width: float) -> None:
    """Each node's label in a box, the highlighted ones in the contrasting colour."""
    # Shrink text as the tree widens so neighbouring labels stay apart.
    size = max(5.0, min(10.0, 130.0 / max(width, 1.0)))
    for i in range(len(text)):
        hot = i in marked
        ax.text(
            x[i], y[i], text[i],
            ha="center", va="center", zorder=3, fontsize=size,
            fontweight="bold" if hot else "normal",
            bbox=dict(
                boxstyle="round,pad=0.3",
                facecolor=_HIGHLIGHT if hot else _NODE,
                edgecolor=_HIGHLIGHT_EDGE if hot else _NODE_EDGE,
                linewidth=1.4 if hot else 0.8,
            ),
        )


def _frame(ax: "Axes", width: float, rows: int, title: str | None) -> None:
    """Limits around the nodes, a "depth d" label per row and nothing else around them."""
    ax.set_xlim(-0.7, width - 0.3)
    ax.set_ylim(-(rows - 1) - 0.55, 0.55)
    ax.set_yticks([-d for d in range(rows)], [f"depth {d}" for d in range(rows)], fontsize=8)
    ax.set_xticks([])
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    if title is not None:
        ax.set_title(title, fontsize=10)


def save_tree_png(tree: Tree, path, *, dpi: int = 100, **kw) -> "Figure":
    """Draw ``tree`` with :func:`draw_tree` (keyword arguments passed on) and save a PNG."""
    fig = draw_tree(tree, **kw)
    fig.savefig(path, format="png", dpi=dpi)
    return fig
