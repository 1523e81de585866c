"""Prompts as the benchmarks and the command line give them to the target.

    prompts, fmt = load_prompts("gsm8k", tokenizer, num_prompts=50)   # token ids, "chat"
    ids = encode_prompt(tokenizer, "Write a haiku.", chat=True)

A prompt set (:data:`PROMPT_SETS`) names a packaged dataset (:mod:`treespec.data`), the
field holding each prompt and the instruction a chat message wraps it in; a JSONL file
works too. Prompts are encoded the one way every figure in the docs was measured: as a single
user message through the tokenizer's chat template, or as plain text with ``raw``.

Spec-Bench (``"spec-bench"``, or one category: ``"spec-bench:qa"``) comes as :class:`Prompt`
values from :func:`load_bench_prompts`: each carries its category and, for MT-bench's
questions, both user turns; the second is asked after the target's own first answer
(:meth:`Prompt.next_turn`), as Spec-Bench does.

    prompts, fmt = load_bench_prompts("spec-bench", tokenizer, num_prompts=10)  # 10 per category
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .data import dataset_path, read_jsonl

__all__ = ["PROMPT_SETS", "SPEC_BENCH", "SPEC_BENCH_CATEGORIES", "MT_BENCH_CATEGORIES", "Prompt", "dataset_file",
           "load_prompts", "load_bench_prompts", "spec_bench_questions", "encode_prompt", "encode_conversation"]

log = logging.getLogger(__name__)

#: prompt sets: name -> (packaged dataset in treespec.data, prompt field, chat instruction)
PROMPT_SETS = {
    "gsm8k": ("gsm8k-test", "question", "{text}"),
    "humaneval": (
        "humaneval", "prompt",
        "Complete the following Python function. Reply with the whole function in one "
        "Python code block.\n\n```python\n{text}```",
    ),
    "chat": ("chat-eval", "prompt", "{text}"),  # held out from chat-train (treespec/train/generated_prompts.py)
}


SPEC_BENCH = "spec-bench"
#: MT-bench's categories, which Spec-Bench reports together as "conversation" (two turns each)
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
#: Spec-Bench's six reported categories, in its leaderboard's order
SPEC_BENCH_CATEGORIES = ("conversation", "translation", "summarization", "qa", "math_reasoning", "rag")


def _spec_bench_selection(dataset: str) -> str | None:
    """The category of ``spec-bench:CATEGORY`` (None for the whole benchmark), checked."""
    _, sep, category = dataset.partition(":")
    if not sep:
        return None
    if category not in SPEC_BENCH_CATEGORIES + MT_BENCH_CATEGORIES:
        raise ValueError(f"unknown Spec-Bench category {category!r}: use {', '.join(SPEC_BENCH_CATEGORIES)} "
                         f"or one of MT-bench's ({', '.join(MT_BENCH_CATEGORIES)})")
    return category


def _is_spec_bench(dataset: str) -> bool:
    return dataset == SPEC_BENCH or dataset.startswith(SPEC_BENCH + ":")


def dataset_file(dataset: str) -> tuple[Path, str, str]:
    """``(file, default prompt field, chat instruction)`` of a prompt set name or a JSONL path."""
    if _is_spec_bench(dataset):
        _spec_bench_selection(dataset)
        return dataset_path(SPEC_BENCH), "turns", "{text}"
    if dataset in PROMPT_SETS:
        name, fld, instruction = PROMPT_SETS[dataset]
        return dataset_path(name), fld, instruction
    path = Path(dataset).expanduser()
    if path.suffix in (".jsonl", ".gz") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"no dataset file at {dataset}")
        return path, "prompt", "{text}"
    raise ValueError(f"unknown dataset {dataset!r}: use {', '.join(PROMPT_SETS)}, {SPEC_BENCH}[:CATEGORY] "
                     f"or a .jsonl file")


def load_prompts(dataset: str, tokenizer, num_prompts: int | None = None, *, prompt_field: str | None = None,
                 raw: bool = False) -> tuple[list[list[int]], str]:
    """The first ``num_prompts`` prompts of ``dataset`` as token ids, and their format.

    ``dataset`` is ``"gsm8k"`` (GSM8K test, packaged in :mod:`treespec.data`, field ``question``),
    ``"humaneval"`` (HumanEval, packaged, field ``prompt``, asked as a chat
    message to complete the function), ``"chat"`` (treespec's held-out chat prompts) or a
    JSONL file (field ``prompt_field``, default ``prompt``). Prompts go through the
    tokenizer's chat template as one user message, unless ``raw`` or the tokenizer has none
    (then the text is used as is, format ``"raw"``; a warning is logged for the latter).
    Spec-Bench gives its questions' first turns (``num_prompts`` per category, as
    :func:`load_bench_prompts`, which has the second turns too).
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if _is_spec_bench(dataset):
        prompts, fmt = load_bench_prompts(dataset, tokenizer, num_prompts, prompt_field=prompt_field, raw=raw)
        return [list(p.ids) for p in prompts], fmt
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
    chat = _chat(tokenizer, dataset, raw)
    out = [encode_prompt(tokenizer, instruction.format(text=t) if chat else t, chat) for t in texts]
    return out, "chat" if chat else "raw"


def _chat(tokenizer, dataset: str, raw: bool) -> bool:
    """Whether prompts go through the chat template (a warning when there is none to use)."""
    chat = not raw and bool(getattr(tokenizer, "chat_template", None))
    if not raw and not chat:
        log.warning("the tokenizer has no chat template: using the %s prompts as plain text", dataset)
    return chat


