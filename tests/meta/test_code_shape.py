"""The code reads in one sitting (issues 30 and 49): no module in ``treespec/`` over
``MODULE_LINES`` lines, no function there over ``MAX_LINES`` lines without a comment saying why,
no signature over ``MAX_PARAMS`` parameters, the decoding loop under ``LOOP_LINES``; and no
helper of the tests written twice.

A function's length runs from its ``def`` line to its last line (docstring and comments
included, decorators not). A long function states its reason in a comment line that
starts with ``# long:``, placed between the signature (or docstring) and the first
statement, e.g.::

    def train_eagle(...):
        \"\"\"...\"\"\"
        # long: one training run's steps in order; each is a few lines and shares the loop's state
        ...

A signature's parameters are all it declares (``*args`` and ``**kwargs`` count one each), less
a method's ``self`` or ``cls``. A helper of the tests is a module-level function in ``tests/``
that is not a test (fixtures included): two with one name, or one body under two names, are one
helper written twice (share it from ``tests/helpers/`` or ``tests/conftest.py``, or name each for
what it is).

Each checker is shown a literal violation first, so that a checker that sees nothing fails.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import treespec

MODULE_LINES = 600
MAX_LINES = 60
MAX_PARAMS = 12
LOOP_LINES = 60  # engine.loop.decode must be shorter than this
MARKER = "# long:"
PACKAGE = Path(treespec.__file__).parent
TESTS = Path(__file__).resolve().parents[1]

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(source: str) -> list[Function]:
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _has_docstring(fn: Function) -> bool:
    first = fn.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def _first_statement(fn: Function) -> ast.stmt:
    return fn.body[1] if _has_docstring(fn) and len(fn.body) > 1 else fn.body[0]


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """``(name, line, length)`` of each function in ``source`` longer than ``max_lines``
    without a ``# long:`` comment before its first statement."""
    lines = source.splitlines()
    out = []
    for node in _functions(source):
        length = node.end_lineno - node.lineno + 1
        if length <= max_lines:
            continue
        head = lines[node.lineno - 1: _first_statement(node).lineno - 1]
        if not any(line.strip().startswith(MARKER) for line in head):
            out.append((node.name, node.lineno, length))
    return sorted(out, key=lambda x: x[1])


def parameters(fn: Function) -> int:
    """The parameters ``fn`` declares, less a leading ``self`` or ``cls``."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    count = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (names[:1] in (["self"], ["cls"]))


def wide_signatures(source: str, max_params: int = MAX_PARAMS) -> list[tuple[str, int, int]]:
    """``(name, line, parameters)`` of each function in ``source`` with more than ``max_params``."""
    return sorted(((fn.name, fn.lineno, n) for fn in _functions(source) if (n := parameters(fn)) > max_params),
                  key=lambda x: x[1])


def _helpers(source: str) -> list[Function]:
    return [n for n in ast.parse(source).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("test_")]


def _body_key(fn: Function) -> str:
    """The function's parameters and statements, docstring and decorators aside."""
    body = fn.body[1:] if _has_docstring(fn) and len(fn.body) > 1 else fn.body
    return ast.dump(fn.args) + "".join(ast.dump(s) for s in body)


def repeated_helpers(sources: dict[str, str]) -> list[str]:
    """The helpers of ``sources`` (file name -> text) written twice: one name defined more than
    once, or one body under more than one name."""
    by_name, by_body = defaultdict(list), defaultdict(set)
    for file, source in sorted(sources.items()):
        for fn in _helpers(source):
            by_name[fn.name].append(f"{file}:{fn.lineno}")
            by_body[_body_key(fn)].add(fn.name)
    out = [f"{name} defined {len(where)} times: {', '.join(where)}" for name, where in by_name.items() if len(where) > 1]
    out += [f"one body under the names {', '.join(sorted(names))}" for names in by_body.values() if len(names) > 1]
    return out


# ---- the checkers see a violation ----------------------------------------------------------------


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


