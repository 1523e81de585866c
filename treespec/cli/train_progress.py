"""train-eagle's and capture's progress on stderr: the lines the run says (a stage begun, skipped or done,
the plan), and each stage's progress as a bar on a terminal, else as a line every tenth of the
stage, both with the time the whole run has left where the run estimates it."""

from __future__ import annotations

import sys

#: the unit a stage's bar counts in
UNITS = {"prompts": "chunk", "answers": "conv", "capture": "conv", "regenerate": "conv", "train": "step",
         "tune": "prompt"}


def left_text(seconds: float) -> str:
    from ..train.budget import format_duration

    return f"about {format_duration(seconds)} left in all"


def figures(info: dict) -> str:
    """A report's figures: the trainer's loss, accuracy by step and tokens/s; a capture's
    generated tokens/s."""
    if "loss" in info:
        return (f"loss={info['loss']:.3f}, acc={','.join(f'{a:.2f}' for a in info['acc'])}, "
                f"tok_s={info['tok/s']:.0f}")
    return f"gen_tok_s={info['tok/s']:.1f}" if info.get("tok/s") else ""


class TrainReport:
    """The callback of a training run (:class:`treespec.train.Progress` reports). ``tty``:
    bars (default: whether stderr is a terminal); lines otherwise, so that a log stays readable."""

    def __init__(self, tty: bool | None = None, file=None):
        self.file = file or sys.stderr
        self.tty = self.file.isatty() if tty is None else tty
        self.bars: dict = {}
        self.tenth: dict[str, int] = {}

    def __call__(self, p) -> None:
        line = p.info.get("line")
        if line is not None:
            self._close(p.stage)
            print(f"treespec: {line}", file=self.file, flush=True)
            return
        if not p.total:
            return
        text = ", ".join(t for t in (figures(p.info), left_text(p.info["left"]) if "left" in p.info else "")
                         if t)
        if self.tty:
            self._bar(p, text)
        else:
            self._line(p, text)

    def _bar(self, p, text: str) -> None:
        from tqdm import tqdm

        bar = self.bars.get(p.stage)
        if bar is not None and (p.done < bar.n or p.total != bar.total):  # a new round of the stage
            self._close(p.stage)
            bar = None
        if bar is None:  # counted from here: what was done before (a resumed stage) is not this rate's
            bar = self.bars[p.stage] = tqdm(total=p.total, initial=p.done, desc=p.stage,
                                            unit=UNITS.get(p.stage, "it"), dynamic_ncols=True, file=self.file)
        bar.n = p.done
        bar.set_postfix_str(text, refresh=False)
        bar.refresh()
        if p.done >= p.total:
            self._close(p.stage)

    def _line(self, p, text: str) -> None:
        last, tenth = self.tenth.get(p.stage), 10 * p.done // p.total
        if last is not None and tenth <= last and p.done < p.total:
            return
        if p.done < p.total:
            self.tenth[p.stage] = tenth
        else:  # finished: a new round of the stage starts its lines again
            self.tenth.pop(p.stage, None)
        print(f"treespec: {p.stage}: {p.done:,}/{p.total:,} {UNITS.get(p.stage, 'it')}s ({p.done / p.total:.0%})"
              + (f", {text}" if text else ""), file=self.file, flush=True)

    def _close(self, stage: str) -> None:
        bar = self.bars.pop(stage, None)
        if bar is not None:
            bar.close()

    def close(self) -> None:
        for stage in list(self.bars):
            self._close(stage)
