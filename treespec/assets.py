"""Draft heads that ship with treespec, by name."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DRAFTS", "resolve_draft"]

_ROOT = Path(__file__).resolve().parent / "assets"

#: name -> (directory, one-line description)
DRAFTS: dict[str, tuple[Path, str]] = {
    "smollm2-135m-instruct-eagle": (
        _ROOT / "smollm2-135m-instruct-eagle",
        "EAGLE-3 head for SmolLM2-135M-Instruct, self-distilled by treespec on maths, code and chat prompts (docs/training.md)",
    ),
}


def resolve_draft(path_or_name) -> Path:
    if isinstance(path_or_name, str) and path_or_name in DRAFTS:
        path = DRAFTS[path_or_name][0]
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the shipped draft {path_or_name!r} is missing from {path}")
        return path
    path = Path(path_or_name)
    if not path.exists():
        raise FileNotFoundError(
            f"no draft head at {path_or_name!r}: give a checkpoint directory or one of {', '.join(DRAFTS)}"
        )
    return path
