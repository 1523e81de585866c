"""The package's modules import one another without a cycle, so that its layers can be read
(and each module tested) bottom-up.

Which imports count: every ``import`` and ``from ... import`` of a treespec module in
``treespec/**/*.py``, at module level *and* inside functions. A function-level import breaks a
cycle only for the interpreter: the two modules still need each other, and a reader still has to
hold both at once. Not counted: imports under ``if TYPE_CHECKING:`` (never executed; they are how
annotations name a type from a higher layer), and the implicit import of a module's parent
packages (``import treespec.train.data`` runs ``treespec/train/__init__.py`` first, so counting it
would make every package ``__init__`` that re-exports its own submodules a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import treespec

PACKAGE = Path(treespec.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def import_graph() -> nx.DiGraph:
    """module -> the treespec modules it imports (edges carry the importing line)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # ``from pkg import sub`` imports the submodule ``pkg.sub``; ``from mod import f``
                # imports ``mod``.
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in files]
                targets = subs + ([mod] if len(subs) < len(node.names) else [])
            for target in targets:
                if not (target == "treespec" or target.startswith("treespec.")):
                    continue  # another library
                while target not in files:  # ``import treespec.a.b`` where b is no module
                    target = target.rpartition(".")[0]
                if target != name:
                    graph.add_edge(name, target, line=node.lineno)
    return graph


def test_graph_sees_the_imports():
    """The graph is not vacuous: known imports of each kind are edges."""
    g = import_graph()
    assert g.has_edge("treespec.engine", "treespec.tree")  # module level
    assert g.has_edge("treespec.train.data", "treespec.data")  # inside a function
    assert len(g) > 30 and g.number_of_edges() > 60


def test_no_import_cycle():
    g = import_graph()
    cycles = sorted(nx.simple_cycles(g), key=len)
    where = [" -> ".join(f"{a} (line {g.edges[a, b]['line']})" for a, b in zip(c, c[1:] + c[:1])) for c in cycles[:5]]
    assert nx.is_directed_acyclic_graph(g), f"{len(cycles)} import cycle(s):\n" + "\n".join(where)
