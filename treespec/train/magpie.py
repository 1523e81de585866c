"""Self-generated user turns ("Magpie", Xu et al. 2024): prompts that look like what people ask.

An aligned chat model given its chat template up to the start of a user turn writes a
plausible user message. Sampled at temperature about 1 (top-p 0.95) the target itself writes
thousands of varied requests (questions, tasks, stories, code) in the distribution its chat
tuning saw, which a draft head then learns to follow; templated prompts cover only the
templates someone wrote.

    rows = generate_user_turns(model, tok, n=512, seed=0)      # raw, seeded
    kept, report = filter_user_turns(rows, EvalOverlap.packaged())  # cleaned, deduplicated
    follow = generate_user_turns(model, tok, n=64, seed=1, history=[[{"role": "user", ...},
                                 {"role": "assistant", ...}]])  # second turns

Every chunk of ``batch_size`` messages is sampled from its own seed, ``(seed, chunk)``, so a
chunk is the same whatever ran before it (on one machine, dtype and thread count: sampling
follows the logits' rounding). The filters are deterministic.

Chunks are kept in a folder and skipped when present (:func:`sample_chunk`, :func:`chunks_to_sample`),
so a set of thousands builds over several sessions. ``treespec train-eagle --model M --out DIR``
samples its prompts this way (:mod:`treespec.train.pipeline`); the shipped set was built with::

    treespec make-prompts --n 32768 --work runs/magpie --out treespec/data

**Second turns.** After a capture has answered first turns, the target writes a follow-up to
each of its own answers (``history`` = the user's turn and the target's answer, as in
MT-bench, whose second turns are asked after the model's own first answer)::

    treespec make-prompts --follow-ups benchmarks/data/captures/cap-magpie-val,benchmarks/data/captures/cap-magpie \
        --work runs/magpie2 --out treespec/data     # magpie_chat2.jsonl.gz: {"messages": [user, assistant, user]}

The conversations come from the capture folders' answers files (:func:`captured_conversations`,
in the folders' order), 64 per chunk, each chunk from seed ``(seed, chunk)``
(``--seed`` defaults to 1 here, 0 for first turns); the follow-ups pass the same filters, and
one that repeats its conversation's first turn is dropped too.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..data import read_jsonl as read_rows  # plain dicts (train.data.read_jsonl makes Examples)

__all__ = ["user_turn_prefix", "generate_user_turns", "filter_user_turns", "EvalOverlap", "normalise",
           "captured_conversations", "filter_follow_ups", "chunk_file", "chunks_to_sample", "sample_chunk",
           "read_chunks", "kept_turns", "write_prompt_set"]

log = logging.getLogger(__name__)

_MARK = "\u2063MAGPIE\u2063"  # a placeholder no template touches (invisible separator around a word)


def user_turn_prefix(tokenizer, history: list[dict] | None = None) -> list[int]:
    """Token ids of the chat template up to where the next user message's text starts.

    ``history``: earlier turns (user, assistant, ...); the template's default system prompt, if
    it adds one, is kept. Found by rendering a placeholder message and cutting before it, so
    it holds for any template that copies the message text verbatim.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self-generated user turns need a chat model: the tokenizer has no chat template")
    text = tokenizer.apply_chat_template(list(history or []) + [{"role": "user", "content": _MARK}], tokenize=False)
    if text.count(_MARK) != 1:
        raise ValueError("the chat template does not copy a user message verbatim; cannot find where a user turn starts")
    return tokenizer(text.split(_MARK)[0], add_special_tokens=False)["input_ids"]


def _end_ids(tokenizer) -> set[int]:
    """Tokens that end a turn: EOS and, where the template closes turns with its own token, that."""
    ends = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id and i >= 0:
            ends.add(i)
    return ends


