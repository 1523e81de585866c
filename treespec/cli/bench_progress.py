"""What ``treespec bench`` says while it runs: bars on a terminal or a line per finished prompt
in a log, where its journal is, and how a stopped run resumes."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from .bars import Bars


def journal_line(args, journal: Path) -> str:
    """The line a run starts with: where its journal is, or that it resumes from one."""
    if args.journal is None and journal.exists():
        return (f"treespec: resuming from {journal}, the journal a stopped run of this report left (delete it to "
                f"start afresh)")
    return (f"treespec: journal {journal}: a stopped run resumes from it with --journal {shlex.quote(str(journal))}"
            + ("" if args.journal else "; removed once the report is written"))


def resume_hint(args, journal: Path, total: int) -> str:
    """What a stopped run says: how many prompts its journal keeps, and the exact command that
    resumes from it (the command as given, with ``--journal`` where it had none)."""
    kept = 0
    if journal.exists():
        kept = max(len(journal.read_text().splitlines()) - 1, 0)  # a header, then a line per prompt
    argv = list(args.argv) + ([] if args.journal else ["--journal", str(journal)])
    return (f"treespec: stopped with {kept} of {total} prompt(s) done, kept in {journal}; to resume:\n"
            f"  treespec {shlex.join(argv)}")


def progress_display():
    """Bars on a terminal; in a log (stderr redirected or piped), a line per finished prompt."""
    if sys.stderr.isatty():
        return Bars(lambda stage: "prompt" if stage == "prompts" else "config", leave=lambda stage: stage == "prompts",
                    postfix=lambda p: p.config)
    return PromptLines(sys.stderr)


class PromptLines:
    """The bench's progress where stderr is no terminal: one line per finished prompt, with each
    configuration's tokens/s on it (and its speedup over the first, HF generate, and tau), the
    time so far and an estimate of the time left; one line for the warm-up and one for the
    prompts read back from a journal."""

    def __init__(self, stream, clock=time.monotonic):
        self.stream, self.clock = stream, clock
        self.start = clock()
        self.since = None  # when the first prompt this process runs began
        self.ran = self.resumed = 0

    def __call__(self, p) -> None:
        if p.stage == "warmup" and p.done == p.total:
            self._say(f"warm-up done: {p.total} configuration(s) in {_duration(self.clock() - self.start)}")
        if p.stage != "prompts":
            return
        if p.config is not None:
            self.since = self.clock() if self.since is None else self.since
            return
        if p.resumed:
            self.resumed += 1
            if p.done == p.total:
                self._resumed()
            return
        self._resumed()
        self.ran += 1
        elapsed = self.clock() - (self.since if self.since is not None else self.start)
        left = elapsed / self.ran * (p.total - p.done)
        self._say(f"prompt {p.done}/{p.total}: {prompt_rates(p.runs)} [{_duration(elapsed)}"
                  + (f", about {_duration(left)} left]" if p.done < p.total else "]"))

    def _resumed(self) -> None:
        if self.resumed:
            self._say(f"{self.resumed} prompt(s) read back from the journal")
            self.resumed = 0

    def _say(self, line: str) -> None:
        print(f"treespec: {line}", file=self.stream, flush=True)

    def close(self) -> None:
        self._resumed()


def prompt_rates(runs: dict) -> str:
    """One prompt's records as ``name 12.3 tok/s; name 25.1 (2.04x, tau 2.71); ...``: the
    first, HF generate, is the baseline of the speedups."""
    base = next(iter(runs.values())).tokens_per_second
    cells = []
    for k, (name, rec) in enumerate(runs.items()):
        extra = [f"{rec.tokens_per_second / base:.2f}x"] if k and base > 0 else []
        if rec.metrics is not None:
            extra.append(f"tau {rec.metrics['mean_accepted_length']:.2f}")
        cells.append(f"{name} {rec.tokens_per_second:.1f}" + (" tok/s" if not k else "")
                     + (f" ({', '.join(extra)})" if extra else ""))
    return "; ".join(cells)


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