def test_the_checker_counts_parameters():
    names = ", ".join(f"a{i}" for i in range(MAX_PARAMS))
    assert wide_signatures(f"def f({names}): pass\n") == []  # exactly MAX_PARAMS
    assert wide_signatures(f"def f({names}, b): pass\n") == [("f", 1, MAX_PARAMS + 1)]
    assert wide_signatures(f"def f({names}, *args): pass\n") == [("f", 1, MAX_PARAMS + 1)]
    assert wide_signatures(f"def f(p, /, {names}, *, k=1, **kw): pass\n") == [("f", 1, MAX_PARAMS + 3)]
    assert wide_signatures(f"class C:\n    def m(self, {names}): pass\n") == []  # self is not counted
    assert wide_signatures(f"class C:\n    def m(cls, {names}, b): pass\n") == [("m", 2, MAX_PARAMS + 1)]
    assert wide_signatures(f"def outer():\n    async def inner({names}, b): pass\n") == [("inner", 2, MAX_PARAMS + 1)]


def test_the_checker_sees_a_helper_written_twice():
    a = 'def hf_greedy(model, n):\n    """Doc."""\n    return model.generate(n)\n\n\ndef test_x():\n    pass\n'
    b = "def hf_greedy(m, n):\n    return m(n)\n\n\ndef test_x():\n    pass\n"  # the same name
    c = "def reference(model, n):\n    return model.generate(n)\n"  # the same body as a's
    d = "def other(model, n):\n    return model.generate(n + 1)\n\n\ndef test_y():\n    reference = 1\n"
    assert repeated_helpers({"a.py": a, "d.py": d}) == []  # tests may share names; other bodies differ
    assert repeated_helpers({"a.py": a, "b.py": b}) == ["hf_greedy defined 2 times: a.py:1, b.py:1"]
    assert repeated_helpers({"a.py": a, "c.py": c}) == ["one body under the names hf_greedy, reference"]
    fixture = "@pytest.fixture\ndef lm():\n    return load()\n"
    assert repeated_helpers({"x.py": fixture, "y.py": fixture}) == ["lm defined 2 times: x.py:2, y.py:2"]


# ---- the code --------------------------------------------------------------------------------------


def _library() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_over_the_limit():
    found = [f"  {p.relative_to(PACKAGE.parent)}: {n} lines" for p in _library()
             if (n := len(p.read_text().splitlines())) > MODULE_LINES]
    assert not found, f"module(s) over {MODULE_LINES} lines (split them by concern):\n" + "\n".join(found)


def test_no_long_function_without_a_reason():
    found = []
    for path in _library():
        for name, line, length in long_functions(path.read_text()):
            found.append(f"  {path.relative_to(PACKAGE.parent)}:{line} {name}: {length} lines")
    assert not found, (f"{len(found)} function(s) over {MAX_LINES} lines without a '{MARKER} <why>' comment "
                       f"before the first statement (split them, or say why they are long):\n" + "\n".join(found))


def test_no_signature_over_the_limit():
    found = [f"  {path.relative_to(PACKAGE.parent)}:{line} {name}: {n} parameters"
             for path in _library() for name, line, n in wide_signatures(path.read_text())]
    assert not found, (f"signature(s) over {MAX_PARAMS} parameters (group what travels together in a "
                       f"dataclass):\n" + "\n".join(found))


def test_no_helper_of_the_tests_written_twice():
    sources = {p.relative_to(TESTS).as_posix(): p.read_text() for p in sorted(TESTS.rglob("*.py"))}
    found = repeated_helpers(sources)
    assert not found, "helper(s) of the tests written twice:\n  " + "\n  ".join(found)


def test_the_decoding_loop_reads_in_one_sitting():
    source = (PACKAGE / "engine" / "loop.py").read_text()
    loop = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "decode")
    length = loop.end_lineno - loop.lineno + 1
    assert length < LOOP_LINES, f"engine.loop.decode is {length} lines; keep it under {LOOP_LINES}"
