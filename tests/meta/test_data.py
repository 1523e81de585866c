"""The datasets packaged in treespec/data: present, readable, licensed, and carried by a wheel."""

from __future__ import annotations

import fnmatch
import gzip
import json
import re
import sys
from pathlib import Path

import pytest

from treespec import data
from treespec.prompts import PROMPT_SETS as BENCH_DATASETS
from treespec.prompts import dataset_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, count, fields", [
    ("gsm8k-test", 1319, {"question", "answer"}),
    ("gsm8k-train", 7473, {"question", "answer"}),
    ("humaneval", 164, {"task_id", "prompt", "canonical_solution", "test", "entry_point"}),
])
def test_packaged_datasets_load_whole(name, count, fields):
    rows = data.load_dataset(name)
    assert len(rows) == count
    assert all(set(r) >= fields for r in rows)


def test_load_dataset_limit_and_first_records():
    rows = data.load_dataset("gsm8k-test", limit=2)
    assert len(rows) == 2
    assert rows[0]["question"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert data.load_dataset("humaneval", limit=1)[0]["task_id"] == "HumanEval/0"
    assert data.load_dataset("gsm8k-train", limit=1)[0]["question"].startswith("Natalia sold clips")


def test_unknown_dataset_names_the_known_ones():
    with pytest.raises(ValueError, match="gsm8k-test, gsm8k-train, humaneval"):
        data.dataset_path("squad")


def test_read_jsonl_names_the_bad_line(tmp_path):
    f = tmp_path / "d.jsonl.gz"
    with gzip.open(f, "wt", encoding="utf-8") as g:
        g.write(json.dumps({"a": 1}) + "\n\n[1, 2]\n")
    with pytest.raises(ValueError, match="line 3 is not a JSON object"):
        data.read_jsonl(f)
    assert data.read_jsonl(f, limit=1) == [{"a": 1}]


def test_every_dataset_file_has_its_licence():
    readme = (Path(data.__file__).parent / "README.md").read_text()
    for name, (fname, _) in data.DATASETS.items():
        assert f"`{name}`" in readme and f"`{fname}`" in readme
    for lic in ("LICENSE-gsm8k", "LICENSE-humaneval"):
        text = (Path(data.__file__).parent / lic).read_text()
        assert "MIT License" in text and "Copyright (c)" in text and "OpenAI" in text
    assert "Apache License" in (Path(data.__file__).parent / "LICENSE-spec-bench").read_text()


def test_bench_datasets_need_no_shared_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("TREESPEC_SHARED", str(tmp_path / "nowhere"))
    for name in BENCH_DATASETS:
        path, _, _ = dataset_file(name)
        assert path.is_file() and path.parent == Path(data.__file__).parent


def _package_data_patterns() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)["tool"]["setuptools"]["package-data"]["treespec"]
    section = text.split("[tool.setuptools.package-data]", 1)[1]  # Python 3.10: no tomllib
    return json.loads(re.search(r"^treespec\s*=\s*(\[.*?\])", section, re.M | re.S).group(1))


def test_pyproject_package_data_carries_every_data_file():
    patterns = _package_data_patterns()
    folder = Path(data.__file__).parent
    files = [p.relative_to(folder.parent).as_posix() for p in folder.iterdir()
             if p.is_file() and p.suffix != ".py" and p.name != "__pycache__"]
    licences = [f for f in files if f.startswith("data/LICENSE-")]
    assert len(files) == len(data.DATASETS) + len(licences) + 1  # the datasets, their licences, the README
    assert len(licences) == 4
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns), f"{f} would be left out of a wheel"


# Absolute folders and user names: a shipped file must read the same on every machine (issue 31:
# the stdlib-code prompts carried the path of the interpreter that built them).
MACHINE_PATHS = re.compile(rb"/root/|/home/|/tmp/|/work/|/usr/|/Users/|/opt/|C:\\\\|C:\\(?![nrt])")
# (JSON writes C:\ as C:\\; a lone C:\ counts unless it starts an escape: "class C:\n" is code)


def shipped_files():
    for folder in ("data", "assets"):
        for f in sorted((ROOT / "treespec" / folder).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".py", ".pyc"):
                yield f


def test_shipped_data_holds_no_machine_paths():
    import os

    here = [p.encode() for p in {str(Path.home()), sys.prefix, sys.base_prefix, os.getcwd(), str(ROOT)}
            if len(p) > 4]  # this machine's own folders too, wherever they are
    files = list(shipped_files())
    assert {f.name for f in files} >= {"stdlib_code.jsonl.gz", "model.safetensors", "auto-profile.json"}
    found = []
    for f in files:
        raw = f.read_bytes()
        if f.suffix == ".gz":
            raw = gzip.decompress(raw)
        hits = [m.group() for m in MACHINE_PATHS.finditer(raw)] + [p for p in here if p in raw]
        found += [f"{f.relative_to(ROOT)}: {h!r}" for h in hits]
    assert not found, found


def test_the_scan_finds_a_path():
    assert MACHINE_PATHS.search(b"architecture(executable='/root/.pyenv/versions/3.11.7/bin/python')")
    assert MACHINE_PATHS.search(b"C:\\Users") and MACHINE_PATHS.search(b'"C:\\\\Users"')
    assert not MACHINE_PATHS.search(b"a / b, https://github.com/openai/human-eval, class C:\\n")
