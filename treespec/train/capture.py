"""Capture in shards: the target's own answers and features, resumable, for training heads.

    plan = capture_plan(cfg)                     # which conversations, in which order
    capture_shards(model, tokenizer, cfg)        # writes out_dir/shard-000000-000064.pt, ...
    records = load_shards(out_dir, eagle3=True)  # what train_eagle(captured=out_dir) reads

**Plan.** ``data`` is a comma-separated list of datasets (packaged names or JSONL paths),
each optionally sliced, ``gsm8k-train[:7000]``; ``mix`` weighs them (default: their
sizes). The datasets are interleaved by smooth weighted round-robin, so *every prefix* of
the plan has the mix's proportions: a head trained on the first 2,500 conversations of a
capture sees the same blend as one trained on all of it, and a capture stopped early is a
usable smaller capture.

**Answers.** ``answers="target"`` (self-distillation): the target writes every answer,
batched through treespec's engine without a draft (a batch on a CPU is compute-bound,
where a drafted token costs as much as a decoded one); a seeded ``sample_share`` of the
conversations is sampled at ``sample_temperature`` instead of greedy, so that the head also
sees the sampled regime. Their labels are the target's own tokens (samples of its
distribution, so cross-entropy on them matches that distribution in expectation); records
carry ``sampled`` so that validation can keep to greedy ones. ``answers="reference"``: the
data's answers, teacher-forced, labelled with the target's greedy token at each position
(the trainer's regular capture, for the self-distilled vs reference ablation).

**Features.** Of every position: by default both the EAGLE-3 fusion (states entering
layers low/mid/high) and the EAGLE-1/2 feature (the final post-norm state), side by side,
so that one capture trains either layout (:func:`load_shards` hands out views, no copy).

**Shards.** Plan entries ``[k*S, (k+1)*S)`` go to ``shard-{start}-{stop}.pt`` (written to
a temporary name, then renamed: a killed run leaves no partial shard). A re-run skips the
shards present, so a capture can span sessions; ``capture.json`` holds the configuration
and a re-run with a different one is refused (``max_examples`` may grow). Batches are
formed inside a shard, by length (greedy and sampled requests together, each at its own
temperature), so a resumed capture equals an uninterrupted one with the same batch size;
``batch_size`` may change between runs (it moves only rounding, so greedy choices at
near-ties).

**Answers files.** Beside every shard, ``answers-{start}-{stop}.jsonl.gz`` keeps what the
target wrote there (token ids of each answer, whether it was sampled): a few kB against a
shard's tens of MB, and the only costly part of it, since the features of a known answer
come back in one teacher-forced forward, several times faster than decoding it. A capture
folder whose shards were lost but whose answers files remain (kept in git, copied from
another machine) is resumed by the same command: each shard with an answers file is rebuilt
from it (same conversations, tokens and labels; features equal up to the rounding of a
batched forward against a decoded one), the rest are decoded, those first: decoding is what
a stopped run would lose, a rebuild can wait for the next. A re-run also writes the
answers file of any shard that lacks one. (So a capture killed between writing a range's
answers file and its shard resumes by rebuilding that shard: equal to the uninterrupted
run's up to that rounding.) A reference capture (``answers="reference"``) writes none: it
has no answers of the target's to keep.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .data import DataStats, Example, read_jsonl, tokenize_example
from .records import Progress, feature_ids, generated_records, teacher_forced_records
from .shards import MANIFEST, load_shards, shard_files

__all__ = ["CaptureConfig", "answers_of", "capture_plan", "capture_shards", "load_shards", "parse_data_spec",
           "shard_files"]  # load_shards and shard_files: from .shards, where reading lives

log = logging.getLogger(__name__)

# Padded tokens per teacher-forced forward of replayed answers: batches cut by length waste
# little padding, and the forward is already compute-bound at a few thousand tokens.
_REPLAY_TOKENS = 4096
# What must match between runs into one folder (max_examples may grow; out_dir may move).
# batch_size is free: it changes how requests share a forward, so only bf16/fp32 rounding and
# with it greedy choices at near-ties, not which conversations are answered or how.
_IDENTITY = ("data", "mix", "max_length", "max_new_tokens", "answers", "sample_share", "sample_temperature",
             "seed", "shard_size", "features", "model", "dtype", "options")
# Options the capture sets itself, per answer (its sampled share, its length, the tokenizer's EOS).
_OWN_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "do_sample", "max_new_tokens", "max_length",
                "eos_token_id", "pad_token_id", "seed")


@dataclass
class CaptureConfig:
    data: str  # "name[,name...]", each a packaged dataset or a JSONL path, optionally sliced: "gsm8k-train[:7000]"
    out_dir: str
    mix: tuple[float, ...] | None = None  # one weight per dataset; None: proportional to their sizes
    max_examples: int | None = None  # the first N conversations of the plan
    max_length: int = 512  # prompt + answer tokens; longer prompts are skipped and counted
    max_new_tokens: int = 256
    answers: str = "target"  # "target": self-distilled; "reference": the data's answers, teacher-forced
    sample_share: float = 0.0  # share of target answers sampled instead of greedy
    sample_temperature: float = 0.8
    seed: int = 0  # which conversations are sampled, and their sampling seeds
    shard_size: int = 64  # conversations per shard file
    batch_size: int = 64  # requests decoded together (formed inside a shard, greedy and sampled together)
    features: str = "both"  # "eagle3", "eagle1" or "both"
    model: str | None = None  # the target's name, recorded and checked on resume
    dtype: str | None = None  # as asked ("auto", "bfloat16", ...), recorded and checked on resume
    attention_backend: str = "auto"  # the engine's (FlashInfer on CUDA where it takes the model, else PyTorch)
    options: dict | None = None  # GenerationConfig fields the target answers with ({"repetition_penalty": 1.1})

    def __post_init__(self):
        if self.answers not in ("target", "reference"):
            raise ValueError(f"answers must be 'target' or 'reference', got {self.answers!r}")
        if self.options:
            try:  # as capture.json records them, so that a resume compares like with like
                self.options = json.loads(json.dumps(dict(sorted(self.options.items()))))
            except TypeError as e:
                raise ValueError(f"generation options must be plain values (they are recorded in {MANIFEST}): {e}") from None
        else:
            self.options = None
        if self.options and self.answers != "target":
            raise ValueError(f"generation options {sorted(self.options)} shape the target's own answers: they need "
                             f"answers='target' (a reference capture is labelled with the target's greedy, "
                             f"unprocessed choice at each position)")
        own = sorted(k for k in self.options or () if k in _OWN_OPTIONS)
        if own:
            raise ValueError(f"capture options {own} are set by the capture itself (sample_share, "
                             f"sample_temperature, max_new_tokens, max_length, the tokenizer's EOS): pass them there")
        if not 0.0 <= self.sample_share <= 1.0:
            raise ValueError(f"sample_share must be in [0, 1], got {self.sample_share}")
        if self.sample_share > 0 and not self.sample_temperature > 0:
            raise ValueError(f"sample_temperature must be > 0, got {self.sample_temperature}")
        if self.features not in ("eagle3", "eagle1", "both"):
            raise ValueError(f"features must be eagle3, eagle1 or both, got {self.features!r}")
        if self.shard_size < 1 or self.batch_size < 1:
            raise ValueError("shard_size and batch_size must be >= 1")
        if self.mix is not None:
            self.mix = tuple(float(w) for w in self.mix)
            if len(self.mix) != len(parse_data_spec(self.data)) or any(w < 0 for w in self.mix) or not sum(self.mix):
                raise ValueError(f"mix needs one non-negative weight per dataset in {self.data!r}, got {self.mix}")


# ---- plan -----------------------------------------------------------------------------------


def parse_data_spec(spec: str) -> list[tuple[str, int | None, int | None]]:
    """``"a[:100],b[100:],c"`` -> ``[("a", None, 100), ("b", 100, None), ("c", None, None)]``."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            raise ValueError(f"empty dataset name in {spec!r}")
        m = re.fullmatch(r"(.+?)\[(-?\d*):(-?\d*)\]", item)
        if m:
            out.append((m.group(1), int(m.group(2)) if m.group(2) else None, int(m.group(3)) if m.group(3) else None))
        else:
            out.append((item, None, None))
    return out


