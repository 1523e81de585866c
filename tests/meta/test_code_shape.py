"""The library reads in one sitting (issue 30): no function in ``treespec/`` over
``MAX_LINES`` lines without a comment saying why, and the decoding loop under ``LOOP_LINES``.

A function's length runs from its ``def`` line to its last line (docstring and comments
included, decorators not). A long function states its reason in a comment line that
starts with ``# long:``, placed between the signature (or docstring) and the first
statement, e.g.::

    def train_eagle(...):
        \"\"\"...\"\"\"
        # long: one training run's steps in order; each is a few lines and shares the loop's state
        ...
"""

from __future__ import annotations

import ast
from pathlib import Path

import treespec

MAX_LINES = 80
LOOP_LINES = 60  # engine.loop.decode must be shorter than this
MARKER = "# long:"
PACKAGE = Path(treespec.__file__).parent


def _first_statement(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.stmt:
    body = fn.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
        and isinstance(body[0].value.value, str)
    return body[1] if has_doc and len(body) > 1 else body[0]


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """``(name, line, length)`` of each function in ``source`` longer than ``max_lines``
    without a ``# long:`` comment before its first statement."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= max_lines:
            continue
        head = lines[node.lineno - 1: _first_statement(node).lineno - 1]
        if not any(line.strip().startswith(MARKER) for line in head):
            out.append((node.name, node.lineno, length))
    return sorted(out, key=lambda x: x[1])


def test_the_checker_sees_the_marker():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    plain = f"def f():\n{body}\n"
    assert long_functions(plain) == [("f", 1, MAX_LINES + 1)]
    assert long_functions(f"def f():\n    # long: a table of cases\n{body}\n") == []
    assert long_functions(f'def f(\n    a,\n):\n    """Doc."""\n    # long: why\n{body}\n') == []
    # A marker further down says nothing about the function as a whole.
    assert long_functions(f"def f():\n{body}\n    # long: too late\n    y = 0\n") == [("f", 1, MAX_LINES + 3)]
    short = "def g():\n" + "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1)) + "\n"
    assert long_functions(short) == []  # exactly MAX_LINES lines


def test_no_long_function_without_a_reason():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, line, length in long_functions(path.read_text()):
            found.append(f"  {path.relative_to(PACKAGE.parent)}:{line} {name}: {length} lines")
    assert not found, (f"{len(found)} function(s) over {MAX_LINES} lines without a '{MARKER} <why>' comment "
                       f"before the first statement (split them, or say why they are long):\n" + "\n".join(found))


def test_the_decoding_loop_reads_in_one_sitting():
    source = (PACKAGE / "engine" / "loop.py").read_text()
    loop = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "decode")
    length = loop.end_lineno - loop.lineno + 1
    assert length < LOOP_LINES, f"engine.loop.decode is {length} lines; keep it under {LOOP_LINES}"
