"""The terminal side of the library's progress callbacks: tqdm bars on stderr."""

from __future__ import annotations

import sys
from typing import Callable


class Bars:
    """The terminal side of the library's progress callbacks (which never print): one tqdm bar
    on stderr per ``stage`` of the reports, anything with ``stage``, ``done`` and ``total``.

    unit, leave: the bar's unit and whether it stays once done, each a value or a function of
                 the stage.
    postfix:     the text after the bar, from the report.
    disable:     tqdm's; None hides the bars when stderr is not a terminal, so that a redirected
                 log stays readable.
    say:         print each stage's ``message`` on its own line when the stage begins (a
                 model load: what is fetched or converted, and where).
    only:        the stages that get a bar (default: all).
    """

    def __init__(self, unit: str | Callable = "it", *, leave: bool | Callable = True,
                 postfix: Callable | None = None, disable: bool | None = None, say: bool = False,
                 only: tuple[str, ...] | None = None):
        self.unit, self.leave, self.postfix, self.disable = unit, leave, postfix, disable
        self.say, self.only = say, only
        self.bars, self.done = {}, set()

    def __call__(self, p):
        if p.stage in self.done:
            return
        bar = self.bars.get(p.stage)
        if bar is None:
            if self.say:
                print(f"treespec: {p.message}", file=sys.stderr, flush=True)
            if self.only is not None and p.stage not in self.only:
                self.done.add(p.stage)
                return
            from tqdm import tqdm

            unit = self.unit(p.stage) if callable(self.unit) else self.unit
            leave = self.leave(p.stage) if callable(self.leave) else self.leave
            bar = self.bars[p.stage] = tqdm(total=p.total, desc=p.stage, unit=unit, unit_scale=unit == "B",
                                            dynamic_ncols=True, leave=leave, disable=self.disable)
        bar.total, bar.n = p.total, p.done
        if self.postfix is not None:
            bar.set_postfix_str(self.postfix(p) or "", refresh=False)
        bar.refresh()
        if p.total is not None and p.done >= p.total:
            bar.close()
            self.done.add(p.stage)

    def close(self):
        for bar in self.bars.values():
            bar.close()
