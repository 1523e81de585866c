"""The generated training prompt sets: the shipped files are what the generators write (the
chat sets, the stdlib-code set, the templated sets of ``treespec make-prompts --templated``),
signature defaults naming a machine's folders are replaced, and no training prompt shares text
with an evaluation set."""

from __future__ import annotations

import sys

import pytest

from treespec import data
from treespec.train.generated_prompts import EVAL_TEMPLATES, EVAL_TOPICS, chat_prompts, stdlib_code_prompts


# ---- prompt sets ------------------------------------------------------------------------------


def test_chat_prompts_are_the_shipped_ones_and_the_eval_set_is_held_out():
    for split, name in (("train", "chat-train"), ("eval", "chat-eval")):
        assert chat_prompts(split) == chat_prompts(split) == data.load_dataset(name)
    train = data.load_dataset("chat-train")
    assert len(train) == 3808 and len(data.load_dataset("chat-eval")) == 48
    assert not {r["topic"] for r in train} & set(EVAL_TOPICS)
    assert not any(t.split("{topic}")[0] in r["prompt"] for t in EVAL_TEMPLATES for r in train)


ELSEWHERE = "/opt/a-much-longer-folder-than-any-ci-uses/user-venv/bin/python3"


def test_stdlib_code_prompts_are_the_shipped_ones(monkeypatch):
    """Built as a user's venv whose interpreter lives elsewhere builds them: the shipped set
    carried the path of the interpreter that made it (``architecture(executable=...)``), so the
    test passed only on that interpreter (issue 31)."""
    import platform

    shipped = data.load_dataset("stdlib-code")
    assert len(shipped) == 3168 and {r["kind"] for r in shipped} == {"write", "howto", "explain"}
    if shipped[0]["python"] != "%d.%d.%d" % sys.version_info[:3]:
        pytest.skip(f"the shipped set was made with Python {shipped[0]['python']}: docstrings differ by version")
    monkeypatch.setattr(sys, "executable", ELSEWHERE)
    monkeypatch.setattr(platform.architecture, "__defaults__", (ELSEWHERE, "", ""))  # bound at import
    assert stdlib_code_prompts() == shipped
    (row,) = [r for r in shipped if r["source"] == "platform.architecture" and r["kind"] == "write"]
    assert "`architecture(executable=sys.executable, bits='', linkage='')`" in row["prompt"]


@pytest.mark.parametrize("default, shown", [
    (ELSEWHERE, "sys.executable"),
    ("/srv/someone/data/file.txt", "..."),
    ("C:\\Users\\someone\\x.ini", "..."),
    ("~/notes.txt", "..."),
    ("/", "'/'"),  # a separator, not a machine's folder
    ("utf-8", "'utf-8'"),
])
def test_signature_defaults_that_name_a_machines_folders_are_replaced(monkeypatch, default, shown):
    from treespec.train.generated_prompts import _signature

    monkeypatch.setattr(sys, "executable", ELSEWHERE)

    def f(path=default, n=1):
        pass

    assert _signature(f) == f"(path={shown}, n=1)"


def test_training_prompts_share_no_text_with_the_evaluation_sets():
    train = [r["prompt"] for n in ("stdlib-code", "chat-train") for r in data.load_dataset(n)]
    train += [r["question"] for r in data.load_dataset("gsm8k-train")]
    evals = ([r["prompt"] for r in data.load_dataset("humaneval")] + [r["question"] for r in data.load_dataset("gsm8k-test")]
             + [r["prompt"] for r in data.load_dataset("chat-eval")])
    assert not set(train) & set(evals)
    # No HumanEval docstring line and no GSM8K-test question sentence inside a generated prompt
    # (GSM8K's own train and test splits share a few sentences: that is upstream's split).
    joined = "\n".join(r["prompt"] for n in ("stdlib-code", "chat-train") for r in data.load_dataset(n))
    lines = {ln.strip() for r in data.load_dataset("humaneval") for ln in r["prompt"].splitlines() if len(ln.strip()) >= 40}
    lines |= {s.strip() for r in data.load_dataset("gsm8k-test") for s in r["question"].split(". ") if len(s.strip()) >= 60}
    assert not [ln for ln in lines if ln in joined]


def test_make_prompts_templated_writes_the_shipped_chat_files(tmp_path, capsys):
    """``treespec make-prompts --templated`` (was ``python -m treespec.train.prompts``) writes
    the shipped files byte for byte (the chat sets depend on nothing but treespec)."""
    from treespec.cli import main

    assert main(["make-prompts", "--templated", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name, n in (("chat_train", 3808), ("chat_eval", 48)):
        assert f"{name}.jsonl.gz: {n} prompts" in out
        assert (tmp_path / f"{name}.jsonl.gz").read_bytes() == data.dataset_path(name.replace("_", "-")).read_bytes()
    assert (tmp_path / "stdlib_code.jsonl.gz").exists()
    assert main(["make-prompts", "--templated", "--n", "5", "--out", str(tmp_path)]) == 2
