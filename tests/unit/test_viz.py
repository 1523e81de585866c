"""Tree pictures: a PNG comes out, and the layout is layered and centred."""

from __future__ import annotations

import pytest

from treespec import PRESETS, Tree
from treespec.viz import draw_tree, save_tree_png, tree_layout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_save_preset_png(tmp_path):
    shape = PRESETS["eagle1"].config.static_tree()
    path = tmp_path / "eagle1.png"
    fig = save_tree_png(shape, path, highlight=shape.ancestors(24), title="eagle1")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000  # 26 labelled nodes, not an empty canvas
    w, h = (fig.get_size_inches() * 100).round()
    assert int.from_bytes(data[16:20], "big") == w and int.from_bytes(data[20:24], "big") == h


def test_layout_is_layered_and_centred():
    tree = Tree([-1, 0, 1, 0, 3, 3])  # root -> a -> b, root -> c -> (d, e)
    x, y = tree_layout(tree)
    assert y == [0.0, -1.0, -2.0, -1.0, -2.0, -2.0]
    assert [x[i] for i in tree.leaves()] == [0.0, 1.0, 2.0]  # leaves evenly spread
    assert x[3] == (x[4] + x[5]) / 2 and x[1] == x[2]  # parents over their children
    assert x[0] == (x[1] + x[3]) / 2


def test_draw_tree_highlight_and_labels():
    from matplotlib.figure import Figure

    tree = Tree.chain(3)
    fig = draw_tree(tree, labels=["r", "a", "b", "c"], highlight=[0, 1])
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.texts] == ["r", "a", "b", "c"]
    colours = [t.get_bbox_patch().get_facecolor() for t in ax.texts]
    assert colours[0] == colours[1] != colours[2] == colours[3]
    plain, bold = ax.collections
    assert len(bold.get_segments()) == 1 and len(plain.get_segments()) == 2
    # Drawing into given axes returns their figure.
    other = Figure()
    assert draw_tree(tree, other.add_subplot(), labels={2: "x"}) is other
    assert [t.get_text() for t in other.axes[0].texts] == ["0", "1", "x", "3"]


def test_draw_tree_rejects_bad_arguments():
    tree = Tree.chain(2)
    with pytest.raises(ValueError, match="labels has 2 entries for a tree of 3 nodes"):
        draw_tree(tree, labels=["a", "b"])
    with pytest.raises(ValueError, match=r"highlight names nodes \[5\] outside"):
        draw_tree(tree, highlight=[0, 5])