def _interleave(sizes: list[int], weights: list[float]) -> list[tuple[int, int]]:
    """``(dataset, index)`` pairs, smooth weighted round-robin: each prefix follows the
    weights as closely as whole items allow; an exhausted dataset drops out."""
    taken = [0] * len(sizes)
    credit = [0.0] * len(sizes)
    out = []
    live = [i for i, (n, w) in enumerate(zip(sizes, weights)) if n > 0 and w > 0]
    while live:
        total = sum(weights[i] for i in live)
        for i in live:
            credit[i] += weights[i] / total
        pick = max(live, key=lambda i: (credit[i], -i))
        credit[pick] -= 1.0
        out.append((pick, taken[pick]))
        taken[pick] += 1
        if taken[pick] == sizes[pick]:
            live.remove(pick)
    return out


def capture_plan(cfg: CaptureConfig) -> list[tuple[str, Example]]:
    """The conversations to capture, in order: ``(source key "dataset:index", example)``."""
    items = parse_data_spec(cfg.data)
    sets = []
    for name, start, stop in items:
        examples = read_jsonl(name)
        idx = list(range(len(examples)))[start:stop]
        sets.append([(f"{name}:{i}", examples[i]) for i in idx])
    weights = list(cfg.mix) if cfg.mix is not None else [float(len(s)) for s in sets]
    order = _interleave([len(s) for s in sets], weights)
    plan = [sets[d][i] for d, i in order]
    return plan[: cfg.max_examples] if cfg.max_examples is not None else plan


