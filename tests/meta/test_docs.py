"""Every ```python block in README.md and docs/*.md runs.

Blocks of one file run in order in one namespace, as a reader would paste them (a later
block may use an earlier one's names). Fences:

    ```python            runs
    ```python no-run     does not run, on purpose (a fragment, or something a test cannot
                         have); counted and reported, never silently skipped

A block whose first line starts with ``>>>`` runs as a doctest (``...`` matches anything).

Cost: the real model (SmolLM2-135M-Instruct) loads once per session: ``treespec.models.load``
is patched to hand back the session's copy. Every generation is capped at ``CAP`` new
tokens: ``treespec.generate``, ``treespec.stream`` and transformers' ``generate`` all take
``min(max_new_tokens, CAP)``, so a snippet comparing treespec with HF generate still
compares like with like (greedy outputs agree on every prefix).
"""

from __future__ import annotations

import doctest
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CAP = 16  # new tokens per generation inside the docs test

_FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence, 1-based
    code: str
    run: bool


def python_blocks(text: str, file: str) -> list[Block]:
    """The ```python blocks of a markdown text, in order; ``run`` is False for ``no-run``."""
    blocks = []
    for m in _FENCE.finditer(text):
        info = m.group("info").split()
        blocks.append(Block(file, text.count("\n", 0, m.start()) + 1, m.group("code"), "no-run" not in info))
    return blocks


def _all_blocks() -> dict[str, list[Block]]:
    return {p.relative_to(ROOT).as_posix(): python_blocks(p.read_text(), p.relative_to(ROOT).as_posix())
            for p in DOC_FILES}


BLOCKS = _all_blocks()
REAL_MODEL = "smollm2-135m-instruct"


def _needs_real_model(blocks: list[Block]) -> bool:
    return any(b.run and REAL_MODEL in b.code for b in blocks)


def _params():
    for name, blocks in BLOCKS.items():
        if any(b.run for b in blocks):
            marks = [pytest.mark.slow] if _needs_real_model(blocks) else []
            yield pytest.param(name, marks=marks, id=name)


def _capped(fn, default: int):
    def wrapper(*args, **kwargs):
        kwargs["max_new_tokens"] = min(kwargs.get("max_new_tokens") or default or 128, CAP)  # None: 128
        return fn(*args, **kwargs)

    return wrapper


@pytest.fixture
def doc_env(request, monkeypatch, tmp_path, one_thread):
    """Caps generation lengths, shares the session's real model, and runs in a scratch folder."""
    import transformers.generation.utils as hf_utils

    import treespec
    import treespec.engine as engine
    from treespec import models

    for mod in (treespec, engine):
        for name in ("generate", "stream"):
            fn = getattr(engine, name)
            default = inspect.signature(fn).parameters["max_new_tokens"].default
            monkeypatch.setattr(mod, name, _capped(fn, default))
    hf_generate = hf_utils.GenerationMixin.generate

    def hf_capped(self, *args, **kwargs):
        if "max_new_tokens" in kwargs:
            kwargs["max_new_tokens"] = min(kwargs["max_new_tokens"], CAP)
        return hf_generate(self, *args, **kwargs)

    monkeypatch.setattr(hf_utils.GenerationMixin, "generate", hf_capped)

    name = request.node.callspec.params["name"]
    shared = request.getfixturevalue("smollm2") if _needs_real_model(BLOCKS[name]) else None
    real_load = models.load

    def load(name_or_path, **kwargs):
        if str(name_or_path) == REAL_MODEL and not kwargs and shared is not None:
            return shared
        return real_load(name_or_path, **kwargs)

    monkeypatch.setattr(models, "load", load)
    monkeypatch.chdir(tmp_path)  # nothing a snippet writes lands in the repository


def run_blocks(blocks: list[Block]) -> int:
    """Runs the runnable blocks in one namespace; returns how many ran."""
    ns = {"__name__": "__docs__"}
    ran = 0
    for b in blocks:
        if not b.run:
            continue
        where = f"{b.file}:{b.line}"
        if b.code.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(b.code, ns, where, b.file, b.line)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            result = runner.run(test, clear_globs=False)
            assert result.failed == 0, f"doctest block at {where} failed (see the output above)"
        else:
            exec(compile(b.code, where, "exec"), ns)  # noqa: S102 - the docs are this repository's own
        ran += 1
    return ran


