"""Log lines and treespec warnings kept out of a conversation: while ``chat`` answers, what the
library logs or warns would land between the user's lines and the answers (issue 50: a 3-line
block each turn). Without ``-v`` they are written to ``--log-file`` or held and shown once the
session has ended; with ``-v`` they show as they come, as in every other command."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from pathlib import Path

__all__ = ["held_notes"]

FORMAT = "%(levelname)s %(name)s: %(message)s"  # the command line's (cli._main)
MAX_HELD = 50  # the last lines held for the end of a session; a log file keeps them all


class _Held(logging.Handler):
    """The conversation's records, formatted as the command line shows them; the last
    ``MAX_HELD`` kept."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT))
        self.lines: list[str] = []
        self.count = 0

    def emit(self, record):
        self.count += 1
        self.lines = [*self.lines[-(MAX_HELD - 1):], self.format(record)]


@contextlib.contextmanager
def held_notes(verbose: bool, log_file: str | None = None):
    """Inside, the root logger's handlers are replaced and warnings become records (logger
    ``treespec.warnings``): all go to ``log_file`` (appended) or are held and printed on stderr
    on leaving, after a line saying what they are. With ``verbose`` nothing changes."""
    if verbose:
        yield
        return
    root = logging.getLogger()
    if log_file is None:
        target = _Held()
    else:
        target = logging.FileHandler(Path(log_file).expanduser(), encoding="utf-8")
        target.setFormatter(logging.Formatter("%(asctime)s " + FORMAT))
    saved, shown = root.handlers[:], warnings.showwarning
    root.handlers, warnings.showwarning = [target], _as_record
    try:
        yield
    finally:
        root.handlers, warnings.showwarning = saved, shown
        target.close()
        if isinstance(target, _Held) and target.count:
            more = f" (the last {len(target.lines)} of {target.count})" if target.count > len(target.lines) else ""
            print(f"treespec: log lines held back during the conversation{more} (-v shows them as they come, "
                  "--log-file FILE keeps them):", file=sys.stderr)
            for line in target.lines:
                print(line, file=sys.stderr)
            sys.stderr.flush()


def _as_record(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning``: a warning as a log record (treespec's own as their one line)."""
    from ..warn import TreespecWarning

    text = str(message) if issubclass(category, TreespecWarning) else \
        warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    logging.getLogger("treespec.warnings").warning("%s", text)