def encode_prompt(tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    """Token ids of ``text``: as one user chat message with the generation prompt, or as
    plain text (the tokenizer's special tokens, e.g. BOS, added). ``system``: a system prompt
    before it (see :func:`encode_conversation`)."""
    return encode_conversation(tokenizer, [text], [], chat, system)


def encode_conversation(tokenizer, turns: Sequence[str], answers: Sequence[str], chat: bool,
                        system: str | None = None) -> list[int]:
    """Token ids of a conversation that ends with the user's turn ``turns[-1]``: user turn i,
    then ``answers[i]`` as the assistant's reply, for each earlier turn. As chat messages with
    the generation prompt, or as plain text (turns and answers joined by blank lines, BOS added).
    ``system``: a system message first (in plain text, the first paragraph); None leaves the
    template's own default, if it has one (SmolLM2's names itself)."""
    if len(answers) != len(turns) - 1:
        raise ValueError(f"a conversation of {len(turns)} user turns needs {len(turns) - 1} answers, "
                         f"got {len(answers)}")
    if chat:
        messages = [] if system is None else [{"role": "system", "content": system}]
        for turn, answer in zip(turns, [*answers, None]):
            messages.append({"role": "user", "content": turn})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n\n".join(x for pair in zip(turns, [*answers, None]) for x in pair if x is not None)
    if system is not None:
        text = f"{system}\n\n{text}"
    return list(tokenizer(text)["input_ids"])


# ---- Spec-Bench -------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One benchmark question as the target gets it.

    ids:      token ids of its first user turn, templated (what the target is given first).
    category: the category it is reported under (Spec-Bench's; None for other datasets).
    turns:    every user turn's text when there are several (MT-bench's two), else ``()``:
              turn i+1 is asked after the target's own answers to turns 1..i
              (:meth:`next_turn`), as Spec-Bench does.
    chat:     whether later turns go through the chat template (as ``ids`` did).
    """

    ids: tuple[int, ...]
    category: str | None = None
    turns: tuple[str, ...] = ()
    chat: bool = True

    @property
    def num_turns(self) -> int:
        return max(len(self.turns), 1)

    def next_turn(self, tokenizer, answers: Sequence[Sequence[int]]) -> list[int]:
        """Token ids of the conversation up to user turn ``len(answers) + 1``, the target's
        ``answers`` (token ids, one per earlier turn) decoded as its replies."""
        if not 1 <= len(answers) < self.num_turns:
            raise ValueError(f"a prompt of {self.num_turns} turn(s) has no turn after {len(answers)} answer(s)")
        texts = [tokenizer.decode(list(a), skip_special_tokens=True).strip() for a in answers]
        return encode_conversation(tokenizer, self.turns[: len(answers) + 1], texts, self.chat)


def spec_bench_questions(dataset: str = SPEC_BENCH, num_prompts: int | None = None) -> list[dict]:
    """Spec-Bench's questions for ``"spec-bench"`` or ``"spec-bench:CATEGORY"``: ``num_prompts``
    per reported category (default all), categories in the file's order, each row's
    ``category`` the one it is reported under (MT-bench's eight become ``conversation``,
    unless one of them is chosen alone).

    A category's first ``num_prompts`` questions in file order, except ``conversation``, which
    takes MT-bench's eight categories in turn (writing 1, roleplay 1, ..., humanities 1,
    writing 2, ...), so that ten questions are not ten writing questions.
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    only = _spec_bench_selection(dataset)
    by_category: dict[str, list[dict]] = {}
    for row in read_jsonl(dataset_path(SPEC_BENCH)):
        if row["category"] in MT_BENCH_CATEGORIES and only not in MT_BENCH_CATEGORIES:
            row = {**row, "category": "conversation", "mt_bench_category": row["category"]}
        by_category.setdefault(row["category"], []).append(row)
    if only is not None:
        by_category = {only: by_category[only]}
    out = []
    for category, rows in by_category.items():
        if category == "conversation":  # MT-bench's categories in turn, each in file order
            groups = [[r for r in rows if r["mt_bench_category"] == c] for c in MT_BENCH_CATEGORIES]
            rows = [g[k] for k in range(max(map(len, groups))) for g in groups if k < len(g)]
        out += rows[:num_prompts]
    return out


def load_bench_prompts(dataset: str, tokenizer, num_prompts: int | None = None, *, prompt_field: str | None = None,
                       raw: bool = False) -> tuple[list[Prompt], str]:
    """The prompts of ``dataset`` as :class:`Prompt` values, and their format (``"chat"`` or
    ``"raw"``). Spec-Bench (``"spec-bench"`` or ``"spec-bench:CATEGORY"``): ``num_prompts``
    questions per category (:func:`spec_bench_questions`), each with its category and turns;
    any other dataset: :func:`load_prompts`' prompts, single-turn, without a category."""
    if not _is_spec_bench(dataset):
        ids, fmt = load_prompts(dataset, tokenizer, num_prompts, prompt_field=prompt_field, raw=raw)
        return [Prompt(tuple(p)) for p in ids], fmt
    if prompt_field not in (None, "turns"):
        raise ValueError(f"Spec-Bench's prompts are its questions' turns: drop --prompt-field {prompt_field}")
    rows = spec_bench_questions(dataset, num_prompts)
    chat = _chat(tokenizer, dataset, raw)
    out = [Prompt(tuple(encode_prompt(tokenizer, r["turns"][0], chat)), r["category"],
                  tuple(r["turns"]) if len(r["turns"]) > 1 else (), chat) for r in rows]
    return out, "chat" if chat else "raw"
