"""A benchmark's journal: a JSONL file each finished prompt is appended to, from which a run
stopped part way (Ctrl-C, a lost machine) resumes with the same settings.

The first line holds the run's settings (:func:`journal_key`): the model and drafts by their
weights, the configurations, the prompts by digest, sampling, options, threads and the
machine. Each later line is one prompt: every configuration's :class:`RunRecord` and the
judgement of any greedy difference."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from ..divergence import Divergence
from ..machine import machine_info
from ..prompts import Prompt
from .configs import BenchSettings
from .results import ConfigResult, RunRecord

log = logging.getLogger(__name__)


def journal_key(model, prompts: list[Prompt], active: list[ConfigResult], s: BenchSettings, dtype,
                tolerance: float) -> dict:
    """What a journal's records depend on: a resumed run must match it in every field."""
    text = [[[int(t) for t in p.ids], p.category, list(p.turns), p.chat] for p in prompts]
    digest = hashlib.sha256(json.dumps(text).encode()).hexdigest()
    drafters = [r.config.drafter for r in active if r.config.drafter is not None]
    return {
        # The model and drafts by their weights (where they were loaded from may move; a head
        # retrained under the same name is another run).
        "model": type(model).__name__,
        "weights": [_fingerprint(model)] + [_fingerprint(m) for d in drafters for m in d.modules()],
        "configs": [{**r.config.describe(), "fast": r.config.fast} for r in active],
        "prompts": f"{len(prompts)} prompts, sha256 {digest[:16]}",
        "max_new_tokens": s.max_new_tokens, "sampling": dataclasses.asdict(s.sampling), "seed": s.seed,
        "options": {k: repr(v) for k, v in sorted(s.options.items())}, "dtype": str(dtype).removeprefix("torch."),
        "packed": None if s.packing is None else bool(s.packing.pack), "threads": torch.get_num_threads(),
        "attention_backend": s.attention_backend, "verify_graphs": s.verify_graphs, "near_tie_tolerance": tolerance,
        # Timings of one machine only: another CPU or library version starts a new journal.
        "machine": {k: v for k, v in machine_info().items()
                    if k in ("cpu", "cpu_id", "cpu_count", "torch", "transformers", "treespec", "cuda")},
    }


def _fingerprint(module) -> str:
    """A short digest of a module's parameters (names, shapes and sums): enough to tell two
    checkpoints apart, cheap next to a benchmark."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if t.is_floating_point() or t.dtype in (torch.int64, torch.int32, torch.bool):
                h.update(f"{name}{tuple(t.shape)}{float(t.double().sum()) if t.numel() else 0.0:.9e}".encode())
    return h.hexdigest()[:16]


class Journal:
    """:func:`run_bench`'s journal: a header line with the run's settings (:func:`journal_key`),
    then one line per finished prompt, in order (every configuration's record and judgement).
    Given the file of an earlier run with the same settings, its prompts are read back, not run
    again: their timings are that run's, and ``auto`` trees start the rest from their start-up
    profile again. A file of other settings is refused."""

    VERSION = 1

    def __init__(self, path: Path, key: dict):
        self.path, self.done = path, []
        key = json.loads(json.dumps(key))  # as it reads back (tuples become lists)
        if not path.exists() or path.stat().st_size == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"treespec_bench_journal": self.VERSION, "key": key}) + "\n")
            return
        raw = path.read_text()
        if not raw.endswith("\n"):  # a last record whole but for its newline: the next append starts a line
            with path.open("a") as f:
                f.write("\n")
        lines = raw.splitlines()
        try:
            head = json.loads(lines[0])
            old = head["key"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path} is not a treespec bench journal: give a new file or remove it") from None
        if head.get("treespec_bench_journal") != self.VERSION or old != key:
            diff = sorted(k for k in key.keys() | old.keys() if key.get(k) != old.get(k)) or ["version"]
            raise ValueError(f"{path} journals a run with other settings ({', '.join(diff)} differ): resume with the "
                             f"same command, or give a new journal file")
        for n, line in enumerate(lines[1:], start=2):
            try:
                rec = json.loads(line)
            except ValueError:
                if n == len(lines):  # the process stopped while writing it: that prompt runs again
                    log.warning("%s: line %d is cut short; its prompt runs again", path, n)
                    self._rewrite(lines[: n - 1])
                    break
                raise ValueError(f"{path}: line {n} is not JSON: give a new journal file") from None
            if rec.get("prompt") != len(self.done):
                raise ValueError(f"{path}: line {n} holds prompt {rec.get('prompt')}, expected {len(self.done)}")
            try:
                self.done.append(({c: RunRecord(**r) for c, r in rec["runs"].items()},
                                  {c: Divergence(**d) for c, d in rec["divergences"].items()}))
            except (KeyError, TypeError) as e:
                raise ValueError(f"{path}: line {n} is not a record this version of treespec reads ({e}): "
                                 f"give a new journal file") from None

    def restore(self, active: list[ConfigResult], notes: list[str]) -> None:
        """Put the journal's prompts back into the configurations' results, judgements too."""
        for i, (runs, divergences) in enumerate(self.done):
            for r in active:
                r.runs.append(runs[r.config.name])
                if r.config.name in divergences:
                    d = divergences[r.config.name]
                    r.mismatches.append(i)
                    r.first_diff[i] = d.position
                    r.divergences[i] = d
        if self.done:
            notes.append(f"resumed: the first {len(self.done)} prompt(s) were run by an earlier process with the same "
                         f"settings and read back from {self.path.name} (their timings are that run's)")

    def _rewrite(self, lines: list[str]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.path)  # whole or not at all

    def append(self, i: int, runs: dict[str, RunRecord], divergences: dict[str, Divergence]) -> None:
        # Without turn_prompts: only the judge reads them, while the prompt runs, and a long
        # prompt's ids (thousands for RAG) would be most of the file.
        rec = {"prompt": i, "runs": {c: {**dataclasses.asdict(r), "turn_prompts": []} for c, r in runs.items()},
               "divergences": {c: dataclasses.asdict(d) for c, d in divergences.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