# ---- shards ---------------------------------------------------------------------------------


def _shard_name(start: int, stop: int) -> str:
    return f"shard-{start:06d}-{stop:06d}.pt"


def _answers_name(start: int, stop: int) -> str:
    return f"answers-{start:06d}-{stop:06d}.jsonl.gz"


def _answer_limit(cfg: CaptureConfig, prompt_len: int) -> int:
    """The most tokens the target writes after a prompt of ``prompt_len`` tokens: its own
    limit, whatever shares its batch."""
    return min(cfg.max_new_tokens, cfg.max_length - prompt_len)


def _answered(cfg: CaptureConfig, ex: Example) -> bool:
    """Whether the target writes this conversation's answer (else it is teacher-forced)."""
    return cfg.answers == "target" and ex.text is None


def _save_answers(path: Path, cfg: CaptureConfig, plan, records) -> None:
    """The target's answers among ``records``, one JSON line each, gzip without a timestamp
    (the same answers give the same bytes, so a folder of them sits well in git)."""
    rows = []
    for r in records:
        if _answered(cfg, plan[r["index"]][1]):
            plen = int(r["prompt_len"])
            rows.append({"index": int(r["index"]), "source": r["source"], "sampled": bool(r["sampled"]),
                         "prompt_len": plen, "answer": r["tokens"][plen:].tolist()})
    _write_answers(path, rows)


def _write_answers(path: Path, rows: list[dict]) -> None:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        for row in rows:
            row = {k: row[k] for k in ("index", "source", "sampled", "prompt_len", "answer")}
            f.write((json.dumps(row, separators=(",", ":")) + "\n").encode())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def _load_answers(path: Path) -> dict[int, dict]:
    try:
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return {int(row["index"]): row for row in rows}
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:  # gzip's and json's errors
        raise ValueError(f"{path} is not a readable answers file ({type(e).__name__}: {e}): "
                         f"delete it to decode its shard again") from None


# Settings that shape what the target writes for a prompt: another folder's answers stand for
# this capture's only where they agree (data, mix, shard and batch sizes, features do not).
_ANSWER_SHAPING = ("model", "dtype", "max_length", "max_new_tokens", "sample_share", "sample_temperature", "seed",
                   "options")


