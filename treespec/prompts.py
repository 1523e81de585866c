"""Prompts as the benchmarks and the command line give them to the target.

    prompts, fmt = load_prompts("gsm8k", tokenizer, num_prompts=50)   # token ids, "chat"
    ids = encode_prompt(tokenizer, "Write a haiku.", chat=True)

A prompt set (:data:`PROMPT_SETS`) names a packaged dataset (:mod:`treespec.data`), the
field holding each prompt and the instruction a chat message wraps it in; a JSONL file
works too. Prompts are encoded the one way every figure in the docs was measured: as a single
user message through the tokenizer's chat template, or as plain text with ``raw``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .data import dataset_path, read_jsonl

__all__ = ["PROMPT_SETS", "dataset_file", "load_prompts", "encode_prompt"]

log = logging.getLogger(__name__)

#: prompt sets: name -> (packaged dataset in treespec.data, prompt field, chat instruction)
PROMPT_SETS = {
    "gsm8k": ("gsm8k-test", "question", "{text}"),
    "humaneval": (
        "humaneval", "prompt",
        "Complete the following Python function. Reply with the whole function in one "
        "Python code block.\n\n```python\n{text}```",
    ),
    "chat": ("chat-eval", "prompt", "{text}"),  # held out from chat-train (treespec/train/prompts.py)
}


def dataset_file(dataset: str) -> tuple[Path, str, str]:
    """``(file, default prompt field, chat instruction)`` of a prompt set name or a JSONL path."""
    if dataset in PROMPT_SETS:
        name, fld, instruction = PROMPT_SETS[dataset]
        return dataset_path(name), fld, instruction
    path = Path(dataset).expanduser()
    if path.suffix in (".jsonl", ".gz") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"no dataset file at {dataset}")
        return path, "prompt", "{text}"
    raise ValueError(f"unknown dataset {dataset!r}: use {', '.join(PROMPT_SETS)} or a .jsonl file")


def load_prompts(dataset: str, tokenizer, num_prompts: int | None = None, *, prompt_field: str | None = None,
                 raw: bool = False) -> tuple[list[list[int]], str]:
    """The first ``num_prompts`` prompts of ``dataset`` as token ids, and their format.

    ``dataset`` is ``"gsm8k"`` (GSM8K test, packaged in :mod:`treespec.data`, field ``question``),
    ``"humaneval"`` (HumanEval, packaged, field ``prompt``, asked as a chat
    message to complete the function), ``"chat"`` (treespec's held-out chat prompts) or a
    JSONL file (field ``prompt_field``, default ``prompt``). Prompts go through the
    tokenizer's chat template as one user message, unless ``raw`` or the tokenizer has none
    (then the text is used as is, format ``"raw"``; a warning is logged for the latter).
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    path, default_field, instruction = dataset_file(dataset)
    fld = prompt_field or default_field
    rows = read_jsonl(path, num_prompts)
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    texts = []
    for n, row in enumerate(rows):
        text = row.get(fld)
        if not isinstance(text, str):
            raise ValueError(f"{path} record {n} has no string field {fld!r} (fields: {', '.join(row)}); "
                             f"choose one with --prompt-field")
        texts.append(text)
    chat = not raw and bool(getattr(tokenizer, "chat_template", None))
    if not raw and not chat:
        log.warning("the tokenizer has no chat template: using the %s prompts as plain text", dataset)
    out = [encode_prompt(tokenizer, instruction.format(text=t) if chat else t, chat) for t in texts]
    return out, "chat" if chat else "raw"


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of ``text``: as one user chat message with the generation prompt, or as
    plain text (the tokenizer's special tokens, e.g. BOS, added)."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])
