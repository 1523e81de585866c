"""The README's first screen (issue 50, item 6): what treespec is, the speed measured on a CPU
and the state on a GPU, the first commands with what they take; the precision caveats below
it. Its figures are the measured ones, given again with their commands further down the README
or in docs/benchmarks.md, never new ones."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SCREEN = 40  # lines a reader sees before scrolling


def first_screen() -> list[str]:
    return README.splitlines()[:SCREEN]


def test_first_screen_gives_the_speed_the_gpu_state_and_the_first_command():
    lines = first_screen()
    text = " ".join(" ".join(lines).split())
    assert "**On a CPU, about 3x plain HF `model.generate`:**" in text and "**3.32x** on GSM8K" in text
    assert "**On a GPU, not fast yet:**" in text and "**0.82x** HF generate" in text
    commands = [ln for ln in lines if ln.startswith("treespec ")]
    assert commands and commands[0].startswith("treespec generate")
    assert "about 30 s" in text and "under a second" in text  # what the first run and later ones take


def test_first_screen_leaves_the_precision_caveats_below():
    text = " ".join(first_screen())
    assert "near-tie" not in text and "rounding" not in text
    below = README.index("## Exactness: float32 and bfloat16")
    assert "near-tie" in README[below:below + 2000]


def test_the_snippets_wrong_answer_is_explained_beside_it():
    """SmolLM2-135M answers "12 * 7 = 90": said next to the snippet, so that it does not read as
    treespec's bug."""
    end = README.index("```", README.index("```python") + 3)
    note = " ".join(README[end:end + 400].split())
    assert '"12 * 7 = 90"' in note and "reproduces the target exactly" in note


def test_first_screen_figures_are_measured_ones():
    """Each speed-up on the first screen appears again with its run, below it or in
    docs/benchmarks.md."""
    rest = "\n".join(README.splitlines()[SCREEN:]) + (ROOT / "docs" / "benchmarks.md").read_text()
    figures = re.findall(r"\*\*(\d+\.\d+x)\*\*", " ".join(first_screen()))
    assert len(figures) >= 4
    for x in figures:
        assert x in rest, x