def generate_user_turns(model, tokenizer, n: int, seed: int = 0, *, chunk: int = 0, batch_size: int = 64,
                        temperature: float = 1.0, top_p: float = 0.95, max_new_tokens: int = 160,
                        history: list[list[dict]] | None = None) -> list[dict]:
    """``n`` user messages sampled from the target, as ``{"prompt", "seed", "chunk", "ended"}``.

    Messages are sampled ``batch_size`` at a time; chunk ``chunk + k`` from seed ``(seed, chunk + k)``.
    ``history``: one earlier conversation per message (all of the same turn count), for
    follow-up turns; without it, first turns. ``ended`` is False when the message ran into
    ``max_new_tokens`` (the filters drop those: a cut request is not a request).
    """
    if not 0 < temperature or not 0 < top_p <= 1:
        raise ValueError(f"need temperature > 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if history is not None and len(history) != n:
        raise ValueError(f"history needs one conversation per message: {len(history)} for n={n}")
    from ..engine import generate

    ends = sorted(_end_ids(tokenizer))
    out: list[dict] = []
    for k, start in enumerate(range(0, n, batch_size)):
        rows = range(start, min(start + batch_size, n))
        prefixes = [user_turn_prefix(tokenizer, history[i] if history else None) for i in rows]
        # One generator per message, seeded by (seed, chunk, row): a message does not depend on
        # the others in its batch. Through treespec's engine without a draft: a batch drops
        # its finished rows, and it runs on packed weights where the caller packed them.
        seeds = [hash((seed, chunk + k, j)) & 0x7FFFFFFF for j in range(len(prefixes))]  # ints hash alike in every process
        gen = generate(model, "none", "chain-1", prefixes, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_p=top_p, seed=seeds, eos_token_id=ends)
        for row in gen.sequences:
            cut = next((j for j, t in enumerate(row) if t in ends), None)
            text = tokenizer.decode(row[:cut], skip_special_tokens=True).strip()
            out.append({"prompt": text, "seed": seed, "chunk": chunk + k, "ended": cut is not None})
    return out


# ---- filters ----------------------------------------------------------------------------------


def normalise(text: str) -> str:
    """Lower case, accents folded, punctuation and runs of space as one space: what two texts
    that say the same words have in common."""
    t = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return " ".join(re.findall(r"[a-z0-9]+", t))


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i: i + n]) for i in range(len(words) - n + 1)}


@dataclass
class EvalOverlap:
    """What a training prompt must not share with the evaluation sets: equal normalised text,
    or any run of ``n`` consecutive words (long enough that only copied text shares one)."""

    texts: set[str] = field(default_factory=set)
    grams: set[tuple[str, ...]] = field(default_factory=set)
    n: int = 8

    @classmethod
    def of(cls, texts, n: int = 8) -> "EvalOverlap":
        o = cls(n=n)
        for t in texts:
            norm = normalise(t)
            o.texts.add(norm)
            o.grams |= _ngrams(norm.split(), n)
        return o

    @classmethod
    def packaged(cls, n: int = 8) -> "EvalOverlap":
        """Spec-Bench (every turn), GSM8K test, HumanEval prompts and chat-eval."""
        from ..data import load_dataset

        texts = [t for r in load_dataset("spec-bench") for t in r["turns"]]
        texts += [r["question"] for r in load_dataset("gsm8k-test")]
        texts += [r["prompt"] for r in load_dataset("humaneval")]
        texts += [r["prompt"] for r in load_dataset("chat-eval")]
        return cls.of(texts, n)

    def hits(self, text: str) -> bool:
        norm = normalise(text)
        return norm in self.texts or not self.grams.isdisjoint(_ngrams(norm.split(), self.n))


def _degenerate(text: str) -> str | None:
    """Why ``text`` reads as a broken generation, or None."""
    words = text.split()
    if re.search(r"(.)\1{9,}", text):
        return "a character repeated 10 times"
    if len(words) >= 12 and len(set(words)) / len(words) < 0.4:
        return "few distinct words"
    grams = Counter(zip(words, words[1:], words[2:]))
    if grams and grams.most_common(1)[0][1] >= 3:
        return "a three-word phrase repeated"
    return None


def _not_english(text: str) -> bool:
    """Mostly non-ASCII letters, or none of the commonest English words."""
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < 0.97:
        return True
    common = {"the", "a", "an", "i", "you", "is", "are", "to", "of", "and", "in", "for", "what", "how", "can", "my",
              "me", "it", "on", "with", "this", "that", "do", "be", "your", "please", "write", "about"}
    return not common & set(normalise(text).split())


