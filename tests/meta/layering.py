"""treespec's import graph and its layers: what each module may import.

Used by ``tests/meta/test_imports.py`` (no cycle; every import goes down the layers) and by
``docs/make_figures.py`` (the picture in docs/architecture.md). Nothing in ``treespec/``
imports it.

Which imports count: every ``import`` and ``from ... import`` of a treespec module in
``treespec/**/*.py``, at module level *and* inside functions. A function-level import breaks a
cycle only for the interpreter: the two modules still need each other, and a reader still has to
hold both at once. Not counted: imports under ``if TYPE_CHECKING:`` (never executed; they are how
annotations name a type from a higher layer), and the implicit import of a module's parent
packages (``import treespec.train.data`` runs ``treespec/train/__init__.py`` first, so counting it
would make every package ``__init__`` that re-exports its own submodules a cycle).

The rule (:func:`violations`): a module may import any module of a lower layer, and within its
own layer only the entries listed before its own; the modules of one package entry
(``drafters``, ``models``, ``engine``, ``train``, ``cli``, ...) may import one another (the cycle test still
applies to them). :data:`EXCEPTIONS` names the imports allowed against the rule, each with its
reason.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[2] / "treespec"  # the checkout's, whatever is installed
ROOT = "__init__"  # the table's name for the package itself (treespec/__init__.py)


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...]  # relative to treespec, in the order they may import one another
    purpose: str


# Bottom to top.
LAYERS: tuple[Layer, ...] = (
    Layer("foundations", ("warn", "tree", "config", "builder", "processing", "accept", "device_sampling",
                          "constraints", "sampling_args", "mask", "data", "assets"),
          "values and pure functions on them, and the files that ship; no model runs here"),
    Layer("execution", ("compiled", "models", "packing", "threads", "kv_cache", "prefix_cache", "split_attention",
                        "attention", "runner", "fixed_shape"),
          "loading a model and running its forward over trees on the paged KV cache"),
    Layer("sizing", ("calibration", "costs", "pack_choice", "split_choice", "auto"),
          "how big a tree is worth verifying, and on which weights: calibrated scores, measured forward costs"),
    Layer("drafters", ("drafters",), "who proposes the tree"),
    Layer("decoding", ("engine",), "the loop: prefill, then draft -> verify -> commit"),
    Layer("tools", ("divergence", "machine", "prompts", "bench", "tune", "text", "viz", "export", "dropin", "train"),
          "what is built on generate: benchmarks, tuning, training, pictures, serving, streaming"),
    Layer("entry points", (ROOT, "cli"), "the package's lazy public names, and the command line"),
)

# (importer, imported) -> why the import may go against the rule.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("treespec.machine", "treespec"): "reads __version__, a constant; the package root is always "
    "imported before any of its modules, and its lazy public names are not touched",
}


def _module_name(path: Path) -> str:
    parts = ["treespec", *path.relative_to(PACKAGE).with_suffix("").parts]
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


def entry_of(module: str) -> str:
    """The table entry a module belongs to: ``treespec.drafters.eagle`` -> ``drafters``,
    ``treespec`` -> ``__init__``."""
    if module == "treespec":
        return ROOT
    if not module.startswith("treespec."):
        raise ValueError(f"{module} is not a treespec module")
    return module.split(".")[1]


def place(module: str) -> tuple[int, int]:
    """(layer index, position in the layer) of a module; KeyError when the table lacks it."""
    entry = entry_of(module)
    for i, layer in enumerate(LAYERS):
        if entry in layer.modules:
            return i, layer.modules.index(entry)
    raise KeyError(f"{module} is in no layer of tests/meta/layering.py's LAYERS")


def violations(edges) -> list[str]:
    """The imports among ``edges`` (``(importer, imported, line)``) that break the rule, as
    readable lines."""
    out = []
    for a, b, line in edges:
        if entry_of(a) == entry_of(b) or (a, b) in EXCEPTIONS:
            continue
        (la, pa), (lb, pb) = place(a), place(b)
        if lb < la or (lb == la and pb < pa):
            continue
        if lb > la:
            out.append(f"{a} (line {line}, {LAYERS[la].name}) imports {b} ({LAYERS[lb].name}), a higher layer")
        else:
            out.append(f"{a} (line {line}) imports {b}, listed after it in its own layer ({LAYERS[la].name})")
    return out
