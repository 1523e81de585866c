"""Tree specs (a preset name, ``chain-K`` or a JSON file) and draft specs (a shipped head, a
head directory, ``ngram``, ``none``, ``layers:K``, ``model:NAME``, any model drafter with
``+lookup``), read and checked without a model."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .common import UserError

LOOKUP_SUFFIX = "+lookup"


class HeadForAnotherModel(UserError):
    """The draft is an EAGLE head whose shapes or vocabulary are another model's."""


def tree(spec: str):
    """``(TreeConfig, short name)`` of a preset name, ``chain-K`` or a JSON tree file."""
    from ..config import PRESETS, TreeConfig

    if spec in PRESETS:
        return PRESETS[spec].config, spec
    if re.fullmatch(r"chain-[1-9][0-9]*", spec):  # chains longer than the presets' 8
        return TreeConfig.chain(int(spec[len("chain-"):])), spec
    path = Path(spec).expanduser()
    if not (path.suffix.lower() == ".json" or path.exists() or "/" in spec):
        raise UserError(f"unknown tree preset {spec!r}; known presets: {', '.join(PRESETS)} "
                        f"(or give a JSON file of paths)")
    if not path.is_file():
        raise UserError(f"no tree file at {spec}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{spec} is not valid JSON: {e}") from None
    hint = ('expected a list of child-rank paths like [[0], [1], [0, 0]], {"paths": [...]} or '
            '{"depth": 5, "top_k": 4, "num_nodes": 16}')
    try:
        if isinstance(data, dict) and set(data) == {"paths"}:
            data = data["paths"]
        if isinstance(data, dict) and set(data) == {"depth", "top_k", "num_nodes"}:
            return TreeConfig.dynamic(data["depth"], data["top_k"], data["num_nodes"]), path.stem
        if not (isinstance(data, list) and all(isinstance(p, list) and all(isinstance(r, int) and not isinstance(r, bool)
                                                                            for r in p) for p in data)):
            raise ValueError(hint)
        return TreeConfig.static(data), path.stem
    except (ValueError, TypeError) as e:
        msg = str(e)
        raise UserError(f"bad tree in {spec}: {msg}" + ("" if msg == hint else f"; {hint}")) from None


def check_draft_spec(spec: str) -> None:
    """Fail before loading any model when a draft head is missing."""
    from ..assets import DRAFTS, resolve_draft

    if spec.endswith(LOOKUP_SUFFIX):
        primary = spec[: -len(LOOKUP_SUFFIX)]
        if primary in ("ngram", "none", ""):
            raise UserError(f"--draft {spec}: '{LOOKUP_SUFFIX}' grafts prompt lookup onto a model drafter "
                            "(a head, layers:K or model:NAME), e.g. smollm2-135m-instruct-eagle+lookup")
        return check_draft_spec(primary)
    if spec.startswith("layers:"):
        if not spec[len("layers:"):].isdigit():
            raise UserError(f"--draft {spec}: give a layer count, e.g. layers:6 (the target's first 6 layers)")
        return
    if spec in ("ngram", "none") or spec.startswith("model:"):
        if spec == "model:":
            raise UserError("--draft model: needs a model name or path, e.g. model:smollm2-135m-instruct or model:PATH")
        return
    try:
        resolve_draft(spec)
    except FileNotFoundError as e:
        if spec in DRAFTS:
            raise UserError(f"the shipped draft {spec!r} is missing ({DRAFTS[spec][0]} has no config.json); "
                            f"use --draft ngram, or train one with treespec train-eagle") from None
        raise UserError(f"{e}; or use --draft ngram or --draft model:NAME") from None