def filter_user_turns(rows: list[dict], overlap: EvalOverlap | None = None, *, min_chars: int = 12,
                      max_chars: int = 1200, dedup_threshold: float = 0.7, seed: int = 0) -> tuple[list[dict], Counter]:
    """The rows worth training on, in their order, and a count of what was dropped and why.

    Drops: cut off (``ended`` False), too short or long, not English, degenerate repetition,
    overlap with the evaluation sets, and near-duplicates of an earlier kept row (MinHash
    over word 3-grams, estimated Jaccard >= ``dedup_threshold``; exact normalised duplicates
    always).
    """
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=dedup_threshold, num_perm=64)
    seen: set[str] = set()
    kept, why = [], Counter()
    for k, row in enumerate(rows):
        text = row["prompt"]
        norm = normalise(text)
        if not row.get("ended", True):
            why["cut off"] += 1
        elif not min_chars <= len(text) <= max_chars or len(norm.split()) < 3:
            why["length"] += 1
        elif _not_english(text):
            why["not English"] += 1
        elif _degenerate(text):
            why["repetition"] += 1
        elif overlap is not None and overlap.hits(text):
            why["overlaps an evaluation set"] += 1
        elif norm in seen:
            why["duplicate"] += 1
        else:
            words = norm.split()
            m = MinHash(num_perm=64, seed=seed)
            m.update_batch([" ".join(g).encode() for g in zip(words, words[1:], words[2:])] or [norm.encode()])
            if lsh.query(m):
                why["near-duplicate"] += 1
                continue
            lsh.insert(str(k), m)
            seen.add(norm)
            kept.append(row)
    return kept, why


# ---- second turns ------------------------------------------------------------------------------


def captured_conversations(capture_dirs, tokenizer) -> list[dict]:
    """The conversations captures answered, as ``{"source", "messages": [..., assistant]}``.

    Reads each folder's answers files (``treespec capture``; the folders' order, then the plan's):
    a row's ``source`` (``"dataset:index"``) names its prompt, read back from that dataset, and
    its answer tokens are decoded as the assistant's turn. An answer that ran into the capture's
    token limit is kept as it was cut, as Spec-Bench asks its second turns after first answers
    cut at its token limit (most of the target's answers run past 256 tokens)."""
    from .data import read_jsonl

    ends = _end_ids(tokenizer)
    examples: dict[str, list] = {}
    out = []
    for folder in capture_dirs:
        files = sorted(Path(folder).glob("answers-*.jsonl.gz"))
        if not files:
            raise FileNotFoundError(f"{folder} holds no answers files (answers-*.jsonl.gz of treespec capture)")
        rows = [json.loads(line) for f in files for line in gzip.open(f, "rt", encoding="utf-8") if line.strip()]
        for row in sorted(rows, key=lambda r: r["index"]):
            answer = row["answer"][:-1] if row["answer"] and row["answer"][-1] in ends else row["answer"]
            if not answer:
                continue
            name, _, idx = row["source"].rpartition(":")
            if name not in examples:
                examples[name] = read_jsonl(name)
            ex = examples[name][int(idx)]
            if ex.messages is None:
                continue
            text = tokenizer.decode(answer, skip_special_tokens=True).strip()
            out.append({"source": row["source"], "messages": [*ex.messages, {"role": "assistant", "content": text}]})
    return out


def filter_follow_ups(rows: list[dict], overlap: EvalOverlap | None = None, *, repeat_threshold: float = 0.7,
                      **kw) -> tuple[list[dict], Counter]:
    """:func:`filter_user_turns` for follow-ups (``rows`` carry their ``messages``), after
    dropping those that repeat their conversation's first user turn (word 3-gram Jaccard >=
    ``repeat_threshold``, or the same normalised text)."""
    fresh, why = [], Counter()
    for row in rows:
        first = normalise(next(m["content"] for m in row["messages"] if m["role"] == "user")).split()
        text = normalise(row["prompt"]).split()
        a, b = _ngrams(first, 3) or {tuple(first)}, _ngrams(text, 3) or {tuple(text)}
        if first == text or len(a & b) >= repeat_threshold * len(a | b):
            why["repeats the first turn"] += 1
        else:
            fresh.append(row)
    kept, more = filter_user_turns(fresh, overlap, **kw)
    return kept, why + more


