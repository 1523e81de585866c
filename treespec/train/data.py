"""Training data for draft heads: JSONL in, tokenised conversations out.

Accepted record shapes (one JSON object per line):
    {"question": ..., "answer": ...}          GSM8K
    {"prompt": ..., "completion"|"response"|"output"|"canonical_solution": ...}
    {"messages": [{"role": ..., "content": ...}, ...]}   chat (the last assistant turn is the answer)
    {"text": ...}                              plain text, no chat template

Lines that are not JSON objects, or have none of these fields, are skipped and counted;
a file with no usable line is an error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Example", "DataStats", "read_jsonl", "prompt_text", "tokenize_example"]

log = logging.getLogger(__name__)

_ANSWER_KEYS = ("answer", "completion", "response", "output", "canonical_solution")


@dataclass
class Example:
    """``messages`` ends with the user turn; ``answer`` is the reference reply (may be
    replaced by the target's own when self-distilling); ``text`` for plain-text records."""

    messages: list[dict] | None = None
    answer: str | None = None
    text: str | None = None


@dataclass
class DataStats:
    lines: int = 0
    used: int = 0
    skipped_bad_json: int = 0
    skipped_no_fields: int = 0
    skipped_too_long: int = 0
    reasons: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (f"{self.used} of {self.lines} lines used; skipped: {self.skipped_bad_json} not JSON "
                f"objects, {self.skipped_no_fields} without usable fields, {self.skipped_too_long} too long")


def _parse(obj) -> Example | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("messages"), list) and obj["messages"]:
        msgs = [m for m in obj["messages"] if isinstance(m, dict) and "role" in m and "content" in m]
        if not msgs:
            return None
        if msgs[-1]["role"] == "assistant":
            return Example(messages=msgs[:-1], answer=str(msgs[-1]["content"]))
        return Example(messages=msgs)
    q = obj.get("question", obj.get("prompt"))
    if isinstance(q, str) and q.strip():
        a = next((obj[k] for k in _ANSWER_KEYS if isinstance(obj.get(k), str)), None)
        return Example(messages=[{"role": "user", "content": q}], answer=a)
    if isinstance(obj.get("text"), str) and obj["text"].strip():
        return Example(text=obj["text"])
    return None


def read_jsonl(path, limit: int | None = None, stats: DataStats | None = None) -> list[Example]:
    """Read examples from a JSONL file (``.gz`` accepted) or a dataset packaged in
    :mod:`treespec.data` by name (``"gsm8k-train"``)."""
    import gzip

    from ..data import DATASETS, dataset_path

    if isinstance(path, str) and path in DATASETS and not Path(path).exists():
        path = dataset_path(path)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"training data {path} does not exist (give a JSONL file or one of the "
                                f"packaged datasets: {', '.join(DATASETS)})")
    stats = stats if stats is not None else DataStats()
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[Example] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            stats.lines += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                stats.skipped_bad_json += 1
                continue
            ex = _parse(obj)
            if ex is None:
                stats.skipped_no_fields += 1
                continue
            out.append(ex)
            stats.used += 1
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(
            f"{path} has no usable examples ({stats.describe()}); expected JSONL records with "
            f"question/answer, prompt/completion, messages or text fields"
        )
    if stats.skipped_bad_json or stats.skipped_no_fields:
        log.warning("%s: %s", path, stats.describe())
    return out


def prompt_text(tokenizer, ex: Example) -> str:
    if ex.text is not None:
        return ex.text
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in ex.messages) + "\n"


def tokenize_example(tokenizer, ex: Example, answer: str | None = None) -> tuple[list[int], int]:
    """``(token ids, prompt length)``; the answer is followed by EOS when there is a chat
    template (that is how the target ends a reply)."""
    p = prompt_text(tokenizer, ex)
    ids = tokenizer(p, add_special_tokens=False)["input_ids"]
    if ex.text is not None:
        return ids, 0
    a = ex.answer if answer is None else answer
    if a is None:
        return ids, len(ids)
    aid = tokenizer(a, add_special_tokens=False)["input_ids"]
    if getattr(tokenizer, "chat_template", None) and tokenizer.eos_token_id is not None:
        aid = aid + [tokenizer.eos_token_id]
    return ids + aid, len(ids)
