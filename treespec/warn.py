"""Warnings for a use of treespec that runs but is likely a mistake (a generation that runs past
the model's context, a draft that the target never accepts), through :mod:`warnings` as
transformers and torch warn of API misuse: Python shows them by default, tests can assert them
(``pytest.warns(TreespecWarning)``), ``warnings.filterwarnings`` silences them. What is not the
caller's doing (a busy machine, a cache rebuilt) is logged instead.
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["TreespecWarning", "warn"]


class TreespecWarning(UserWarning):
    """A call that treespec runs but that is probably not what the caller meant."""


def warn(message: str) -> None:
    """Warn with :class:`TreespecWarning`, attributed to the first caller outside treespec (the
    line of the user's code that made the call, as ``stacklevel`` would if it could count
    treespec's own frames)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "treespec":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, TreespecWarning, stacklevel=level)