# ---- chunks and prompt sets -----------------------------------------------------------------------


def chunk_file(work, c: int) -> Path:
    """Where chunk ``c`` of raw messages is kept in the folder ``work``."""
    return Path(work) / f"chunk-{c:05d}.jsonl"


def _chunk_done(path: Path, part: list[dict] | None) -> bool:
    """Whether a raw chunk is there and, for follow-ups, follows exactly the conversations ``part``
    (a chunk written when the captures held fewer answers, or others, is made again)."""
    if not path.exists():
        return False
    if part is None:
        return True
    return [r["source"] for r in read_rows(path)] == [x["source"] for x in part]


def _part(conversations, c: int, batch_size: int):
    return None if conversations is None else conversations[c * batch_size: (c + 1) * batch_size]


def chunks_to_sample(work, chunks, batch_size: int = 64, conversations: list[dict] | None = None) -> list[int]:
    """Which of ``chunks`` (indices) ``work`` does not hold yet; with ``conversations`` (follow-ups,
    :func:`captured_conversations`), also those that follow other conversations than these."""
    return [c for c in chunks if not _chunk_done(chunk_file(work, c), _part(conversations, c, batch_size))]


def sample_chunk(model, tokenizer, work, c: int, seed: int, *, batch_size: int = 64,
                 conversations: list[dict] | None = None, max_new_tokens: int = 160) -> list[dict]:
    """Chunk ``c``: ``batch_size`` first turns, or with ``conversations`` a follow-up to each of
    its share of them (rows then carry their ``source``), sampled from seed ``(seed, c)`` and
    written to ``work`` under a temporary name, then renamed (a killed run leaves whole chunks)."""
    part = _part(conversations, c, batch_size)
    if part is None:
        rows = generate_user_turns(model, tokenizer, batch_size, seed, chunk=c, batch_size=batch_size,
                                   max_new_tokens=max_new_tokens)
    else:
        rows = generate_user_turns(model, tokenizer, len(part), seed, chunk=c, batch_size=batch_size,
                                   history=[x["messages"] for x in part], max_new_tokens=max_new_tokens)
        rows = [{**r, "source": x["source"]} for r, x in zip(rows, part)]
    path = chunk_file(work, c)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
    return rows


def read_chunks(work, chunks) -> list[dict]:
    """The raw rows of ``chunks`` (indices) of ``work``, in order."""
    return [r for c in chunks for r in read_rows(chunk_file(work, c))]


def kept_turns(rows: list[dict], conversations: list[dict] | None = None,
               overlap: EvalOverlap | None = None) -> tuple[list[dict], Counter]:
    """:func:`filter_user_turns` of first turns, or with ``conversations`` (those the rows follow
    up, by ``source``) :func:`filter_follow_ups`; ``overlap`` defaults to the packaged
    evaluation sets."""
    overlap = overlap if overlap is not None else EvalOverlap.packaged()
    if conversations is None:
        return filter_user_turns(rows, overlap)
    by_source = {x["source"]: x["messages"] for x in conversations}
    rows = [{**r, "messages": by_source[r["source"]]} for r in rows]  # chunks_to_sample checked every source
    return filter_follow_ups(rows, overlap)


def write_prompt_set(path, kept: list[dict]) -> Path:
    """The kept rows as a prompt set ``train-eagle``/``capture`` read: ``{"prompt", "seed",
    "chunk"}`` for first turns, ``{"messages": [..., user], "source", "seed", "chunk"}`` for
    follow-ups (gzip without a timestamp where ``path`` ends in ``.gz``: the same rows give the
    same bytes)."""
    path = Path(path)

    def row(r):
        if "messages" in r:
            return {"messages": [*r["messages"], {"role": "user", "content": r["prompt"]}], "source": r["source"],
                    "seed": r["seed"], "chunk": r["chunk"]}
        return {"prompt": r["prompt"], "seed": r["seed"], "chunk": r["chunk"]}

    lines = (row(r) for r in kept)
    if path.suffix == ".gz":
        _write_gz(path, lines)
    else:
        path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), encoding="utf-8")
    return path


def _write_gz(path: Path, rows) -> None:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        for r in rows:
            f.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
    path.write_bytes(buf.getvalue())

