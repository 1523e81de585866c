"""The package's modules import one another without a cycle and down its layers, so that they
can be read (and each module tested) bottom-up. The graph, the layer table and the rule are in
``tests/meta/layering.py``; docs/architecture.md draws them."""

from __future__ import annotations

import re
from pathlib import Path

import networkx as nx
import pytest

from layering import EXCEPTIONS, LAYERS, PACKAGE, ROOT, import_graph, place, violations

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _edges(g: nx.DiGraph):
    return [(a, b, d["line"]) for a, b, d in g.edges(data=True)]


def test_graph_sees_the_imports():
    """The graph is not vacuous: known imports of each kind are edges."""
    g = import_graph()
    assert g.has_edge("treespec.engine.loop", "treespec.tree")  # module level
    assert g.has_edge("treespec.train.data", "treespec.data")  # inside a function
    assert len(g) > 30 and g.number_of_edges() > 60


def test_no_import_cycle():
    g = import_graph()
    cycles = sorted(nx.simple_cycles(g), key=len)
    where = [" -> ".join(f"{a} (line {g.edges[a, b]['line']})" for a, b in zip(c, c[1:] + c[:1])) for c in cycles[:5]]
    assert nx.is_directed_acyclic_graph(g), f"{len(cycles)} import cycle(s):\n" + "\n".join(where)


def test_every_module_has_one_place():
    """Each module is in exactly one layer, and every table entry names a module or package."""
    g = import_graph()
    for module in g:
        place(module)  # KeyError names a module the table lacks
    entries = [e for layer in LAYERS for e in layer.modules]
    assert len(entries) == len(set(entries)), "an entry is in two layers"
    present = {m.split(".")[1] if "." in m else ROOT for m in g}
    assert set(entries) == present, f"entries naming no module: {sorted(set(entries) - present)}"


def test_imports_go_down_the_layers():
    g = import_graph()
    bad = violations(_edges(g))
    assert not bad, "imports against the layers (tests/meta/layering.py):\n" + "\n".join(bad)
    for a, b in EXCEPTIONS:  # an exception that no longer happens is dropped, not kept
        assert g.has_edge(a, b), f"EXCEPTIONS lists {a} -> {b}, which is no import any more"


def test_docs_table_is_the_layers():
    """docs/architecture.md's table lists each layer's entries as LAYERS does, in order
    (a package as ``name/``)."""
    row = re.compile(r"^\| (?P<i>\d+) (?P<name>[^|]+?) \| (?P<entries>[^|]+) \|", re.M)
    rows = {int(m["i"]): (m["name"], re.findall(r"`([^`]+)`", m["entries"]))
            for m in row.finditer(ARCHITECTURE.read_text())}
    expected = {i: (layer.name, [f"{e}/" if (PACKAGE / e / "__init__.py").exists() else e for e in layer.modules])
                for i, layer in enumerate(LAYERS)}
    assert rows == expected


@pytest.mark.parametrize("edge, message", [
    (("treespec.tree", "treespec.engine"), "foundations) imports treespec.engine (decoding), a higher layer"),
    (("treespec.runner", "treespec.drafters.eagle"), "a higher layer"),
    (("treespec.drafters.base", "treespec.cli.common"), "a higher layer"),
    (("treespec.tree", "treespec.config"), "listed after it in its own layer (foundations)"),
    (("treespec.kv_cache", "treespec.runner"), "listed after it in its own layer (execution)"),
    (("treespec.data", "treespec"), "a higher layer"),  # the root's exception is machine's alone
])
def test_the_rule_catches_an_upward_import(edge, message):
    """The checker, on literal fake edges added to the real ones: each is reported, by name."""
    bad = violations(_edges(import_graph()) + [(*edge, 1)])
    assert len(bad) == 1 and bad[0].startswith(f"{edge[0]} (line 1") and message in bad[0], bad


@pytest.mark.parametrize("edge", [
    ("treespec.engine", "treespec.tree"),  # down the layers
    ("treespec.config", "treespec.tree"),  # earlier in its own layer
    ("treespec.drafters.hybrid", "treespec.drafters.ngram"),  # within a package
    ("treespec.cli.tree", "treespec.engine"),
])
def test_the_rule_allows_a_downward_import(edge):
    assert violations([(*edge, 1)]) == []