def answers_of(cfg: CaptureConfig, sources) -> dict[str, dict]:
    """The answers the capture folders ``sources`` hold, by source key (``dataset:index``; the
    first folder's where several answer one), refused unless they were written by the same
    model with ``cfg``'s answer-shaping settings. Cheap (answers files only): the command line
    calls it before loading the model."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if cfg.answers != "target":
        raise ValueError("answers from other captures need answers='target' (a reference capture decodes nothing)")
    if cfg.model is None:
        raise ValueError("answers from other captures need CaptureConfig.model (the target's name), to check that "
                         "they are its answers")
    keys = list(_ANSWER_SHAPING)
    if cfg.sample_share == 0:  # nothing sampled here: the sampling settings shape nothing
        keys = [k for k in keys if k not in ("sample_temperature", "seed")]
    mine = {k: getattr(cfg, k) for k in keys}
    by_key: dict[str, dict] = {}
    for src in map(Path, sources):
        mpath = src / MANIFEST
        if not mpath.exists():
            raise ValueError(f"answers from {src}: no {MANIFEST} there (not a treespec capture folder?)")
        theirs = json.loads(mpath.read_text())
        if theirs.get("answers", "target") != "target":
            raise ValueError(f"answers from {src}: a reference capture holds no answers of the target's")
        diff = [k for k in keys if theirs.get(k) != mine[k]]
        if diff:
            raise ValueError(f"answers from {src}: it was captured with other settings ("
                             + ", ".join(f"{k} {theirs.get(k)!r} there, {mine[k]!r} here" for k in diff)
                             + "): its answers are not what this capture would write; capture with its settings")
        files = sorted(src.glob("answers-*.jsonl.gz"))
        if not files:
            raise ValueError(f"answers from {src}: it holds no answers files (shards written before answers files "
                             f"were: run its own treespec capture command once to write them)")
        for f in files:
            try:
                rows = _load_answers(f)
            except ValueError as e:
                raise ValueError(f"answers from {src}: {e}".replace("delete it to decode its shard again",
                                                                     "leave that folder out or mend the file")) from None
            for row in rows.values():
                by_key.setdefault(row["source"], row)
    return by_key


def _borrow_answers(cfg: CaptureConfig, tokenizer, plan, ranges, by_key: dict[str, dict]) -> int:
    """Write the answers file of every range of ``cfg``'s plan (neither shard nor answers file
    yet) whose every conversation to answer ``by_key`` holds (:func:`answers_of`), so that the
    range is rebuilt, not decoded. Returns how many ranges got one; a range with a conversation
    none of them answered is left to decode. A borrowed prompt that tokenizes to another
    length here is refused (other data under the same name, or another tokenizer)."""
    out = Path(cfg.out_dir)
    eos = tokenizer.eos_token_id
    borrowed = short = 0
    for a, b in ranges:
        apath = out / _answers_name(a, b)
        if apath.exists() or (out / _shard_name(a, b)).exists():
            continue
        rows = []
        for i in range(a, b):
            key, ex = plan[i]
            if not _answered(cfg, ex):
                continue
            _, plen = tokenize_example(tokenizer, ex, answer="")
            if plen + 2 > cfg.max_length:
                continue  # too long to answer: skipped here as there
            row = by_key.get(key)
            if row is None:
                break
            if row["prompt_len"] != plen:
                raise ValueError(f"answers from other captures: {key} has a prompt of {row['prompt_len']} tokens there "
                                 f"and {plen} here (other data under that name, or another tokenizer or chat "
                                 f"template): leave --answers-from out for this data")
            short += len(row["answer"]) < _answer_limit(cfg, plen) and row["answer"][-1] != eos
            rows.append(dict(row, index=i))
        else:
            _write_answers(apath, rows)
            borrowed += 1
    log.info("capture %s: %d of %d shards' answers taken from other captures", out, borrowed, len(ranges))
    if short:
        log.warning("capture %s: %d borrowed answers stop short of their limit without an end of sequence: an older "
                    "capture cut them at the limit of the longest prompt in their batch; they are kept as cut",
                    out, short)
    return borrowed


def _check_manifest(out: Path, cfg: CaptureConfig, feature_ids) -> None:
    mpath = out / MANIFEST
    mine = {k: getattr(cfg, k) for k in _IDENTITY}
    mine["mix"] = list(cfg.mix) if cfg.mix is not None else None
    if mpath.exists():
        old = json.loads(mpath.read_text())
        diff = [k for k in _IDENTITY if old.get(k) != mine[k]]
        if old.get("feature_ids") != list(feature_ids):
            diff.append("feature_ids (another model?)")
        if diff:
            raise ValueError(f"{out} holds a capture made with other settings ({', '.join(diff)}): "
                             f"resume with the same ones or capture into a new folder")
    manifest = dict(asdict(cfg), mix=mine["mix"], feature_ids=list(feature_ids))
    tmp = mpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, mpath)


def _sampled(cfg: CaptureConfig, key: str) -> tuple[bool, int]:
    """Whether conversation ``key`` is sampled, and its sampling seed: fixed by (seed, key),
    so independent of shards, batches and resumes."""
    rng = random.Random(f"{cfg.seed}:{key}")
    return rng.random() < cfg.sample_share, rng.randrange(2**31)


@torch.inference_mode()
def capture_shards(model, tokenizer, cfg: CaptureConfig,
                   callback: Callable[[Progress], None] | None = None, answers_from=(),
                   borrowed: dict[str, dict] | None = None, stop: Callable[[], bool] | None = None) -> dict:
    """Capture the plan into ``cfg.out_dir`` shard by shard, skipping shards already there.

    ``answers_from``: capture folders (same model and answer settings) whose answers to the
    same prompts are taken instead of decoding them again: a range they answer whole is
    rebuilt from them (a capture of a subset, or of another mix, of data captured before).
    ``borrowed``: what :func:`answers_of` read from them already (the command line checks
    them before the model loads), so that their files are not read twice.
    ``stop``: asked before each shard after the first; True ends the capture there (a time
    budget spent), leaving whole shards: a prefix of the plan, which trains as it is.

    Returns a summary: ``{"shards", "written", "skipped", "rebuilt", "conversations",
    "generated_tokens", "seconds", "tokens_per_second", "too_long", "stopped"}`` (tokens and
    seconds of this run only; ``rebuilt``: shards written from their answers files, none
    decoded; ``stopped``: whether ``stop`` ended it).
    """
    if answers_from and borrowed is None:
        borrowed = answers_of(cfg, answers_from)  # refused before any work
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fids = feature_ids(model, cfg.features)
    if cfg.options:  # unknown or unsupported options fail here, before any work
        from ..processing import exact_generation_config
        exact_generation_config(model, **cfg.options)
    _check_manifest(out, cfg, fids)
    plan = capture_plan(cfg)
    if not plan:
        raise ValueError(f"{cfg.data} gives no conversations to capture")
    S = cfg.shard_size
    ranges = [(a, min(a + S, len(plan))) for a in range(0, len(plan), S)]
    todo = _ranges_to_capture(cfg, tokenizer, plan, ranges, borrowed)
    summary = {"shards": len(ranges), "written": 0, "skipped": len(ranges) - len(todo), "rebuilt": 0,
               "conversations": 0, "generated_tokens": 0, "seconds": 0.0, "too_long": 0, "stopped": False}
    t0 = time.perf_counter()
    conv_done = len(plan) - sum(b - a for a, b in todo)
    if callback:
        callback(Progress("capture", conv_done, len(plan), {"tok/s": 0.0, "shard": None}))
    for k, (a, b) in enumerate(todo):
        if k and stop is not None and stop():
            summary["stopped"] = True
            break
        path = _write_shard(model, tokenizer, cfg, plan, (a, b), fids, summary)
        conv_done += b - a
        if callback:
            callback(Progress("capture", conv_done, len(plan), {
                "tok/s": summary["generated_tokens"] / max(time.perf_counter() - t0, 1e-9), "shard": path.name}))
    summary["seconds"] = time.perf_counter() - t0
    summary["tokens_per_second"] = summary["generated_tokens"] / max(summary["seconds"], 1e-9)
    log.info("capture %s: %d shards written (%d rebuilt from answers files), %d already there; "
             "%d generated tokens in %.0f s (%.1f tok/s)", out, summary["written"], summary["rebuilt"],
             summary["skipped"], summary["generated_tokens"], summary["seconds"], summary["tokens_per_second"])
    return summary


def _ranges_to_capture(cfg: CaptureConfig, tokenizer, plan, ranges, borrowed) -> list[tuple[int, int]]:
    """The plan's ranges without a shard yet, those to decode first; on the way, every shard
    without an answers file gets one, and ``borrowed`` answers theirs (:func:`_borrow_answers`)."""
    out = Path(cfg.out_dir)
    done = {p.name for p in out.glob("shard-*.pt")}
    keep = cfg.answers == "target"  # a reference capture has no answers of the target's to keep
    for a, b in ranges:  # shards written before answers files were: give them theirs
        if keep and _shard_name(a, b) in done and not (out / _answers_name(a, b)).exists():
            _save_answers(out / _answers_name(a, b), cfg, plan,
                          torch.load(out / _shard_name(a, b), mmap=True, weights_only=True))
    if borrowed:
        _borrow_answers(cfg, tokenizer, plan, ranges, borrowed)
    todo = [r for r in ranges if _shard_name(*r) not in done]
    # Decoding first: it is the costly part that only this run can do, while a rebuild from an
    # answers file can wait (a run stopped early has then lost nothing it cannot replay).
    todo.sort(key=lambda r: keep and (out / _answers_name(*r)).exists())
    return todo


def _write_shard(model, tokenizer, cfg: CaptureConfig, plan, rng: tuple[int, int], fids, summary: dict) -> Path:
    """Decode (or rebuild from its answers file) the plan's range ``rng`` and write its shard,
    answers file first; counts go to ``summary``."""
    a, b = rng
    out = Path(cfg.out_dir)
    keep = cfg.answers == "target"
    stats = DataStats()
    apath = out / _answers_name(a, b)
    given = _load_answers(apath) if keep and apath.exists() else None
    records = _capture_range(model, tokenizer, cfg, plan, a, b, fids, stats, summary, given)
    if given is not None:
        summary["rebuilt"] += 1
    elif keep:
        _save_answers(apath, cfg, plan, records)  # first: a shard never stands without its answers
    path = out / _shard_name(a, b)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(records, tmp)
    os.replace(tmp, path)  # atomic: a shard is whole or absent
    summary["written"] += 1
    summary["conversations"] += len(records)
    summary["too_long"] += stats.skipped_too_long
    return path


def _capture_range(model, tokenizer, cfg, plan, a, b, fids, stats, summary, given=None) -> list[dict]:
    """The records of plan entries ``[a, b)``, in plan order. ``given``: the range's answers
    file (plan index -> row); the target's answers are then replayed, not decoded."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    by_index: dict[int, dict] = {}
    answered, forced = [], []  # (plan index, prompt ids, temperature, seed); (plan index, ids, prompt length)
    replayed = []  # (plan index, prompt + answer ids, prompt length, sampled)
    for i in range(a, b):
        key, ex = plan[i]
        if not _answered(cfg, ex):
            ids, plen = tokenize_example(tokenizer, ex)
            if ex.text is None and ex.answer is None:
                raise ValueError(f"{key} has no answer: answers='reference' needs one (use answers='target')")
            if len(ids) > cfg.max_length:
                stats.skipped_too_long += 1
            elif len(ids) >= 3:
                forced.append((i, ids, plen))
            continue
        ids, plen = tokenize_example(tokenizer, ex, answer="")
        if plen + 2 > cfg.max_length:
            stats.skipped_too_long += 1
            continue
        if given is not None:
            replayed.append(_replay_entry(cfg, (a, b), i, key, ids[:plen], given.get(i)))
            continue
        is_sampled, seed = _sampled(cfg, key)
        answered.append((i, ids[:plen], cfg.sample_temperature if is_sampled else 0.0, seed))
    # Greedy and sampled answers decode in one batch (each request at its own temperature,
    # with its own seeded generator): one full batch runs far faster than two part-full ones.
    answered.sort(key=lambda x: (len(x[1]), x[0]))  # similar lengths decode together
    for s in range(0, len(answered), cfg.batch_size):
        batch = answered[s: s + cfg.batch_size]
        recs = _generate(model, tokenizer, [x[1] for x in batch], fids, cfg, eos, [x[2] for x in batch],
                         [x[3] for x in batch])
        for (i, _, temperature, _), r in zip(batch, recs):
            summary["generated_tokens"] += r["tokens"].numel() - r["prompt_len"]
            by_index[i] = dict(r, sampled=temperature > 0)
    for s in range(0, len(forced), cfg.batch_size):
        batch = forced[s: s + cfg.batch_size]
        recs = teacher_forced_records(model, [(toks, plen) for _, toks, plen in batch], fids, pad)
        for (i, _, _), r in zip(batch, recs):
            by_index[i] = dict(r, sampled=False)
    # Replayed answers: labelled with the tokens the target wrote, so no logits are needed.
    replayed.sort(key=lambda x: (len(x[1]), x[0]))
    for batch in _by_tokens(replayed, cfg.batch_size):
        recs = teacher_forced_records(model, [(toks, plen) for _, toks, plen, _ in batch], fids, pad, labels="tokens")
        for (i, _, _, sampled), r in zip(batch, recs):
            by_index[i] = dict(r, sampled=sampled)
    return [dict(by_index[i], index=i, source=plan[i][0]) for i in sorted(by_index)]