@pytest.mark.parametrize("name", list(_params()))
def test_doc_blocks_run(name, doc_env, record_property):
    blocks = BLOCKS[name]
    ran = run_blocks(blocks)
    skipped = [f"{b.file}:{b.line}" for b in blocks if not b.run]
    record_property("blocks_run", ran)
    print(f"{name}: ran {ran} python block(s); not run (marked no-run): {skipped or 'none'}")
    assert ran == len(blocks) - len(skipped) >= 1


def test_every_block_is_accounted_for():
    """The inventory: what runs and what is marked no-run. The first pages a user pastes
    from (README, quickstart) hold no no-run block, and they run the real model."""
    total = sum(len(b) for b in BLOCKS.values())
    no_run = [f"{b.file}:{b.line}" for bs in BLOCKS.values() for b in bs if not b.run]
    print(f"{total} python blocks in {len(BLOCKS)} files: {total - len(no_run)} run; marked no-run: {no_run or 'none'}")
    for name in ("README.md", "docs/quickstart.md"):
        assert BLOCKS[name] and all(b.run for b in BLOCKS[name]), name
        assert _needs_real_model(BLOCKS[name]), name
    assert {"README.md", "docs/quickstart.md", "docs/trees.md", "docs/drafters.md"} <= {
        n for n, bs in BLOCKS.items() if any(b.run for b in bs)}


def test_fence_parsing_and_no_run():
    text = ("intro\n```python\nx = 1\n```\n\n```python no-run\nundefined_name()\n```\n"
            "```bash\nls\n```\n```python\n>>> x + 1\n2\n```\n")
    blocks = python_blocks(text, "t.md")
    assert [(b.line, b.run) for b in blocks] == [(2, True), (6, False), (12, True)]
    assert run_blocks(blocks) == 2  # the no-run block, which would raise NameError, is not run
    with pytest.raises(AssertionError, match="t.md:1"):
        run_blocks([Block("t.md", 1, ">>> 1 + 1\n3\n", True)])
    with pytest.raises(NameError):
        run_blocks([Block("t.md", 1, "undefined_name()\n", True)])


CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def test_torch_install_lines_name_the_cpu_index():
    """A plain ``pip install torch==X`` from PyPI is the CUDA build on Linux (a 527 MB wheel and
    about 20 nvidia packages, issue 31): every command that installs torch names PyTorch's CPU
    index, and the README says what CUDA users do instead."""
    lines = [(p.name, ln) for p in [*DOC_FILES, ROOT / ".ci" / "run"] for ln in p.read_text().splitlines()
             if re.match(r"\s*(python -m )?pip install (--quiet )?torch", ln)]  # commands, not prose
    assert any(name == "README.md" for name, _ in lines)
    readme_or_docs = [(n, ln) for n, ln in lines if n != "run"]
    assert all(CPU_INDEX in ln for _, ln in readme_or_docs), readme_or_docs
    assert any(CPU_INDEX in ln for n, ln in lines if n == "run")  # .ci/run, where no local wheel is offered
    readme = (ROOT / "README.md").read_text()
    assert "installs the **CUDA** build" in readme and "**CUDA:** bring your own torch build" in readme


def test_readme_says_what_greedy_exactness_holds_in_fp32_and_bf16():
    """Issue 31: the README promised "token for token when greedy" with no bf16 caveat beside it,
    and its snippet's greedy answer in bf16 differs between 1 and 2 threads."""
    readme = (ROOT / "README.md").read_text()
    promise = readme.index("token for token when greedy")
    near = " ".join(readme[promise: promise + 1600].split())
    assert "in **float32** the greedy output is identical to HF `model.generate`'s" in near
    assert "In **bfloat16**" in near and "near-tie" in near and "thread counts" in near
    assert "--dtype float32" in near