def _replay_entry(cfg, span: tuple[int, int], i: int, key: str, prompt: list[int], row: dict | None) -> tuple:
    """``(plan index, prompt + answer ids, prompt length, sampled)`` of conversation ``i`` from its
    row in the answers file of plan entries ``span``; a ValueError where the row does not fit the
    plan (other data, settings or tokenizer)."""
    plen, is_sampled = len(prompt), _sampled(cfg, key)[0]
    if (row is None or row["source"] != key or row["prompt_len"] != plen or row["sampled"] != is_sampled
            or not 0 < len(row["answer"]) <= _answer_limit(cfg, plen)):
        found = "nothing" if row is None else (
            f"{row['source']}, a prompt of {row['prompt_len']} tokens, {len(row['answer'])} answer tokens, "
            f"{'sampled' if row['sampled'] else 'greedy'}")
        raise ValueError(f"{cfg.out_dir}: {_answers_name(*span)} does not match the plan at conversation {i} "
                         f"({key}, a prompt of {plen} tokens, {'sampled' if is_sampled else 'greedy'}; "
                         f"the file has {found}): it was written with other data, settings or tokenizer; "
                         f"delete it to decode this shard again")
    return i, prompt + row["answer"], plen, bool(row["sampled"])


def _by_tokens(items, max_batch: int, budget: int = _REPLAY_TOKENS) -> list[list]:
    """Consecutive batches of ``items`` (sorted by length, ``item[1]`` the ids) of at most
    ``max_batch`` items and ``budget`` padded tokens (an item longer than the budget alone):
    a forward's cost is its padded size."""
    batches, cur = [], []
    for it in items:
        if cur and (len(cur) == max_batch or (len(cur) + 1) * len(it[1]) > budget):
            batches.append(cur)
            cur = []
        cur.append(it)
    return batches + [cur] if cur else batches


def _generate(model, tokenizer, prompts, fids, cfg: CaptureConfig, eos, temperature, seeds) -> list[dict]:
    """The target's replies to ``prompts`` and the features of every position, one pass. Each
    reply's limit is its own (``max_new_tokens``, and ``max_length`` less its prompt), not its
    batch's: an answer does not depend on what it was decoded beside (batch size, data mix)."""
    max_new = [max(1, _answer_limit(cfg, len(p))) for p in prompts]
    return generated_records(model, prompts, fids, max_new, eos, attention_backend=cfg.attention_backend,
                             temperature=temperature, seeds=seeds, options=cfg.options, tokenizer=tokenizer)
